"""Hand-computed checks of the policy objectives, KL estimators and loss reductions."""

import math

import pytest
import torch

from async_rlhf.config import ObjectiveConfig, choices
from async_rlhf.learner.objectives import (
    aggregate,
    correction_saturated,
    entropy_from_logits,
    interpolate_prox,
    kl_penalty,
    masked_mean,
    policy_loss,
)

torch.set_num_threads(1)

KINDS = choices("train.objective.kind")
AGGREGATIONS = choices("train.objective.aggregation")
LN = math.log
NAN = float("nan")
INF = float("inf")


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def run(kind, logp, prox, behav, adv, mask, **cfg_kwargs):
    """Loss, gradient w.r.t. logp and metrics of one policy_loss call on a fresh leaf."""
    logp = logp.clone().requires_grad_(True)
    versions = cfg_kwargs.pop("versions", None)
    cfg = ObjectiveConfig(kind=kind, **cfg_kwargs)
    extra = {}
    if kind == "decoupled_ppo_interp":
        extra = dict(token_versions=versions, current_version=4, prox_version=3)
    loss, metrics = policy_loss(logp, prox, behav, adv, mask, cfg, **extra)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


# ----------------------------------------------------------------------------- reductions


def test_masked_mean_hand_values_and_garbage_under_mask():
    x = t([[1.0, 2.0, NAN], [4.0, INF, -INF]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3.0)  # (1 + 2 + 4) / 3
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 4.0])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # empty selection: 0, not nan
    assert masked_mean(x, t([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), dim=1).tolist() == [0.0, 4.0]


def test_aggregate_hand_values():
    loss = t([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(2.5)  # (1+2+3+4) / 4
    # per-sequence means 2 and 4; the empty third row is not a sequence
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
    # Dr.GRPO: (1+2+3+4) / (B * T_max) = 10 / (3 * 4)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx(10.0 / 12.0)
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(loss, mask, "sum")


# ----------------------------------------------------------------------------- ppo


def test_ppo_hand_values_gradient_and_metrics():
    # ratio r = exp(logp - behav), eps_low = 0.1, eps_high = 0.3 -> clip range [0.9, 1.3]
    #  r    A   r*A   clip(r)*A  -min    clipped  d loss_t / d logp = -A r (0 when clipped)
    # 1.5   1   1.5   1.3        -1.3    yes      0
    # 0.5  -1  -0.5  -0.9         0.9    yes      0
    # 1.2   2   2.4   2.4        -2.4    no      -2.4
    # 0.95 -1  -0.95 -0.95        0.95   no       0.95
    # 0.5   1   0.5   0.9        -0.5    no      -0.5
    # 1.5  -1  -1.5  -1.3         1.5    no       1.5
    # token_mean over 6 tokens (the 7th is padding): sum = -0.85
    ratios = [1.5, 0.5, 1.2, 0.95, 0.5, 1.5]
    behav = t([[-1.0, -2.0, -0.5, -1.5, -3.0, -2.5, 7.0]])
    logp = behav + t([[LN(r) for r in ratios] + [5.0]])
    log_w = [LN(2.0), LN(0.5), 0.0, 0.0, 0.0, LN(8.0)]  # prox - behav, only seen by the metrics
    prox = behav + t([log_w + [0.0]])
    adv = t([[1.0, -1.0, 2.0, -1.0, 1.0, -1.0, 3.0]])
    mask = t([[1.0] * 6 + [0.0]])
    loss, grad, m = run("ppo", logp, prox, behav, adv, mask, eps_low=0.1, eps_high=0.3)
    assert loss.item() == pytest.approx(-0.85 / 6)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, -2.4 / 6, 0.95 / 6, -0.5 / 6, 1.5 / 6, 0.0])
    assert m["ppo/clip_frac"] == pytest.approx(2 / 6)
    assert m["ppo/ratio_mean"] == pytest.approx(6.15 / 6)
    # behaviour weights w = exp(prox - behav) = [2, .5, 1, 1, 1, 8] are reported even without correction
    assert m["is_weight/mean"] == pytest.approx(13.5 / 6)
    assert m["is_weight/max"] == pytest.approx(8.0)
    assert m["is_weight/min"] == pytest.approx(0.5)
    assert m["is_weight/frac_above_cap"] == pytest.approx(1 / 6)  # 8 > is_cap = 5
    assert m["is_weight/frac_truncated"] == 0.0 and m["is_weight/frac_masked"] == 0.0
    # approx_kl: k3 of current vs prox, q = exp(logp - prox) = r / w: mean(q - 1 - ln q)
    q = [r / math.exp(lw) for r, lw in zip(ratios, log_w)]
    assert m["ppo/approx_kl"] == pytest.approx(sum(x - 1 - LN(x) for x in q) / 6)
    assert all(isinstance(v, float) for v in m.values())


@pytest.mark.parametrize(
    "ratio, adv, eps_low, eps_high, expected",
    [
        (1.25, 1.0, 0.1, 0.3, -1.25),  # upper side: 1.25 < 1 + 0.3, not clipped
        (1.25, 1.0, 0.2, 0.2, -1.2),  # symmetric 0.2 clips it at 1.2
        (0.85, -1.0, 0.1, 0.3, 0.9),  # lower side: 0.85 < 1 - 0.1, clipped at 0.9: -min(-0.85, -0.9)
        (0.85, -1.0, 0.2, 0.2, 0.85),  # 0.85 > 1 - 0.2, not clipped
    ],
)
def test_ppo_asymmetric_clip(ratio, adv, eps_low, eps_high, expected):
    behav = t([[-1.0]])
    loss, grad, m = run("ppo", behav + LN(ratio), behav, behav, t([[adv]]), t([[1.0]]),
                        eps_low=eps_low, eps_high=eps_high)
    assert loss.item() == pytest.approx(expected)
    clipped = abs(expected) != pytest.approx(ratio)
    assert m["ppo/clip_frac"] == (1.0 if clipped else 0.0)
    assert grad.item() == pytest.approx(0.0 if clipped else -adv * ratio)


# ----------------------------------------------------------------------------- importance corrections


def _decoupled_inputs():
    # w = exp(prox - behav) = [2, 8]; r = exp(logp - prox) = 1.1 (inside [0.8, 1.28]); A = [1, -1]
    behav = t([[-2.0, -3.0, 0.0]])
    prox = behav + t([[LN(2.0), LN(8.0), 0.0]])
    logp = prox + t([[LN(1.1), LN(1.1), 0.0]])
    return logp, prox, behav, t([[1.0, -1.0, 0.0]]), t([[1.0, 1.0, 0.0]])


def test_decoupled_ppo_clamp_mode():
    # clamp: w' = [2, min(8, 5) = 5]; loss_t = -w' r A = [-2.2, 5.5]; token mean 1.65
    # d loss / d logp = -w' r A / 2 = [-1.1, 2.75]
    loss, grad, m = run("decoupled_ppo", *_decoupled_inputs(), is_cap=5.0, truncate_mode="clamp")
    assert loss.item() == pytest.approx(1.65)
    assert grad.tolist()[0] == pytest.approx([-1.1, 2.75, 0.0])
    assert m["is_weight/frac_truncated"] == pytest.approx(0.5)
    assert m["is_weight/frac_masked"] == 0.0
    assert m["is_weight/applied_mean"] == pytest.approx(3.5)
    assert m["is_weight/mean"] == pytest.approx(5.0) and m["is_weight/max"] == pytest.approx(8.0)


def test_decoupled_ppo_mask_mode_drops_but_counts_token():
    # mask: the token with w = 8 > 5 is dropped; it stays in the normaliser: (-2.2 + 0) / 2
    loss, grad, m = run("decoupled_ppo", *_decoupled_inputs(), is_cap=5.0, truncate_mode="mask")
    assert loss.item() == pytest.approx(-1.1)
    assert grad.tolist()[0] == pytest.approx([-1.1, 0.0, 0.0])
    assert m["is_weight/frac_truncated"] == 0.0
    assert m["is_weight/frac_masked"] == pytest.approx(0.5)
    assert correction_saturated(m)


def test_tis_token_always_clamps():
    inputs = _decoupled_inputs()
    for mode in ("clamp", "mask"):
        loss, grad, m = run("tis_token", *inputs, is_cap=5.0, truncate_mode=mode)
        assert loss.item() == pytest.approx(1.65)
        assert grad.tolist()[0] == pytest.approx([-1.1, 2.75, 0.0])
        assert m["is_weight/frac_truncated"] == pytest.approx(0.5)


def test_tis_seq_hand_values():
    # row 0: 2 tokens, w = [2, 1.5] -> W = 3; row 1: 3 tokens, w = [2, 4, 1] -> 8, clamped to 5
    # ratio 1: loss_t = -W A: row 0 [-3, -3], row 1 [5, 5, 5]
    behav = t([[-1.0, -1.0, 50.0], [-2.0, -2.0, -2.0]])
    prox = behav + t([[LN(2.0), LN(1.5), -90.0], [LN(2.0), LN(4.0), 0.0]])
    adv = t([[1.0, 1.0, 9.0], [-1.0, -1.0, -1.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, grad, m = run("tis_seq", prox.clone(), prox, behav, adv, mask, is_cap=5.0)
    assert loss.item() == pytest.approx(9.0 / 5.0)  # (-6 + 15) / 5
    assert grad.tolist() == [pytest.approx([-0.6, -0.6, 0.0]), pytest.approx([1.0, 1.0, 1.0])]
    assert m["is_weight/frac_truncated"] == pytest.approx(3 / 5)
    cfg = ObjectiveConfig(kind="tis_seq", is_cap=5.0, aggregation="seq_mean_token_mean")
    seq_loss, _ = policy_loss(prox.clone(), prox, behav, adv, mask, cfg)
    assert seq_loss.item() == pytest.approx(1.0)  # (-3 + 5) / 2


def test_mask_token_band_without_weighting():
    # w = [0.5, 1, 3, 6], band [0.8, 5]: tokens 0 and 3 dropped; w itself is not multiplied in
    # ratio 1, A = [1, 2, 3, 4]: loss = (0 - 2 - 3 + 0) / 4
    behav = t([[-1.0, -1.0, -1.0, -1.0]])
    prox = behav + t([[LN(0.5), 0.0, LN(3.0), LN(6.0)]])
    adv = t([[1.0, 2.0, 3.0, 4.0]])
    loss, grad, m = run("mask_token", prox, prox, behav, adv, torch.ones_like(adv), is_cap=5.0, is_floor=0.8)
    assert loss.item() == pytest.approx(-1.25)
    assert grad.tolist()[0] == pytest.approx([0.0, -0.5, -0.75, 0.0])
    assert m["is_weight/frac_masked"] == pytest.approx(0.5)
    assert m["is_weight/applied_mean"] == pytest.approx(0.5)


def test_mask_seq_geometric_mean_band():
    # geometric mean per sequence, band [0.8, 5]:
    # row 0: w = [2, 8] -> sqrt(16) = 4, kept (although one token is above the cap)
    # row 1: w = [6, 6] -> 6, dropped;  row 2: w = [0.25, 1] -> 0.5, dropped
    # row 3: w = [1] (+ padding with a huge weight) -> 1, kept
    # ratio 1, A = 1: loss = (-1 - 1 + 0 + 0 + 0 + 0 - 1) / 7 valid tokens
    behav = t([[-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0], [-1.0, -80.0]])
    prox = behav + t([[LN(2.0), LN(8.0)], [LN(6.0), LN(6.0)], [LN(0.25), 0.0], [0.0, 79.0]])
    mask = t([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv = torch.ones_like(mask)
    loss, grad, m = run("mask_seq", prox, prox, behav, adv, mask, is_cap=5.0, is_floor=0.8)
    assert loss.item() == pytest.approx(-3.0 / 7.0)
    assert grad.tolist() == [pytest.approx(v) for v in ([-1 / 7, -1 / 7], [0, 0], [0, 0], [-1 / 7, 0])]
    assert m["is_weight/frac_masked"] == pytest.approx(4 / 7)


def test_vtrace_hand_values():
    # w = exp(prox - behav); rho = min(5, w); c = min(1, w); last token L of each row uses rho_L;
    # weight_t = rho_t * prod_{i > t} d_i, d_i = c_i (i < L), rho_L (i = L), 1 off the mask.
    # row 0: w = [0.5, 2, 8]    -> rho = [0.5, 2, 5], d = [0.5, 1, 5], g = [5, 5, 1], weight = [2.5, 10, 5]
    # row 1: w = [4, hole, 0.5] -> rho = [4, -, 0.5], d = [1, 1, 0.5], g = [0.5, -, 1], weight = [2, -, 0.5]
    # A: row 0 = 1, row 1 = -2; value at logp = prox: -sum(weight * A) / 5 = -(17.5 - 5) / 5 = -2.5
    behav = t([[-1.0, -1.0, -1.0, 0.0], [-2.0, 30.0, -2.0, 0.0]])
    prox = behav + t([[LN(0.5), LN(2.0), LN(8.0), 0.0], [LN(4.0), -99.0, LN(0.5), 0.0]])
    adv = t([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    expected_grad = [pytest.approx([-0.5, -2.0, -1.0, 0.0]), pytest.approx([0.8, 0.0, 0.2, 0.0])]
    loss, grad, m = run("vtrace", prox, prox, behav, adv, mask, is_cap=5.0)
    assert loss.item() == pytest.approx(-2.5)
    assert grad.tolist() == expected_grad
    assert m["is_weight/frac_truncated"] == pytest.approx(1 / 5)
    assert m["vtrace/trace_mean"] == pytest.approx(12.5 / 5)  # g = [5, 5, 1, 0.5, 1]
    assert m["vtrace/trace_min"] == pytest.approx(0.5)
    # the gradient is that of -rho g A logp wherever logp is; the value is -rho g A (logp - prox + 1)
    loss, grad, _ = run("vtrace", prox + 0.3, prox, behav, adv, mask, is_cap=5.0)
    assert loss.item() == pytest.approx(-2.5 * 1.3)
    assert grad.tolist() == expected_grad


# ----------------------------------------------------------------------------- properties of all kinds


def _ragged_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 0, 0, 0]])
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(mask.shape[0], 1, generator=g, dtype=torch.float64).expand(mask.shape).clone()
    versions = torch.randint(0, 4, mask.shape, generator=g)
    return logp, adv, mask, versions


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_on_policy_every_kind_is_the_policy_gradient(kind, aggregation):
    """behav = prox = current: the value is aggregate(-A) and the gradient that of aggregate(-A logp)."""
    logp, adv, mask, versions = _ragged_batch()
    loss, grad, m = run(kind, logp, logp, logp, adv, mask, aggregation=aggregation, versions=versions)
    ref_logp = logp.clone().requires_grad_(True)
    ref = aggregate(-adv * ref_logp, mask, aggregation)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert loss.item() == pytest.approx(aggregate(-adv, mask, aggregation).item(), abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert m["is_weight/mean"] == pytest.approx(1.0) and m["ppo/clip_frac"] == 0.0
    assert not correction_saturated(m)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_padding_never_changes_loss_gradient_or_metrics(kind, aggregation):
    logp, adv, mask, versions = _ragged_batch(seed=1)
    g = torch.Generator().manual_seed(2)
    prox = logp + 0.1 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    behav = prox + 0.8 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    cfg = dict(aggregation=aggregation, is_floor=0.3, truncate_mode="mask", versions=versions)
    loss, grad, m = run(kind, logp, prox, behav, adv, mask, **cfg)

    pad = mask == 0
    garbage = t([[NAN, INF, -INF, 1e4, -1e4]]).expand(mask.shape)
    def dirty(x):
        return torch.where(pad, garbage, x)
    cfg["versions"] = torch.where(pad, -7, versions)
    loss2, grad2, m2 = run(kind, dirty(logp), dirty(prox), dirty(behav), dirty(adv), mask, **cfg)
    assert loss2.item() == loss.item()
    torch.testing.assert_close(grad2, grad, rtol=0, atol=0)
    assert grad2[pad].abs().sum().item() == 0.0
    assert m2 == m

    if aggregation != "seq_mean_token_sum_norm":  # Dr.GRPO divides by T_max on purpose
        def widen(x, fill=3.0):  # one more padding column, as if a longer sequence were in the batch
            return torch.cat([x, torch.full_like(x[:, :1], fill)], dim=1)
        cfg["versions"] = widen(versions)
        loss3, _, _ = run(kind, widen(logp), widen(prox), widen(behav), widen(adv), widen(mask, 0.0), **cfg)
        assert loss3.item() == pytest.approx(loss.item(), abs=1e-12)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "decoupled_ppo_interp"])
def test_gradcheck_float64(kind):
    # (decoupled_ppo_interp builds prox from logp.detach(): a finite difference moves it too, by design)
    g = torch.Generator().manual_seed(3)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    prox = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
    # ratios within exp(+-0.1), far from the clip range [0.8, 1.28]; ppo measures the ratio against behav
    logp0 = prox + (torch.rand(mask.shape, generator=g, dtype=torch.float64) - 0.5) * 0.2
    spread = 0.1 if kind == "ppo" else 1.0
    behav = prox + (torch.rand(mask.shape, generator=g, dtype=torch.float64) - 0.5) * spread
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    cfg = ObjectiveConfig(kind=kind, is_cap=2.0, is_floor=0.7, aggregation="seq_mean_token_mean")

    def fn(logp):
        return policy_loss(logp, prox, behav, adv, mask, cfg)[0]

    assert torch.autograd.gradcheck(fn, (logp0.clone().requires_grad_(True),))


# ----------------------------------------------------------------------------- interpolation, errors


def test_interpolate_prox_edge_cases():
    # prox ~= behav + alpha (logp - behav), alpha = (prox_v - v) / (current_v - v) clipped to [0, 1]
    logp = t([[-1.0] * 5]).requires_grad_(True)
    behav = t([[-3.0] * 5])
    versions = torch.tensor([[2, 4, 3, 1, 0]])
    out = interpolate_prox(logp, behav, versions, current_version=4, prox_version=3)
    # v=2: 1/2 -> -2; v=4 (on-policy): 1 -> -1; v=3: 0 -> -3; v=1: 2/3 -> -3 + 4/3; v=0: 3/4 -> -1.5
    assert out.tolist()[0] == pytest.approx([-2.0, -1.0, -3.0, -3.0 + 4.0 / 3.0, -1.5])
    assert not out.requires_grad
    # prox older than the token (alpha < 0) -> behav; prox == current -> current
    assert interpolate_prox(logp, behav, versions, 4, 1).tolist()[0] == pytest.approx([-3, -1, -3, -3, -2.5])
    assert interpolate_prox(logp, behav, versions, 4, 4).tolist()[0] == pytest.approx([-1.0] * 5)


def test_interp_objective_needs_versions():
    logp, adv, mask, versions = _ragged_batch()
    cfg = ObjectiveConfig(kind="decoupled_ppo_interp")
    with pytest.raises(ValueError, match="token_versions, current_version, prox_version"):
        policy_loss(logp, None, logp, adv, mask, cfg)
    with pytest.raises(ValueError, match="missing: prox_version"):
        policy_loss(logp, None, logp, adv, mask, cfg, token_versions=versions, current_version=4)
    loss, _ = policy_loss(logp, None, logp, adv, mask, cfg, token_versions=versions, current_version=4,
                          prox_version=3)
    assert torch.isfinite(loss)


def test_bad_options_raise():
    logp, adv, mask, _ = _ragged_batch()
    with pytest.raises(ValueError, match="kind"):
        ObjectiveConfig(kind="a2c")  # the config refuses it; the loss checks too (for unchecked configs):
    with pytest.raises(ValueError, match="unknown objective kind"):
        policy_loss(logp, logp, logp, adv, mask, ObjectiveConfig.model_construct(kind="a2c"))
    with pytest.raises(ValueError, match="truncate_mode"):
        policy_loss(logp, logp, logp, adv, mask, ObjectiveConfig.model_construct(truncate_mode="drop"))
    with pytest.raises(ValueError, match="needs prox_logp"):
        policy_loss(logp, None, logp, adv, mask, ObjectiveConfig(kind="tis_token"))
    loss, m = policy_loss(logp, None, logp, adv, mask, ObjectiveConfig(kind="ppo"))  # ppo works without
    assert m["ppo/approx_kl"] == 0.0


def test_correction_saturated():
    def metrics(truncated, masked):
        return {"is_weight/frac_truncated": truncated, "is_weight/frac_masked": masked}
    assert correction_saturated(metrics(0.15, 0.1))  # 0.25 > 0.2
    assert not correction_saturated(metrics(0.1, 0.05))
    assert correction_saturated(metrics(0.1, 0.05), threshold=0.1)
    assert not correction_saturated({})


# ----------------------------------------------------------------------------- KL, entropy


def test_kl_estimators_hand_values():
    # log_ratio = logp - ref = [ln 2, -ln 2]
    logp = t([[LN(0.5), LN(0.25), NAN]]).requires_grad_(True)
    ref = t([[LN(0.25), LN(0.5), INF]])
    mask = t([[1.0, 1.0, 0.0]])
    ln2 = LN(2.0)
    assert kl_penalty(logp, ref, mask, "k1").tolist()[0] == pytest.approx([ln2, -ln2, 0.0])
    assert kl_penalty(logp, ref, mask, "k2").tolist()[0] == pytest.approx([0.5 * ln2**2, 0.5 * ln2**2, 0.0])
    # k3 = exp(-x) - 1 + x: [0.5 - 1 + ln 2, 2 - 1 - ln 2]
    k3 = kl_penalty(logp, ref, mask, "k3")
    assert k3.tolist()[0] == pytest.approx([ln2 - 0.5, 1.0 - ln2, 0.0])
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    assert grad.tolist()[0] == pytest.approx([0.5, -1.0, 0.0])  # d/dx = 1 - exp(-x)
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, mask, "k4")


def test_entropy_from_logits():
    # uniform over 4 -> ln 4; one allowed token -> 0; two -> ln 2; the padding token holds nan
    rows = [[0.0, 0.0, 0.0, 0.0], [0.0, -INF, -INF, -INF], [0.0, 0.0, -INF, -INF], [NAN, 1.0, 2.0, 3.0]]
    logits = t([rows]).requires_grad_(True)
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    ent = entropy_from_logits(logits, mask)
    assert ent.item() == pytest.approx((LN(4.0) + 0.0 + LN(2.0)) / 3)
    ent.backward()
    assert torch.isfinite(logits.grad).all()
    assert entropy_from_logits(logits, torch.zeros_like(mask)).item() == 0.0
