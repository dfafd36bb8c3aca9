"""One place decides a learner rank's device: the accelerator Ray assigned, CPU when none; every tensor of a
batch and every auxiliary model goes through the Placer (a device-recording stand-in checks it)."""

import dataclasses

import pytest
import torch
from test_batch import two_groups

from async_rlhf.learner.batch import collate
from async_rlhf.learner.device import Placer, pick_device


class Recording(Placer):
    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.tensors: list[int] = []
        self.modules: list[object] = []

    def tensor(self, t):
        self.tensors.append(id(t))
        return super().tensor(t)

    def module(self, m):
        self.modules.append(m)
        return super().module(m)


def test_the_device_is_the_assigned_accelerator_or_cpu() -> None:
    assert pick_device([], cuda_available=False) == torch.device("cpu")
    assert pick_device([], cuda_available=True) == torch.device("cpu")  # no GPU assigned: CPU, even if one is seen
    assert pick_device(["3"], cuda_available=True) == torch.device("cuda", 0)  # Ray's CUDA_VISIBLE_DEVICES=3
    with pytest.raises(RuntimeError, match="assigned GPU.*resources.learner_gpus=0"):
        pick_device([0], cuda_available=False)


def test_every_tensor_of_a_batch_goes_through_the_placer() -> None:
    batch = collate(two_groups(), pad_id=0, advantage="grpo")
    tensor_fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
                     if isinstance(getattr(batch, f.name), torch.Tensor)}
    assert len(tensor_fields) >= 7
    placer = Recording("meta")
    moved = placer.batch(batch)
    assert sorted(placer.tensors) == sorted(id(t) for t in tensor_fields.values())
    for name in tensor_fields:
        got = getattr(moved, name)
        assert got.device.type == "meta" and got.shape == tensor_fields[name].shape, name
    assert moved.group_ids == batch.group_ids and moved.observation_tokens == batch.observation_tokens
    assert batch.input_ids.device.type == "cpu"  # the original is left as it was


def test_models_go_through_the_placer() -> None:
    placer = Recording("meta")
    ref = torch.nn.Linear(3, 2)
    placed = placer.module(ref)
    assert placer.modules == [ref] and placed.weight.device.type == "meta"


class LoadRecorder:
    """A stand-in for ``from_pretrained``: records the dtype asked for and the device the model is moved to."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __call__(self, model_dir, dtype):
        self.calls.append(("load", dtype))
        recorder = self

        class Model:
            def to(self, device):
                recorder.calls.append(("to", torch.device(device)))
                return self

            def eval(self):
                recorder.calls.append(("eval", None))
                return self

        return Model()


def test_the_driver_evaluates_on_the_gpu_in_the_models_dtype_when_there_is_room(tmp_path) -> None:
    from async_rlhf.eval_model import load_eval_model

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    on_gpu = LoadRecorder()
    load_eval_model(str(tmp_path), "bfloat16", cuda_available=True, free_bytes=lambda: 10_000, from_pretrained=on_gpu)
    assert on_gpu.calls == [("load", torch.bfloat16), ("to", torch.device("cuda", 0)), ("eval", None)]
    # a GPU that vLLM fills (the cluster is up): the CPU, as without CUDA
    full = LoadRecorder()
    load_eval_model(str(tmp_path), "bfloat16", cuda_available=True, free_bytes=lambda: 1_000, from_pretrained=full)
    cpu = LoadRecorder()
    load_eval_model(str(tmp_path), "bfloat16", cuda_available=False, from_pretrained=cpu)
    assert full.calls == cpu.calls == [("load", torch.float32), ("to", torch.device("cpu")), ("eval", None)]

