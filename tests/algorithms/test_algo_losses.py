"""Losses against the oracles T8, T9, T11, T12, T13 of docs/reference.md and their defining properties."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from streamrl.algorithms.losses import (
    AggMode,
    LossAggregation,
    PolicyLoss,
    aggregate_loss,
    clipped_value_loss,
    dis_policy_loss,
    entropy_from_logits,
    kl_penalty,
    ppo_clip_token_loss,
    ppo_policy_loss,
    rollout_importance_weights,
)
from streamrl.sft import sft_loss

F64 = torch.float64
TOL = 1e-6
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "dr-grpo"]


def t(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# --- T8 -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adv", "ratio", "clip_only", "c3", "c2", "c10"),
    [
        (-1, 5.0, 5.0, 3.0, 2.0, 5.0),
        (-1, 0.5, 0.8, 0.8, 0.8, 0.8),
        (1, 5.0, -1.28, -1.28, -1.28, -1.28),
        (1, 0.5, -0.5, -0.5, -0.5, -0.5),
    ],
)
def test_t8_ppo_dual_clip_token_loss(
    adv: float, ratio: float, clip_only: float, c3: float, c2: float, c10: float
) -> None:
    logp, old, a = t([math.log(ratio)]), t([0.0]), t([float(adv)])
    for c, expected in [(None, clip_only), (3.0, c3), (2.0, c2), (10.0, c10)]:
        loss = ppo_clip_token_loss(logp, old, a, eps_low=0.2, eps_high=0.28, dual_clip_c=c).loss
        assert float(loss[0]) == pytest.approx(expected, abs=TOL), c


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-3, 3), st.floats(-3, 3)), min_size=1, max_size=20),
    st.floats(min_value=1.01, max_value=20),
)
def test_dual_clip_never_changes_positive_advantage_tokens(
    pairs: list[tuple[float, float]], c: float
) -> None:
    log_ratio = t([p[0] for p in pairs]).requires_grad_()
    adv = t([p[1] for p in pairs])
    plain = ppo_clip_token_loss(log_ratio, torch.zeros_like(adv), adv).loss
    dual = ppo_clip_token_loss(log_ratio, torch.zeros_like(adv), adv, dual_clip_c=c).loss
    positive = adv > 0
    assert torch.equal(plain[positive], dual[positive])
    (g_plain,) = torch.autograd.grad(
        plain[positive].sum(), log_ratio, allow_unused=True, materialize_grads=True
    )
    (g_dual,) = torch.autograd.grad(
        dual[positive].sum(), log_ratio, allow_unused=True, materialize_grads=True
    )
    assert torch.equal(g_plain, g_dual)
    # and for A < 0 the Dual-Clip caps the loss at c |A|
    assert bool((dual[adv < 0] <= -adv[adv < 0] * c + 1e-12).all())


def test_ppo_policy_loss_diagnostics() -> None:
    # tokens: clipped high (A>0, r=5), clipped low (A<0, r=0.5), dual-clipped (A<0, r=5), unclipped
    ratios = t([[5.0, 0.5, 5.0, 1.0]])
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    out = ppo_policy_loss(
        ratios.log(), torch.zeros_like(ratios), adv, torch.ones_like(ratios), dual_clip_c=2.0
    )
    assert float(out.loss) == pytest.approx((-1.28 + 0.8 + 2.0 - 1.0) / 4)
    assert float(out.clip_frac_high) == 0.25
    assert float(out.clip_frac_low) == 0.25
    assert float(out.clip_frac_dual) == 0.25
    assert float(out.clip_frac) == 0.5
    assert float(out.masked_frac) == 0.0
    assert float(out.ppo_kl) == pytest.approx(-float(ratios.log().mean()))
    assert out.entropy is None and out.num_tokens == 4
    logits = torch.zeros(1, 4, 7, dtype=F64)
    with_logits = ppo_policy_loss(
        ratios.log(), torch.zeros_like(ratios), adv, torch.ones_like(ratios), logits=logits
    )
    assert float(with_logits.entropy) == pytest.approx(math.log(7))
    assert set(with_logits.metrics("actor/")) >= {
        "actor/loss",
        "actor/approx_kl",
        "actor/clip_frac",
        "actor/entropy",
    }


def test_unclipped_policy_loss_has_the_kl_diagnostics_of_ppo_and_no_clipping() -> None:
    """``PolicyLoss.unclipped`` (REINFORCE, a user's loss): the same KL estimates as PPO's on the same
    tokens, every clip fraction 0 even where PPO would clip."""
    ratios = t([[5.0, 0.5, 5.0, 1.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    loss = aggregate_loss(-ratios.log(), mask)
    out = PolicyLoss.unclipped(loss, ratios.log(), torch.zeros_like(ratios), mask)
    ppo = ppo_policy_loss(ratios.log(), torch.zeros_like(ratios), t([[1.0, -1.0, -1.0, 1.0]]), mask)
    assert out.loss is loss and out.num_tokens == 3
    assert float(out.ppo_kl) == pytest.approx(float(ppo.ppo_kl))
    assert float(out.approx_kl) == pytest.approx(float(ppo.approx_kl))
    assert float(ppo.clip_frac) > 0 and float(out.clip_frac) == float(out.clip_frac_dual) == 0.0
    assert out.entropy is None and float(out.masked_frac) == 0.0
    with pytest.raises(ValueError, match="behaviour_logp has shape"):
        PolicyLoss.unclipped(loss, ratios.log(), torch.zeros(1, 3, dtype=F64), mask)


def test_entropy_from_logits_matches_the_definition() -> None:
    logits = t([[2.0, 0.0, -1.0]])
    p = torch.softmax(logits, -1)
    assert float(entropy_from_logits(logits)[0]) == pytest.approx(float(-(p * p.log()).sum()))


def test_ppo_errors() -> None:
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_policy_loss(x, x, x, torch.ones_like(x), dual_clip_c=1.0)
    with pytest.raises(ValueError, match="mask shape"):
        ppo_policy_loss(x, torch.zeros(1, 3, dtype=F64), x, torch.ones_like(x))
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(x, x, t([1.0, 2.0]), torch.ones_like(x))


# --- rollout IS (SPO++ truncation at 2) and T13 (AReaL decoupled) ----------------------------------------------


def test_spo_pp_rollout_is_truncated_at_two() -> None:
    old = t([[math.log(3.0), math.log(1.5), 0.0]])
    rollout = torch.zeros_like(old)
    mask = t([[1.0, 1.0, 0.0]])
    is_ = rollout_importance_weights(old, rollout, mask, threshold=2.0)
    torch.testing.assert_close(is_.weights, t([[2.0, 1.5, 0.0]]))
    assert torch.equal(is_.mask, mask)
    assert float(is_.truncated_frac) == 0.5 and float(is_.rejected_frac) == 0.0
    seq = rollout_importance_weights(old, rollout, mask, threshold=10.0, level="sequence")
    torch.testing.assert_close(seq.weights, t([[4.5, 4.5, 0.0]]))


def test_t13_areal_decoupled_ppo() -> None:
    logp, prox, behav = t([[math.log(1.1)]]), t([[0.0]]), t([[math.log(0.5)]])
    mask, adv = t([[1.0]]), t([[1.0]])
    w = rollout_importance_weights(prox, behav, mask, threshold=5.0, mode="mask")
    assert float(w.weights[0, 0]) == pytest.approx(2.0)
    out = ppo_policy_loss(logp, prox, adv, mask, eps_low=0.2, eps_high=0.2, is_weights=w.weights)
    assert float(out.loss) == pytest.approx(-2.2, abs=TOL)
    assert float(out.clip_frac) == 0.0

    # cap 1.5: the token is masked out but stays in the denominator (second token has w = 1, ratio 1)
    logp2, prox2, behav2 = t([[math.log(1.1), 0.0]]), t([[0.0, 0.0]]), t([[math.log(0.5), 0.0]])
    mask2, adv2 = t([[1.0, 1.0]]), t([[1.0, 1.0]])
    w2 = rollout_importance_weights(prox2, behav2, mask2, threshold=1.5, mode="mask")
    assert w2.weights.tolist() == [[0.0, 1.0]] and w2.mask.tolist() == [[0.0, 1.0]]
    out2 = ppo_policy_loss(logp2, prox2, adv2, mask2, eps_low=0.2, eps_high=0.2, is_weights=w2.weights)
    assert float(out2.loss) == pytest.approx(-1.0 / 2, abs=TOL)
    assert float(out2.masked_frac) == 0.5


# --- T9 (SAO DIS) -------------------------------------------------------------------------------------------

T9_RATIOS = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
T9_ADV = [1.0, 1, -1, 1, -1, 1, 1]


def test_t9_dis_mask_and_aggregation() -> None:
    logp, rollout = t([T9_RATIOS]).log(), torch.zeros(1, 7, dtype=F64)
    mask, adv = torch.ones(1, 7, dtype=F64), t([T9_ADV])
    kept = dis_policy_loss(logp, rollout, adv, mask, eps_low=0.5, eps_high=1.0)
    assert float(kept.loss) == pytest.approx(1.25 / 7, abs=TOL)
    assert float(kept.masked_frac) == pytest.approx(4 / 7)
    assert float(kept.clip_frac_low) == pytest.approx(2 / 7) and float(kept.clip_frac_high) == pytest.approx(
        2 / 7
    )
    renorm = dis_policy_loss(logp, rollout, adv, mask, eps_low=0.5, eps_high=1.0, renormalize=True)
    assert float(renorm.loss) == pytest.approx(1.25 / 3, abs=TOL)
    # per-token loss -m r A = [0, 0, 0.75, -1, 1.5, 0, 0]: read it off one-token calls
    per_token = [
        float(
            dis_policy_loss(
                logp[:, i : i + 1], rollout[:, :1], adv[:, i : i + 1], mask[:, :1], eps_low=0.5, eps_high=1.0
            ).loss
        )
        for i in range(7)
    ]
    assert per_token == pytest.approx([0, 0, 0.75, -1, 1.5, 0, 0], abs=TOL)


def test_t9_production_bounds_accept_between_0_7_and_6() -> None:
    ratios = t([[0.69, 0.71, 5.99, 6.01]])
    out = dis_policy_loss(
        ratios.log(), torch.zeros_like(ratios), torch.ones_like(ratios), torch.ones_like(ratios)
    )
    assert float(out.masked_frac) == 0.5
    assert float(out.loss) == pytest.approx(-(0.71 + 5.99) / 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=2**16), st.sampled_from(["ratio", "logp"]))
def test_dis_gradient_vanishes_exactly_on_rejected_tokens(seed: int, form: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 8)
    logp = (-torch.rand(shape, generator=gen, dtype=F64) * 3).requires_grad_()
    rollout = logp.detach() + torch.randn(shape, generator=gen, dtype=F64)
    adv = torch.randn(shape, generator=gen, dtype=F64)
    mask = (torch.rand(shape, generator=gen) > 0.2).to(F64)
    out = dis_policy_loss(logp, rollout, adv, mask, eps_low=0.3, eps_high=1.0, form=form)  # type: ignore[arg-type]
    (grad,) = torch.autograd.grad(out.loss, logp)
    ratio = (logp.detach() - rollout).exp()
    accepted = (ratio > 0.7) & (ratio < 2.0) & mask.bool()
    assert bool((grad[~accepted] == 0).all())
    # on accepted tokens: d/dlogp of -r A / N = -A r / N (both forms)
    torch.testing.assert_close(grad[accepted], (-adv * ratio / mask.sum())[accepted], atol=1e-12, rtol=1e-10)


# --- T11 ----------------------------------------------------------------------------------------------------


def test_t11_kl_estimators() -> None:
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([0.5, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([0.125, 0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t([0.1065307, 0.7182818]), atol=TOL, rtol=0)
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), t([0.5, 1.0]))
    for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        assert torch.equal(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, kind))  # type: ignore[arg-type]
    assert float(kl_penalty(t([-30.0]), t([0.0]), "k3")[0]) == 10.0  # verl clamp
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


# --- T12 and micro-batching ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 3.5),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum", 10.5),
        ("seq-mean-token-sum-norm", 5.25),
        ("dr-grpo", 2.625),
    ],
)
def test_t12_aggregation(mode: str, expected: float) -> None:
    loss = t([[1, 2, 99, 99], [3, 4, 5, 6]])
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert float(aggregate_loss(loss, mask, LossAggregation(mode))) == pytest.approx(expected, abs=TOL)  # type: ignore[arg-type]


def test_aggregation_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        LossAggregation("mean")  # type: ignore[arg-type]


def test_closed_choices_follow_the_literal_types_and_errors_name_them() -> None:
    """The accepted values are the Literal aliases' members; anything else is refused with the valid set."""
    zeros, mask = torch.zeros(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64)
    assert list(get_args(AggMode)) == AGG_MODES
    for mode in get_args(AggMode):
        aggregate_loss(zeros, mask, LossAggregation(mode))
    with pytest.raises(ValueError, match=r"mode must be one of \('truncate', 'mask'\), got 'clip'"):
        rollout_importance_weights(zeros, zeros, mask, mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"level must be one of \('token', 'sequence'\), got 'batch'"):
        rollout_importance_weights(zeros, zeros, mask, level="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"form must be one of \('ratio', 'logp'\), got 'prob'"):
        dis_policy_loss(zeros, zeros, t([1.0]), mask, form="prob")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=2, max_value=9),
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=0, max_value=2**16),
)
def test_micro_batches_with_global_counts_sum_to_the_full_batch(
    batch: int, width: int, micro: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    token_loss = torch.randn(batch, width, generator=gen, dtype=F64)
    mask = (torch.rand(batch, width, generator=gen) > 0.3).to(F64)
    mask[:, 0] = 1
    for mode in AGG_MODES:
        full = aggregate_loss(token_loss, mask, LossAggregation(mode))  # type: ignore[arg-type]
        whole = LossAggregation.of_batch(mask, mode)  # type: ignore[arg-type]
        parts = sum(
            aggregate_loss(token_loss[rows], mask[rows], whole) for rows in torch.arange(batch).chunk(micro)
        )
        assert float(parts) == pytest.approx(float(full), abs=1e-12), mode


def test_ppo_gradient_accumulation_over_micro_batches_matches_the_full_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logp = (-torch.rand(6, 5, generator=gen, dtype=F64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(6, 5, generator=gen, dtype=F64)
    adv = torch.randn(6, generator=gen, dtype=F64)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).to(F64)
    full = ppo_policy_loss(logp, old, adv, mask, dual_clip_c=2.0).loss
    (g_full,) = torch.autograd.grad(full, logp)
    total = torch.zeros((), dtype=F64)
    for rows in torch.arange(6).chunk(3):
        total = (
            total
            + ppo_policy_loss(
                logp[rows],
                old[rows],
                adv[rows],
                mask[rows],
                dual_clip_c=2.0,
                agg=LossAggregation.of_batch(mask),
            ).loss
        )
    (g_micro,) = torch.autograd.grad(total, logp)
    assert float(total.detach()) == pytest.approx(float(full.detach()), abs=1e-12)
    torch.testing.assert_close(g_micro, g_full, atol=1e-12, rtol=0)


# --- value loss -----------------------------------------------------------------------------------------------


def test_clipped_value_loss() -> None:
    values = t([[1.0, 0.2, 7.0]]).requires_grad_()
    old = t([[0.0, 0.0, 7.0]])
    returns = t([[1.0, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    out = clipped_value_loss(values, old, returns, mask, clip_range=0.5)
    # token 0: max(0, (0.5 - 1)^2) = 0.25 (clipped branch); token 1: max(0.04, 0.04); token 2 masked
    assert out.metrics()["value_loss"] == pytest.approx(0.5 * (0.25 + 0.04) / 2)
    assert float(out.clip_frac) == 0.5
    (grad,) = torch.autograd.grad(out.loss, values)
    assert grad[0, 0] == 0 and grad[0, 2] == 0  # clipped branch is flat; masked token untouched
    plain = clipped_value_loss(values, old, returns, mask, clip_range=None)
    assert float(plain.loss.detach()) == pytest.approx(0.5 * (0.0 + 0.04) / 2)
    perfect = clipped_value_loss(returns.clone(), returns, returns, mask)
    assert float(perfect.explained_variance) == pytest.approx(1.0)


def test_sft_loss_counts_only_action_tokens() -> None:
    # Real expert data through the tiny model, against a per-sequence full-logit computation.
    from streamrl.agents.logprobs import token_logprobs
    from streamrl.agents.models import load_model, load_tokenizer, resolve_model
    from streamrl.agents.teacher_forcing import expert_trajectories, sequences_of

    tokenizer = load_tokenizer(resolve_model("tiny"))
    seqs = sequences_of(expert_trajectories("math_tir", tokenizer, limit=2))
    model = load_model(resolve_model("tiny"))
    loss, n = sft_loss(model, seqs, tokenizer.pad_token_id)
    assert n == sum(s.num_action_tokens for s in seqs)
    manual, context = [], []
    for s in seqs:  # one sequence at a time, no padding, full logits
        lp = token_logprobs(model, torch.tensor([s.token_ids]), torch.ones(1, len(s), dtype=torch.long))[0]
        manual += [-lp[i - 1].item() for i, m in enumerate(s.action_mask) if m]
        context += [-lp[i - 1].item() for i, m in enumerate(s.action_mask) if i and not m]
    assert abs(loss.item() - sum(manual) / len(manual)) < 1e-4
    # With a context weight, every other real token (not the padding) is a language-modelling target too.
    loss, n = sft_loss(model, seqs, tokenizer.pad_token_id, context_weight=0.25)
    assert n == len(manual) and len({len(s) for s in seqs}) > 1  # the batch really is padded
    assert abs(loss.item() - (sum(manual) / len(manual) + 0.25 * sum(context) / len(context))) < 1e-4
