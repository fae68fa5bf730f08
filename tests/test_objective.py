"""actor_train's objective against an independent computation written as plain loops over responses and tokens from
the papers' formulas: the policy loss of every registered loss, the off-policy importance weights on it, the KL loss
of every registered estimator, the entropy bonus, each aggregation mode; values, parts and the gradient. Also the
numerics at extreme log-ratios (k3's bound, GSPO's sequence ratio) and diagnostics that stay fractions."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, batch_normalizer
from roll_core.algorithms.kl import K3_MAX
from roll_core.batch import Batch, loss_mask
from roll_core.config import load_config
from tests.conftest import EXAMPLES
from workers.actor_train import policy_objective

N, WIDTH = 6, 5
CLIP_LOW, CLIP_HIGH, DUAL_C = 0.2, 0.28, 3.0
KL_COEF, ENTROPY_COEF, SCALE = 0.3, 0.07, 7


def objective_overrides(loss: str, estimator: str, mode: str) -> list[str]:
    """Config overrides that set the objective to the constants the reference uses."""
    return [
        f"policy_loss={loss}", f"kl_estimator={estimator}", f"loss_agg_mode={mode}",
        f"pg_clip_low={CLIP_LOW}", f"pg_clip_high={CLIP_HIGH}", f"dual_clip_c={DUAL_C}",
        "use_kl_loss=true", f"kl_loss_coef={KL_COEF}", f"entropy_loss_coef={ENTROPY_COEF}",
        f"loss_scale_factor={SCALE}",
    ]


def config(loss: str, estimator: str, mode: str):
    return load_config(EXAMPLES / "math_code.yaml", objective_overrides(loss, estimator, mode)).config


def inputs(seed: int):
    """Log-probs far enough from the old ones that every clip and weight is active somewhere."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 1, 4, 5, 2]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(WIDTH)] for n in lengths])
    log_probs = (-torch.rand(N, WIDTH, generator=g) * 3).requires_grad_()
    entropy = (torch.rand(N, WIDTH, generator=g) * 2).requires_grad_()
    batch = Batch(
        {
            "response_mask": mask,
            "in_loss": torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0]),
            "old_log_probs": log_probs.detach() + torch.randn(N, WIDTH, generator=g) * 0.5,
            "ref_log_probs": log_probs.detach() + torch.randn(N, WIDTH, generator=g) * 0.8,
            "advantages": torch.randn(N, 1, generator=g).expand(N, WIDTH) * mask,
            "infer_is_weights": torch.rand(N, WIDTH, generator=g) * 1.5 + 0.2,
        }
    )
    return log_probs, entropy, batch


# ------------------------------------------------------------------ the reference, one response and token at a time


def clip(x, low, high):
    return torch.clamp(x, low, high)


