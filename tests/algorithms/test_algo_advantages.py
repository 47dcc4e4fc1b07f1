"""Advantages and normalizations against the oracles T1, T7, T10 of docs/reference.md and their defining properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from streamrl.algorithms.advantages import (
    TRL_GRPO_EPS,
    broadcast_to_tokens,
    discounted_returns,
    gae,
    group_advantages,
    length_adaptive_lambda,
    masked_whiten,
    outcome_token_rewards,
    token_mean_residual,
    token_measure_normalize,
    trajectory_whiten,
)
from streamrl.algorithms.losses import aggregate_loss, rollout_importance_weights

F64 = torch.float64
TOL = 1e-6


def t(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def prefix_mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


def cov_over_mean(lengths: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Right side of SPO++ Eq. 5: Cov_n(L, Ã) / mean(L), divisor n."""
    return ((lengths - lengths.mean()) * (adv - adv.mean())).mean() / lengths.mean()


# --- T1 ---------------------------------------------------------------------------------------------------


def test_t1_trajectory_whitening_leaves_a_token_mean_residual() -> None:
    mask = prefix_mask([2, 5, 10])
    adv = trajectory_whiten(t([0.5, -0.5, 0.5]))
    torch.testing.assert_close(adv, t([0.5773503, -1.1547005, 0.5773503]), atol=TOL, rtol=0)
    assert abs(float(adv.sum())) < 1e-12
    lengths = mask.sum(-1)
    assert float((lengths * adv).sum()) == pytest.approx(1.1547005, abs=TOL)
    assert float(token_mean_residual(adv, mask)) == pytest.approx(0.0679236, abs=TOL)
    assert float(cov_over_mean(lengths, adv)) == pytest.approx(0.0679236, abs=TOL)  # Eq. 5


def test_t1_token_measure_normalization_has_zero_token_mean() -> None:
    mask = prefix_mask([2, 5, 10])
    adv = token_measure_normalize(t([0.5, -0.5, 0.5]), mask)
    torch.testing.assert_close(adv, t([0.6262243, -1.5029383, 0.6262243]), atol=TOL, rtol=0)
    assert abs(float((mask.sum(-1) * adv).sum())) < 1e-12
    # verl masked_whiten on the broadcast scalars (eps inside the sqrt) agrees to 1e-7
    verl = masked_whiten(broadcast_to_tokens(t([0.5, -0.5, 0.5]), mask), mask)
    torch.testing.assert_close(verl[:, 0], adv, atol=1e-7, rtol=0)
    torch.testing.assert_close(
        token_measure_normalize(t([0.5, -0.5, 0.5]), mask, eps_placement="var"),
        verl[:, 0],
        atol=1e-12,
        rtol=0,
    )


def test_t1_second_case() -> None:
    mask = prefix_mask([2, 5, 10])
    raw = t([0.5, -0.25, 0.25])
    traj = trajectory_whiten(raw)
    torch.testing.assert_close(traj, t([0.8728715, -1.0910894, 0.2182179]), atol=TOL, rtol=0)
    assert float((mask.sum(-1) * traj).sum()) == pytest.approx(-1.5275252, abs=TOL)
    assert float(token_mean_residual(traj, mask)) == pytest.approx(-0.0898544, abs=TOL)
    tok = token_measure_normalize(raw, mask)
    torch.testing.assert_close(tok, t([1.3775097, -1.4326101, 0.4408031]), atol=TOL, rtol=0)
    assert abs(float((mask.sum(-1) * tok).sum())) < 1e-12


# --- Eq. 5 / Eq. 6 as properties -----------------------------------------------------------------------------

