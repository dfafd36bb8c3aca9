"""ZeRO-3 pushes and saves gather the model a window at a time (learner/zero3.py), on a real DeepSpeed ZeRO-3
engine over two gloo ranks: what a generator receives and what is saved equal the full model (gathered whole,
as a reference), and no gather ever holds more than ``learner.zero3_gather_mb`` of parameters: counted by a
recording wrapper around DeepSpeed's gather, and measured as the parameter bytes materialised while it is held.
A member reported dead during the first attempt makes rank 0 repeat the push without it; rank 1 gathers along
both passes.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from conftest import stop_process
from fork_server import fork_context

from async_rlhf.endpoints import free_port

pytestmark = pytest.mark.distributed

GATHER_BYTES = 48 << 10  # the tiny model holds ~250 KiB, its largest tensor 16 KiB


def engine(rank: int, port: int):
    import deepspeed
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from async_rlhf.learner.engine import ds_config

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                        config=ds_config(1, 1.0, zero_stage=3, world_size=2))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(rank))
    eng.backward(eng(input_ids=ids, labels=ids).loss)  # one step: the pushed weights are not the initial ones
    eng.step()
    return eng


class Recorder:
    """DeepSpeed's gather, recording what each gather holds: its parameters' full bytes and the parameter
    bytes actually materialised in the whole model while it is held."""

    def __init__(self, module: torch.nn.Module, on_gather=None) -> None:
        self.module, self.on_gather = module, on_gather
        self.calls: list[list[int]] = []  # ds_id of every parameter, per gather
        self.planned: list[int] = []
        self.materialised: list[int] = []

    def __call__(self, params):
        import contextlib

        from async_rlhf.learner.zero3 import deepspeed_gather, full_numel

        @contextlib.contextmanager
        def ctx():
            with deepspeed_gather(params):
                self.calls.append(sorted(p.ds_id for p in params))
                self.planned.append(sum(full_numel(p) * p.element_size() for p in params))
                self.materialised.append(sum(p.numel() * p.element_size() for p in self.module.parameters()))
                if self.on_gather is not None:
                    self.on_gather(len(self.calls))
                yield

        return ctx()


def rank_main(rank: int, port: int, save_dir: str, out) -> None:
    try:
        from async_rlhf.config import Config
        from async_rlhf.learner.push import WeightPusher, full_params, push_layout
        from async_rlhf.learner.zero3 import save_hf_windowed, windowed_gather

        eng = engine(rank, port)
        module = eng.module
        with full_params(eng, 3) as params:  # the reference: the whole model at once (collective)
            ref = {n: p.detach().clone() for n, p in params.items()}
        assert all(p.numel() == 0 for p in module.parameters()), "ZeRO-3 released the reference gather"
        buckets = push_layout(dict(module.named_parameters()), 8 << 10, 3)
        pusher = None
        if rank == 0:
            import threading

            from test_weight_push_preposted import HOST, Member, start

            cfg = Config()
            cfg.sync.timeout_s = 20.0

            class Pusher(WeightPusher):
                def _publish(self, version: int) -> None:  # no buffer here: its subject is elsewhere
                    self.published = version

            pusher = Pusher(cfg, buckets, HOST, 0, "unused")
            members = [Member(pusher.sender, m, buckets) for m in ("gen0", "gen1")]
            start(members, pusher.sender)
            gen0 = members[0]

            def receive_until_a_version() -> None:  # the first attempt aborts here (a victim): it fails once
                for _ in range(2):
                    try:
                        gen0.got.append(gen0.rx.receive(gen0.load, timeout_s=20.0))
                        return
                    except Exception as exc:
                        gen0.got.append(exc)

            threads = [threading.Thread(target=receive_until_a_version, daemon=True)]
            threads[0].start()  # gen1 never receives: the first attempt's acknowledgement waits for it
        # rank 0: gen1 (which never receives) is reported dead once the first window is held: the first attempt
        # fails mid-push, at its acknowledgement
        rec = Recorder(module, (lambda n: n == 1 and pusher.members_died(["gen1"])) if rank == 0 else None)
        windows = windowed_gather(module, buckets, GATHER_BYTES, gather=rec)
        result = {"windows": len(windows.windows), "planned_max": max(w.nbytes for w in windows.windows),
                  "model_bytes": sum(t.numel() * t.element_size() for t in ref.values())}
        if rank == 0:
            metrics = pusher.push(dict(module.named_parameters()), 1, windows)
            threads[0].join(30)
            got = gen0.got[-1]
            assert not isinstance(got, Exception), gen0.got
            result.update(version=got.version, dropped=metrics["sync/dropped"], members=pusher.sender.members,
                          published=pusher.published,
                          pushed_equal=sorted(n for n, t in ref.items() if torch.equal(members[0].model[n], t)),
                          pushed_names=sorted(members[0].model))
        else:
            windows.follow()
        result["push_calls"] = list(rec.calls)
        save_hf_windowed(module, save_dir, GATHER_BYTES, rank == 0, gather=rec)
        result.update(calls=rec.calls, planned=rec.planned, materialised=rec.materialised, ref_names=sorted(ref))
        if rank == 0:
            from transformers import AutoModelForCausalLM

            loaded = dict(AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).named_parameters())
            result["saved_equal"] = sorted(n for n, t in ref.items() if torch.equal(loaded[n].detach(), t))
            result["shards"] = sorted(f for f in os.listdir(save_dir) if f.endswith(".safetensors"))
        out.put((rank, result))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()


def test_zero3_push_and_save_gather_a_bounded_window_at_a_time(tmp_path) -> None:
    ctx = fork_context()  # the ranks fork from the session's server, which imported DeepSpeed once
    out = ctx.Queue()
    port = free_port()
    save_dir = str(tmp_path / "policy")
    procs = [ctx.Process(target=rank_main, args=(r, port, save_dir, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            stop_process(p)
    for rank, res in got.items():
        assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
    r0, r1 = got[0], got[1]
    names = r0["ref_names"]
    # what the generator received and what was saved are the full model, every tensor exact
    assert r0["version"] == 1 and r0["pushed_names"] == names and r0["pushed_equal"] == names
    assert r0["saved_equal"] == names and len(r0["shards"]) >= 3
    # the first attempt failed mid-push (gen1 reported dead), the second went through without it; rank 1
    # gathered every window of both passes, in the same order as rank 0 (the gathers are collectives)
    assert r0["dropped"] == 1.0 and r0["members"] == ["gen0"] and r0["published"] == 1
    assert r1["push_calls"] == r0["push_calls"] and len(r0["push_calls"]) == 2 * r0["windows"]
    assert r1["calls"] == r0["calls"]
    # bounded: several windows, none above the bound, neither as planned nor as materialised, while the whole
    # model is several times the bound
    assert r0["model_bytes"] > 4 * GATHER_BYTES and r0["windows"] >= 4
    for res in (r0, r1):
        assert max(res["planned"]) <= GATHER_BYTES, res["planned"]
        assert max(res["materialised"]) <= GATHER_BYTES, res["materialised"]
        assert max(res["materialised"]) > 0