def reference_policy_terms(loss: str, lp, old, adv, valid):
    """Per-token policy-gradient terms (lists of lists of 0-d tensors) for the valid tokens."""
    terms = []
    rows, width = lp.shape
    for i in range(rows):
        tokens = [t for t in range(width) if valid[i][t]]
        row = {}
        if loss == "gspo":  # one ratio per response, the geometric mean of its token ratios
            mean = sum(float(lp[i, t] - old[i, t]) for t in tokens) / max(len(tokens), 1)
            s = math.exp(min(mean, 10.0))
        if loss == "topr":  # TOPR's sequence weight for negative responses: the whole ratio, at most 1
            seq = sum(float(lp[i, t] - old[i, t]) for t in tokens)
            w_neg = math.exp(min(seq, 0.0))
        for t in tokens:
            a = float(adv[i, t])
            ratio = torch.exp(clip(lp[i, t] - old[i, t], -20.0, 20.0))
            if loss == "ppo_clip":
                term = torch.maximum(-a * ratio, -a * clip(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
                if a < 0 and float(term) > -a * DUAL_C:
                    term = torch.tensor(-a * DUAL_C)
            elif loss == "gspo":
                # value s, gradient s * d log pi_t: the sequence objective's gradient spread over its tokens
                r = s * torch.exp(lp[i, t] - lp[i, t].detach())
                term = torch.maximum(-a * r, -a * clip(r, 1 - CLIP_LOW, 1 + CLIP_HIGH))
            elif loss == "cispo":
                weight = float(clip(ratio.detach(), 1 - CLIP_LOW, 1 + CLIP_HIGH))
                term = -weight * a * lp[i, t]
            elif loss == "topr":
                weight = w_neg if a < 0 else 1.0
                term = -weight * a * lp[i, t]
            else:
                raise AssertionError(f"no reference for policy loss {loss!r}: add one")
            row[t] = term
        terms.append(row)
    return terms


def reference_kl(estimator: str, lp, ref) -> float:
    d = lp - ref  # log p - log q
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * d * d
    if estimator in ("k3", "low_var_kl"):
        x = clip(-d, -20.0, 20.0)
        return torch.clamp(torch.exp(x) - x - 1, max=K3_MAX)
    raise AssertionError(f"no reference for KL estimator {estimator!r}: add one")


def reference_aggregate(mode: str, terms: list[dict]):
    """terms[i][t] for valid tokens only; responses with none are left out of every mode."""
    rows = [row for row in terms if row]
    if mode == "token-mean":
        return sum(v for row in rows for v in row.values()) / sum(len(row) for row in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row.values()) / len(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(row.values()) for row in rows) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(row.values()) / SCALE for row in rows) / len(rows)
    raise AssertionError(f"no reference for aggregation mode {mode!r}: add one")


def reference_objective(loss: str, estimator: str, mode: str, lp, entropy, batch: Batch):
    """The whole objective, with the constants `config` sets; returns it and its pg_loss and kl_loss parts."""
    rows, width = lp.shape
    valid = [[bool(batch["response_mask"][i, t]) and bool(batch["in_loss"][i]) for t in range(width)] for i in range(rows)]
    pg = reference_policy_terms(loss, lp, batch["old_log_probs"], batch["advantages"], valid)
    weights = batch["infer_is_weights"]
    pg = [{t: v * float(weights[i, t]) for t, v in row.items()} for i, row in enumerate(pg)]
    kl = [{t: reference_kl(estimator, lp[i, t], batch["ref_log_probs"][i, t]) for t in row} for i, row in enumerate(pg)]
    ent = [{t: entropy[i, t] for t in row} for i, row in enumerate(pg)]
    pg_loss, kl_loss, bonus = (reference_aggregate(mode, x) for x in (pg, kl, ent))
    return pg_loss + KL_COEF * kl_loss - ENTROPY_COEF * bonus, {"pg_loss": pg_loss, "kl_loss": kl_loss}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS.names())
@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_objective_matches_a_plain_loop_computation(loss, estimator):
    for mode in LOSS_AGGREGATIONS.names():
        cfg = config(loss, estimator, mode)
        for seed in range(3):
            log_probs, entropy, batch = inputs(seed)
            norm = batch_normalizer(loss_mask(batch), mode)
            got, parts = policy_objective(log_probs, entropy, batch, cfg, norm)
            got_grads = torch.autograd.grad(got, (log_probs, entropy))
            want, want_parts = reference_objective(loss, estimator, mode, log_probs, entropy, batch)
            want_grads = torch.autograd.grad(want, (log_probs, entropy))
            where = f"{loss}/{estimator}/{mode}/seed {seed}"
            assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6), where
            for key in ("pg_loss", "kl_loss"):
                assert float(parts[key]) == pytest.approx(float(want_parts[key].detach()), rel=1e-5, abs=1e-6), (where, key)
            for name, g, w in zip(("log_probs", "entropy"), got_grads, want_grads, strict=True):
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-6), (where, name, (g - w).abs().max())


def test_each_term_moves_the_objective_the_way_it_should():
    """Signs, independent of the reference: more KL to the reference raises the loss, more entropy lowers it,
    a larger importance weight on a positive-advantage token lowers it."""
    cfg = config("ppo_clip", "k3", "token-mean")
    log_probs, entropy, batch = inputs(0)
    norm = batch_normalizer(loss_mask(batch), "token-mean")
    batch = batch.update({"ref_log_probs": log_probs.detach().clone()})  # KL 0 on every token
    base = float(policy_objective(log_probs, entropy, batch, cfg, norm)[0])
    further = batch.update({"ref_log_probs": batch["ref_log_probs"] - 1.0})
    assert float(policy_objective(log_probs, entropy, further, cfg, norm)[0]) > base
    assert float(policy_objective(log_probs, entropy + 1.0, batch, cfg, norm)[0]) < base
    positive = (batch["advantages"] > 0) & (loss_mask(batch) > 0)
    heavier = batch.update({"infer_is_weights": batch["infer_is_weights"] + 2.0 * positive})
    assert float(policy_objective(log_probs, entropy, heavier, cfg, norm)[0]) < base


