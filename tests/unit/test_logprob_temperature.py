"""The learner's log-probs are those of the distribution the generators sampled from: log_softmax(logits / T)
with T = generator.temperature, on every path (padded or packed, whole or chunked log-softmax, its gradient, the
entropy); at T = 1 exactly the values (bit for bit) of the untempered formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from async_rlhf.learner.batch import entropy_sum, token_logprobs
from async_rlhf.learner.microbatch import ForwardOptions, forward_logprobs

pytestmark = pytest.mark.unit

VOCAB = 11


def reference(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class TableModel(torch.nn.Module):
    """A stand-in causal LM: the logits of a position are a fixed row per token id (enough for the layouts)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(3.0 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_token_logprobs_under_a_temperature_and_their_gradient(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(1)
    logits = (4.0 * torch.randn(2, 6, VOCAB, generator=g)).requires_grad_()
    ids = torch.randint(0, VOCAB, (2, 6), generator=g)
    got = token_logprobs(logits, ids, chunk, temperature=temperature)
    want = reference(logits, ids, temperature)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert not torch.allclose(got.double(), reference(logits, ids, 1.0), atol=1e-2)  # the temperature matters
    weights = torch.randn(got.shape, generator=g)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (want_grad,) = torch.autograd.grad((want * weights.double()).sum(), logits)
    assert torch.allclose(grad, want_grad.float(), atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 3])
def test_temperature_one_is_the_untempered_formula_bit_for_bit(chunk: int) -> None:
    g = torch.Generator().manual_seed(2)
    logits = 4.0 * torch.randn(3, 7, VOCAB, generator=g)
    ids = torch.randint(0, VOCAB, (3, 7), generator=g)
    assert torch.equal(token_logprobs(logits, ids, chunk, temperature=1.0), token_logprobs(logits, ids, chunk))
    untempered = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if chunk == 0:
        assert torch.equal(token_logprobs(logits, ids, chunk, temperature=1.0), untempered)
    positions = torch.arange(5)
    flat = logits.reshape(-1, VOCAB)
    assert entropy_sum(flat, positions, chunk, temperature=1.0) == entropy_sum(flat, positions, chunk)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("chunk", [0, 4])
def test_the_learners_forward_divides_its_logits_by_the_sampling_temperature(pack: bool, chunk: int) -> None:
    model = TableModel()
    ids = torch.tensor([[1, 4, 2, 7, 3, 0], [5, 6, 9, 0, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [1.0, 1, 0, 0, 0]])
    logp, ent = forward_logprobs(model, ids, attn, ForwardOptions(pack, chunk, 0, temperature=0.7), entropy_mask=mask)
    want = reference(model.table[ids].detach(), ids, 0.7)
    assert torch.allclose(logp[mask > 0].double(), want[mask > 0], atol=1e-5)
    tempered = torch.log_softmax(model.table[ids[:, :-1]].detach().double() / 0.7, dim=-1)
    want_ent = float(-(tempered.exp() * tempered).sum(-1)[mask > 0].sum())
    assert ent == pytest.approx(want_ent, abs=1e-4)
    plain, plain_ent = forward_logprobs(model, ids, attn, ForwardOptions(pack, chunk, 0), entropy_mask=mask)
    same, same_ent = forward_logprobs(model, ids, attn, ForwardOptions(pack, chunk, 0, temperature=1.0),
                                      entropy_mask=mask)
    assert torch.equal(plain, same) and plain_ent == same_ent
