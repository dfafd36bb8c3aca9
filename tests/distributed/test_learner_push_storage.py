"""Where the learner's push sends from, per ZeRO stage and dtype, on a real DeepSpeed engine: ZeRO-0 (every
dtype, parameters moved into one buffer by ``push_layout``) and ZeRO-1/2 (DeepSpeed's own flat buffers) send
straight from parameter memory, one broadcast and nothing packed, and keep doing so after optimizer steps,
which must still reach the parameters that are pushed. ZeRO-3 gathers fresh tensors for each push (with one
rank DeepSpeed gathers them into one buffer in order, so they too go out in place, but that is not promised);
there only the values are checked. Every push is received by a real receiver on a real gloo group and
compared with the learner's parameters."""

from __future__ import annotations

import pytest
import torch
from test_weight_push_preposted import HOST, Member, start, wait_until

from async_rlhf.learner.push import full_params, push_layout
from async_rlhf.sync.sender import Sender

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("module_process_group")]


def tiny_engine(zero_stage: int, dtype: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from async_rlhf.learner.engine import build_engine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    return build_engine(model, lr=1e-2, micro_batch=1, zero_stage=zero_stage, dtype=dtype)


def train_step(engine) -> None:
    ids = torch.randint(0, 96, (1, 12))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize(("zero_stage", "dtype"), [(0, "float32"), (0, "bfloat16"), (1, "bfloat16"), (2, "float32"),
                                                  (3, "float32")])
def test_the_learner_pushes_straight_from_parameter_memory(zero_stage: int, dtype: str) -> None:
    torch.set_num_threads(1)
    engine = tiny_engine(zero_stage, dtype)
    with full_params(engine, zero_stage) as params:
        buckets = push_layout(params, 1 << 20, zero_stage)
    sender = Sender(buckets, HOST, 0, timeout_s=20.0)
    gen0 = Member(sender, "gen0", buckets)
    start([gen0], sender)
    th = gen0.receive(3)
    try:
        before = None
        for v in (1, 2, 3):
            with full_params(engine, zero_stage) as params:
                sent = {n: p.detach().clone() for n, p in params.items()}
                metrics = sender.push(params, v)
            wait_until(lambda v=v: len(gen0.got) == v, f"version {v}")
            assert not isinstance(gen0.got[-1], Exception), gen0.got[-1]
            assert gen0.model.keys() == sent.keys()
            assert all(torch.equal(gen0.model[n], t) for n, t in sent.items()), f"version {v} arrived wrong"
            if before is not None:  # the optimizer step reached the parameters that are pushed
                assert any(not torch.equal(before[n], t) for n, t in sent.items()), f"version {v} is unchanged"
            if zero_stage < 3:
                assert metrics["sync/pack_s"] == 0.0 and len(sender.chunks) == 1, (metrics, sender.chunks)
            before = sent
            train_step(engine)
        th.join(10)
    finally:
        sender.close()