# ------------------------------------------------------------------ numerics at extreme log-ratios


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
def test_k3_is_bounded_where_the_policy_leaves_the_reference_far_behind(estimator):
    kl = KL_ESTIMATORS.get(estimator)
    ref = torch.zeros(5)
    log_probs = torch.tensor([0.0, -1.0, -5.0, -30.0, -1000.0], requires_grad=True)
    value = kl(log_probs, ref)
    assert float(value[0]) == 0.0
    assert float(value[1]) == pytest.approx(math.exp(1) - 2, rel=1e-6)  # exact below the bound
    assert torch.all(value <= K3_MAX) and torch.all(value >= 0)
    assert float(value[2]) == K3_MAX  # e^5 - 6 = 142 unbounded
    value.sum().backward()
    assert torch.isfinite(log_probs.grad).all()
    assert log_probs.grad[2:].abs().max() == 0  # bounded terms give no gradient
    assert float(log_probs.grad[1]) == pytest.approx(1 - math.exp(1), rel=1e-6)  # d/dlp (e^-lp + lp - 1)
    # the other side stays unbounded in value only as far as x - 1 grows: finite, no overflow
    assert torch.isfinite(kl(torch.tensor([0.0]), torch.tensor([-1e4]))).all()


def test_gspo_sequence_ratio_is_the_geometric_mean_of_raw_token_ratios():
    loss = POLICY_LOSSES.get("gspo")
    mask = torch.ones(1, 10)
    old = torch.zeros(1, 10)
    adv = torch.ones(1, 10)
    log_probs = torch.zeros(1, 10)
    log_probs[0, 0] = -50.0  # one token far below: log s = -5, not -2 as a per-token clamp at 20 would make it
    per_token, _ = loss(log_probs, old, adv, mask, clip_low=10.0, clip_high=10.0)  # clip out of the way
    assert float(per_token[0, 3]) == pytest.approx(-math.exp(-5.0), rel=1e-5)
    # the sequence log-ratio is capped at 10: a huge rise cannot overflow
    up = torch.full((1, 10), 200.0, requires_grad=True)
    per_token, _ = loss(up, old, adv, mask, clip_low=1e9, clip_high=1e9)
    assert float(per_token[0, 0]) == pytest.approx(-math.exp(10.0), rel=1e-5)
    per_token.sum().backward()
    assert torch.isfinite(up.grad).all()
    # padding is left out of the mean whatever it holds
    padded_lp = torch.cat([log_probs, torch.full((1, 3), -1e30)], dim=1)
    padded = loss(padded_lp, torch.zeros(1, 13), torch.ones(1, 13), torch.cat([mask, torch.zeros(1, 3)], 1),
                  clip_low=10.0, clip_high=10.0)[0]
    assert float(padded[0, 3]) == pytest.approx(-math.exp(-5.0), rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_diagnostics_are_fractions_of_tokens_in_every_mode(mode):
    """clipfrac, dual_clipfrac and approx_kl are token means whatever loss_agg_mode is, and add up over micro-batches
    to the mini-batch's token mean."""
    cfg = config("ppo_clip", "k3", mode)
    log_probs, entropy, batch = inputs(3)  # seed 3: a token is dual-clipped
    mask = loss_mask(batch)
    tokens = float(mask.sum())
    norm = batch_normalizer(mask, mode)
    log_ratio = (log_probs.detach() - batch["old_log_probs"]).clamp(-20, 20)
    adv = batch["advantages"]
    ratio = log_ratio.exp()
    clipped = (-adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)) > (-adv * ratio)
    # dual clip: a negative advantage whose PPO loss max(-A r, -A clip(r)) is above the cap -c A
    dual = (adv < 0) & (torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)) > -adv * DUAL_C)
    want = {
        "clipfrac": float((clipped * mask).sum()) / tokens,
        "dual_clipfrac": float((dual * mask).sum()) / tokens,
        "approx_kl": float((-log_ratio * mask).sum()) / tokens,
        "entropy": float((entropy.detach() * mask).sum()) / tokens,
    }
    assert 0 < want["clipfrac"] < 1 and 0 < want["dual_clipfrac"] < 1
    sums: dict[str, float] = {}
    for rows in (range(0, 2), range(2, 5), range(5, 6)):
        micro = batch.select(rows)
        _, parts = policy_objective(log_probs[list(rows)], entropy[list(rows)], micro, cfg, norm, tokens)
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    for key, value in want.items():
        assert sums[key] == pytest.approx(value, rel=1e-5), key