batches = st.integers(min_value=2, max_value=12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(min_value=1, max_value=40), min_size=n, max_size=n),
        st.lists(st.floats(min_value=-1, max_value=1, allow_nan=False), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_token_measure_zeroes_the_token_mean_and_trajectory_whitening_obeys_eq5(batch: tuple) -> None:
    lengths, raw = batch
    raw_t = t(raw)
    mask = prefix_mask(lengths)
    L = mask.sum(-1)
    if float(raw_t.std()) < 1e-6:  # a constant batch has nothing to standardize
        return
    tok = token_measure_normalize(raw_t, mask)
    assert abs(float((L * tok).sum())) <= 1e-9 * float(L.sum())
    traj = trajectory_whiten(raw_t)
    residual = token_mean_residual(traj, mask)
    assert float(residual) == pytest.approx(float(cov_over_mean(L, traj)), abs=1e-12)  # Eq. 5
    if abs(float(cov_over_mean(L, raw_t))) > 1e-6:  # length and advantage co-vary
        assert abs(float(residual)) > 1e-9


def test_token_measure_uses_the_loss_mask_after_is_rejection() -> None:
    """L_i must come from the mask the loss aggregates over; then the loss-side token-mean is zero."""
    torch.manual_seed(0)
    lengths = [3, 7, 12, 5]
    mask = prefix_mask(lengths)
    old = torch.randn(mask.shape, dtype=F64) * 0.5
    rollout = torch.randn(mask.shape, dtype=F64) * 0.5
    is_ = rollout_importance_weights(old, rollout, mask, threshold=2.0, mode="mask")
    assert 0 < float(is_.rejected_frac) < 1
    adv = token_measure_normalize(t([1.0, -0.5, 0.25, 0.0]), is_.mask)
    token_mean = aggregate_loss(broadcast_to_tokens(adv, is_.mask), is_.mask)
    assert abs(float(token_mean)) < 1e-12
    stale = token_measure_normalize(t([1.0, -0.5, 0.25, 0.0]), mask)  # the pre-rejection mask
    assert abs(float(aggregate_loss(broadcast_to_tokens(stale, is_.mask), is_.mask))) > 1e-3


def test_whitening_rejects_batches_too_small_for_the_unbiased_divisor() -> None:
    with pytest.raises(ValueError, match="total weight > 1"):
        trajectory_whiten(t([0.3]))
    with pytest.raises(ValueError, match="rows"):
        token_measure_normalize(t([0.3, 0.1]), prefix_mask([1, 2, 3]))


# --- T7 -----------------------------------------------------------------------------------------------------


def test_t7_grpo_group_advantages() -> None:
    rewards, ids = t([1, 0, 1, 1]), ["q"] * 4
    torch.testing.assert_close(
        group_advantages(rewards, ids), t([0.499999, -1.499997, 0.499999, 0.499999]), atol=TOL, rtol=0
    )
    torch.testing.assert_close(
        group_advantages(rewards, ids, eps=TRL_GRPO_EPS),
        t([0.4999, -1.4997, 0.4999, 0.4999]),
        atol=1e-4,
        rtol=0,
    )
    torch.testing.assert_close(group_advantages(rewards, ids, scale="none"), t([0.25, -0.75, 0.25, 0.25]))
    assert torch.equal(group_advantages(t([1, 1, 1]), ["a"] * 3), torch.zeros(3, dtype=F64))
    assert torch.equal(group_advantages(t([0, 0]), ["a"] * 2), torch.zeros(2, dtype=F64))


def test_t7_group_of_one() -> None:
    torch.testing.assert_close(
        group_advantages(t([1.0, 0.0]), ["a", "b"], singleton="raw"), t([1.0, 0.0]), atol=TOL, rtol=0
    )
    assert torch.equal(group_advantages(t([1.0]), ["a"], singleton="zero"), t([0.0]))
    with pytest.raises(ValueError, match="size 1"):
        group_advantages(t([1.0, 0.0, 1.0]), ["a", "a", "b"])


def test_group_and_whitening_choices_are_refused_with_the_valid_set() -> None:
    with pytest.raises(ValueError, match=r"scale must be one of \('group', 'batch', 'none'\), got 'std'"):
        group_advantages(t([1.0, 0.0]), ["a", "a"], scale="std")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"singleton must be one of \('error', 'raw', 'zero'\), got 'drop'"):
        group_advantages(t([1.0, 0.0]), ["a", "b"], singleton="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"eps_placement must be one of \('std', 'var'\), got 'both'"):
        token_measure_normalize(t([1.0, 0.0]), prefix_mask([1, 2]), eps_placement="both")  # type: ignore[arg-type]


def test_group_advantages_interleaved_groups_and_batch_scale() -> None:
    rewards = t([1, 5, 0, 7, 1])
    ids = ["a", "b", "a", "b", "a"]
    out = group_advantages(rewards, ids)
    a = t([1, 0, 1])
    b = t([5, 7])
    torch.testing.assert_close(out[[0, 2, 4]], (a - a.mean()) / (a.std() + 1e-6))
    torch.testing.assert_close(out[[1, 3]], (b - b.mean()) / (b.std() + 1e-6))
    batch = group_advantages(rewards, ids, scale="batch")
    torch.testing.assert_close(batch[[1, 3]], (b - b.mean()) / (rewards.std() + 1e-6))


# --- T10 ----------------------------------------------------------------------------------------------------

T10_MASK = [[1.0, 1, 0, 0, 1, 1]]
T10_VALUES = [[0.5, 0.6, 9, 9, 0.7, 0.8]]


@pytest.mark.parametrize(
    ("lam", "adv", "ret"),
    [
        (1.0, [0.5, 0.4, 0.3, 0.2], [1.0, 1.0, 1.0, 1.0]),
        (0.9, [0.4168, 0.352, 0.28, 0.2], [0.9168, 0.952, 0.98, 1.0]),
    ],
)
def test_t10_skip_observation_gae(lam: float, adv: list[float], ret: list[float]) -> None:
    mask = t(T10_MASK)
    rewards = outcome_token_rewards(t([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0]]
    out = gae(rewards, t(T10_VALUES), mask, gamma=1.0, lam=lam)
    action = mask.bool()
    torch.testing.assert_close(out.advantages[action], t(adv), atol=TOL, rtol=0)
    torch.testing.assert_close(out.returns[action], t(ret), atol=TOL, rtol=0)
    assert out.advantages[~action].abs().sum() == 0  # observation values (9) never read


def test_t10_length_adaptive_lambda() -> None:
    torch.testing.assert_close(
        length_adaptive_lambda(t([10, 1000])), t([0.9333333, 0.9993333]), atol=TOL, rtol=0
    )
    assert float(length_adaptive_lambda(t([0.5]))[0]) == 0.0  # clamped (decision D10)


def _reference_gae_on_actions(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> list[float]:
    """Plain GAE on the compacted action-token sequence (observations deleted)."""
    adv, last, next_v = [0.0] * len(rewards), 0.0, 0.0
    for i in reversed(range(len(rewards))):
        delta = rewards[i] + gamma * next_v - values[i]
        last = delta + gamma * lam * last
        adv[i], next_v = last, values[i]
    return adv


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.booleans(), min_size=2, max_size=16).filter(any),
    st.floats(min_value=0.5, max_value=1.0),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(min_value=0, max_value=2**16),
)
def test_gae_equals_plain_gae_on_the_action_tokens(
    mask_bits: list[bool], gamma: float, lam: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = t([mask_bits])
    values = torch.randn(mask.shape, generator=gen, dtype=F64)
    rewards = torch.randn(mask.shape, generator=gen, dtype=F64) * mask
    out = gae(rewards, values, mask, gamma=gamma, lam=lam)
    keep = mask[0].bool()
    expected = _reference_gae_on_actions(rewards[0, keep].tolist(), values[0, keep].tolist(), gamma, lam)
    torch.testing.assert_close(out.advantages[0, keep], t(expected), atol=1e-12, rtol=1e-12)


def test_gae_per_trajectory_lambda_and_critic_returns() -> None:
    mask = t([T10_MASK[0], [1, 1, 1, 0, 0, 0]])
    rewards = outcome_token_rewards(t([1.0, 0.5]), mask)
    values = t([T10_VALUES[0], [0.1, 0.2, 0.3, 5, 5, 5]])
    both = gae(rewards, values, mask, lam=t([0.9, 0.5]))
    first = gae(rewards[:1], values[:1], mask[:1], lam=0.9)
    second = gae(rewards[1:], values[1:], mask[1:], lam=0.5)
    torch.testing.assert_close(both.advantages, torch.cat([first.advantages, second.advantages]))
    torch.testing.assert_close(
        discounted_returns(rewards, mask), t([[1, 1, 0, 0, 1, 1], [0.5, 0.5, 0.5, 0, 0, 0]])
    )
    torch.testing.assert_close(
        discounted_returns(rewards, mask, gamma=0.5)[1], t([0.125, 0.25, 0.5, 0, 0, 0])
    )


def test_gae_errors() -> None:
    mask = t(T10_MASK)
    with pytest.raises(ValueError, match="masked"):
        gae(t([[0, 0, 1.0, 0, 0, 0]]), t(T10_VALUES), mask)
    with pytest.raises(ValueError, match="no action token"):
        outcome_token_rewards(t([1.0]), torch.zeros(1, 3, dtype=F64))
    with pytest.raises(ValueError, match="lam"):
        gae(torch.zeros_like(mask), t(T10_VALUES), mask, lam=1.5)


def test_docs_worked_example_numbers() -> None:
    """The ALFWorld-like batch of docs/algorithms.md: long failures, short successes."""
    mask = prefix_mask([120, 800, 150, 900, 200, 700])
    raw = t([1, 0, 1, 0, 1, 0]) - t([0.5, 0.4, 0.6, 0.5, 0.3, 0.45])
    assert float(token_mean_residual(trajectory_whiten(raw), mask)) == pytest.approx(-0.6004770, abs=TOL)
    assert abs(float(token_mean_residual(token_measure_normalize(raw, mask), mask))) < 1e-15