def reference_clipped(loss: str, lp, old, adv, mask) -> torch.Tensor:
    """Where each loss reports a token as clipped, from its definition: PPO and GSPO where the clipped term is the
    larger (so clipping changed it), CISPO where the weight was bounded, TOPR on negative tokens of a response
    whose sequence ratio is above 1 (the weight was capped at 1)."""
    out = torch.zeros_like(lp)
    rows, width = lp.shape
    for i in range(rows):
        tokens = [t for t in range(width) if mask[i, t] > 0]
        seq = sum(float(lp[i, t] - old[i, t]) for t in tokens)
        for t in tokens:
            a = float(adv[i, t])
            r = math.exp(min(max(float(lp[i, t] - old[i, t]), -20.0), 20.0))
            if loss == "ppo_clip":
                flag = -a * min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH) > -a * r
            elif loss == "gspo":
                s = math.exp(min(seq / len(tokens), 10.0))
                flag = -a * min(max(s, 1 - CLIP_LOW), 1 + CLIP_HIGH) > -a * s
            elif loss == "cispo":
                flag = not (1 - CLIP_LOW <= r <= 1 + CLIP_HIGH)
            elif loss == "topr":
                flag = a < 0 and seq > 0
            else:
                raise AssertionError(f"no reference for policy loss {loss!r}: add one")
            out[i, t] = float(flag)
    return out


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_each_losss_diagnostics_follow_its_definition_and_are_zero_under_the_mask(loss):
    log_probs, _, batch = inputs(2)
    mask = loss_mask(batch)
    # padding holds values far from anything real: diagnostics must still be exactly 0 there
    lp = torch.where(mask > 0, log_probs.detach(), torch.full_like(mask, -50.0))
    old, adv = batch["old_log_probs"], batch["advantages"]
    kwargs = {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH, "dual_clip_c": DUAL_C}
    _, diag = POLICY_LOSSES.get(loss)(lp, old, adv, mask, **kwargs)
    want = reference_clipped(loss, lp, old, adv, mask)
    assert 0 < float(want.sum()) < float(mask.sum()), "the inputs clip some tokens and not others"
    assert torch.equal(diag["clipped"], want), (loss, diag["clipped"], want)
    log_ratio = (lp - old).clamp(-20, 20)
    assert torch.allclose(diag["approx_kl"], -log_ratio * mask)
    for name, values in diag.items():
        assert torch.all(values[mask == 0] == 0), (loss, name)
    if "dual_clipped" in diag:
        capped = (adv < 0) & (torch.maximum(-adv * log_ratio.exp(), -adv * log_ratio.exp().clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)) > -adv * DUAL_C)
        assert torch.equal(diag["dual_clipped"], (capped & (mask > 0)).float())


def test_topr_marks_only_negative_responses_whose_whole_sequence_ratio_is_above_1():
    """Rows at the edges of the definition: a negative response whose valid tokens sum to -0.5 beside two padding
    positions (padding must not enter the sum); a negative response on-policy (ratio exactly 1: its weight is 1,
    nothing was capped); responses with advantage 0 and 0.5 whose ratio is above 1 (not negative: not clipped)."""
    mask = torch.tensor(
        [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    )
    old = torch.full((5, 4), -1.5)
    lp = old + torch.tensor(
        [[-0.25, -0.25, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]
    )
    adv = torch.tensor([-1.0, -1.0, 0.0, 0.5, -1.0]).unsqueeze(1).expand(5, 4)
    _, diag = POLICY_LOSSES.get("topr")(lp, old, adv, mask)
    assert torch.equal(diag["clipped"], reference_clipped("topr", lp, old, adv, mask))
    assert diag["clipped"].sum(1).tolist() == [0.0, 0.0, 0.0, 0.0, 4.0]


def test_a_token_log_ratio_beyond_20_counts_as_20():
    """The ratio of a token is exp(log-ratio) with the log-ratio clamped to [-20, 20], so one token the policy
    moved by 25 nats costs exactly e^20 (times -A), not e^25."""
    mask, adv, old = torch.ones(1, 2), torch.full((1, 2), -1.0), torch.zeros(1, 2)
    lp = torch.tensor([[25.0, -25.0]])
    per_token, _ = POLICY_LOSSES.get("ppo_clip")(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert float(per_token[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-5)
    assert float(per_token[0, 1]) == pytest.approx(0.8, rel=1e-5)  # clipped from below: -A * (1 - 0.2)
    per_token, _ = POLICY_LOSSES.get("cispo")(lp, old, adv, mask, clip_low=1.0, clip_high=1e12)
    assert float(per_token[0, 0]) == pytest.approx(math.exp(20.0) * 25.0, rel=1e-5)  # -w A log pi, w = e^20
