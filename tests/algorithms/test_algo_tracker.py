"""The event tracker against the oracles T2-T6 of docs/reference.md, its order invariance, persistence and errors."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from streamrl.algorithms.tracker import (
    EventTracker,
    Ticket,
    TrackerConfig,
    logprob_drift,
    offline_prior,
    sampling_weights,
    spo_retention,
)

TOL = 1e-6


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


# --- T2, T5: offline prior, SPO update and advantage timing -------------------------------------------------


def test_t2_offline_prior() -> None:
    assert offline_prior(3, 8, 8.0) == pytest.approx((3.1111111, 4.8888889), abs=TOL)
    assert offline_prior(0, 8, 8.0) == pytest.approx((0.4444444, 7.5555556), abs=TOL)
    assert offline_prior(8, 8, 8.0) == pytest.approx((7.5555556, 0.4444444), abs=TOL)
    assert offline_prior(0, 0, 8.0) == (0.5, 0.5)
    assert TrackerConfig().offline_prior_mass == pytest.approx(8.0)


def test_t2_t5_receipt_order_update_uses_the_pre_update_baseline() -> None:
    tracker = EventTracker(["x"], TrackerConfig(mode="receipt-order", rho=0.9))
    tracker.init_offline({"x": [1, 1, 1, 0, 0, 0, 0, 0]})
    assert tracker.value("x") == pytest.approx(0.3888889, abs=TOL)
    receipt = tracker.record(tracker.dispatch("x"), 1.0)
    assert receipt.advantage == pytest.approx(0.6111111, abs=TOL)  # not 1 - 0.4634146
    assert tracker.evidence("x") == pytest.approx((3.8, 4.4), abs=TOL)
    assert tracker.value("x") == pytest.approx(0.4634146, abs=TOL)
    eta = 1 / (0.9 * 8 + 1)  # the adaptive-EMA form of reference §3.1
    assert eta == pytest.approx(0.1219512, abs=TOL)
    assert tracker.value("x") == pytest.approx(0.3888889 + eta * (1 - 0.3888889), abs=1e-7)


def test_offline_scores_are_binarized_in_the_binary_domain() -> None:
    tracker = EventTracker(["a"], TrackerConfig())
    tracker.init_offline({"a": [0.0, 0.3, 2.0, 0.0]})  # SPO recipe: score > 0 -> 1
    assert tracker.evidence("a") == pytest.approx(offline_prior(2, 4, 8.0))


# --- T3: drift-derived retention ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drift", "raw", "clamped"),
    [
        (0.0, 1.0, 0.96),
        (0.003, 0.9659363, 0.96),
        (0.01, 0.8908987, 0.8908987),
        (0.03, 0.7071068, 0.875),
        (0.06, 0.5, 0.875),
    ],
)
def test_t3_spo_retention(drift: float, raw: float, clamped: float) -> None:
    assert 2 ** (-drift / 0.06) == pytest.approx(raw, abs=TOL)
    assert spo_retention(drift) == pytest.approx(clamped, abs=TOL)


def test_spo_drift_mode_takes_d_from_the_learner() -> None:
    tracker = EventTracker(["x"], TrackerConfig.spo())
    tracker.init_offline({"x": [1, 0]})  # alpha = beta = 4
    stored = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    new = torch.tensor([[-1.01, -1.99, 5.0]], dtype=torch.float64)
    drift = logprob_drift(stored, new, torch.tensor([[1.0, 1.0, 0.0]]))
    assert float(drift[0]) == pytest.approx(0.01)
    receipt = tracker.record(tracker.dispatch("x"), 1.0, drift=float(drift[0]))
    assert receipt.retention == pytest.approx(0.8908987, abs=TOL)
    assert tracker.evidence("x") == pytest.approx((4 * 0.8908987 + 1, 4 * 0.8908987), abs=1e-6)
    assert float(logprob_drift(stored, new, torch.zeros(1, 3))[0]) == 0.0  # first visit: D = 0
    with pytest.raises(ValueError, match="needs drift"):
        tracker.record(tracker.dispatch("x"), 1.0)


# --- T4: sampler --------------------------------------------------------------------------------------------


def test_t4_sampler_weights() -> None:
    w = sampling_weights([0.5, 0.9, 0.0])
    np.testing.assert_allclose(w, [0.55, 0.35, 0.05], atol=TOL)
    np.testing.assert_allclose(w / w.sum(), [0.5789474, 0.3684211, 0.0526316], atol=TOL)


def test_sampler_follows_the_weights_without_replacement() -> None:
    tracker = EventTracker(["even", "hard", "easy"], TrackerConfig(seed=7))
    tracker.init_offline({"even": [1, 0], "hard": [0] * 8, "easy": [1] * 8})
    probs = tracker.sampling_probabilities()
    values = [tracker.value(t) for t in ["even", "hard", "easy"]]
    expected = sampling_weights(values) / sampling_weights(values).sum()
    np.testing.assert_allclose(list(probs.values()), expected)
    draws = [tracker.sample(1)[0] for _ in range(4000)]
    for task, p in probs.items():
        assert draws.count(task) / len(draws) == pytest.approx(p, abs=0.03)
    pairs = [tracker.sample(3) for _ in range(50)]
    assert all(sorted(p) == ["easy", "even", "hard"] for p in pairs)  # without replacement
    again = EventTracker(["even", "hard", "easy"], TrackerConfig(seed=7))
    again.init_offline({"even": [1, 0], "hard": [0] * 8, "easy": [1] * 8})
    assert [again.sample(1)[0] for _ in range(4000)] == draws  # seeded


def test_strata_share_the_sampler_equally_and_weigh_within_as_before() -> None:
    """Balanced over strata: each label with an eligible task gets 1 / K, shared within it by w = sqrt(v(1-v)) +
    .05. With v = 1/2 (w = .55) and v = 3/22 (w = .393) in stratum A and one task (w = .55) in B, A's tasks get
    .55/.943/2 and .393/.943/2 and B's task 1/2 (without strata it would get .55/1.493 = .37)."""
    ids = ["a_even", "a_hard", "b_even"]
    strata = {"a_even": "A", "a_hard": "A", "b_even": "B"}
    tracker = EventTracker(ids, TrackerConfig(seed=3, prior_mass=10), strata=strata)
    tracker.init_offline({"a_even": [1] * 5 + [0] * 5, "a_hard": [1] + [0] * 9, "b_even": [1] * 5 + [0] * 5})
    assert [tracker.value(t) for t in ids] == pytest.approx(
        [0.5, 3 / 22, 0.5]
    )  # offline prior: (n1 + .5) / 11
    w_even, w_hard = 0.55, math.sqrt(3 / 22 * 19 / 22) + 0.05
    probs = tracker.sampling_probabilities()
    assert probs == pytest.approx(
        {"a_even": w_even / (w_even + w_hard) / 2, "a_hard": w_hard / (w_even + w_hard) / 2, "b_even": 0.5}
    )
    draws = [tracker.sample(1)[0] for _ in range(4000)]
    assert draws.count("b_even") / len(draws) == pytest.approx(0.5, abs=0.03)
    # A stratum whose tasks are all in flight drops out: the others share everything.
    ticket = tracker.dispatch("b_even")
    assert tracker.sampling_probabilities() == pytest.approx(
        {"a_even": w_even / (w_even + w_hard), "a_hard": w_hard / (w_even + w_hard)}
    )
    tracker.cancel(ticket)
    # Uniform in bookkeeping mode (GRPO, SAO): uniform within each stratum.
    grpo = EventTracker(ids, TrackerConfig(mode="bookkeeping", one_in_flight=False), strata=strata)
    assert grpo.sampling_probabilities() == pytest.approx({"a_even": 0.25, "a_hard": 0.25, "b_even": 0.5})
    with pytest.raises(
        ValueError, match=r"strata must label every task; 1 of 3 have no label, e.g. \['b_even'\]"
    ):
        EventTracker(ids, TrackerConfig(), strata={"a_even": "A", "a_hard": "A"})


def test_one_in_flight_cap() -> None:
    tracker = EventTracker(["a", "b", "c"], TrackerConfig(one_in_flight=True))
    ticket = tracker.dispatch("b")
    assert "b" not in tracker.sampling_probabilities()
    assert sorted(tracker.sample(5, strict=False)) == ["a", "c"]
    with pytest.raises(ValueError, match="only 2 can be dispatched"):
        tracker.sample(3)
    with pytest.raises(RuntimeError, match="already has a ticket in flight"):
        tracker.dispatch("b")
    tracker.cancel(ticket)
    assert "b" in tracker.sampling_probabilities()


# --- T6: event-time memory and order invariance ---------------------------------------------------------------

T6_HISTORY = [(1, 1.0), (1, 0.0), (2, 1.0)]


def _tickets_for(tracker: EventTracker, history: list[tuple[int, float]], task: str = "x") -> list[Ticket]:
    tickets: list[Ticket] = []
    for version, _ in sorted(history, key=lambda h: h[0]):
        while tracker.version < version:
            tracker.publish()
        tickets.append(tracker.dispatch(task))
    return tickets


def test_t6_event_time_memory_is_receipt_order_invariant() -> None:
    results = set()
    for order in itertools.permutations(range(3)):
        tracker = EventTracker(["x"], TrackerConfig(mode="event-time", rho=0.875, one_in_flight=False))
        tracker.init_offline({"x": [1, 0]})  # alpha_0 = beta_0 = 4
        tickets = _tickets_for(tracker, T6_HISTORY)
        for i in order:
            tracker.record(tickets[i], T6_HISTORY[i][1])
        tracker.publish()
        assert tracker.version == 3
        alpha, beta = tracker.evidence("x")
        assert alpha == pytest.approx(4.3203125, abs=1e-12) and beta == pytest.approx(3.4453125, abs=1e-12)
        assert tracker.dispatch("x").baseline == pytest.approx(0.5563380, abs=TOL)
        results.add((alpha, beta, tracker.value("x")))
    assert len(results) == 1
    assert EventTracker(["x"]).event_step == pytest.approx(0.1335314, abs=TOL)


@pytest.mark.parametrize(
    ("order", "expected"), [((1, 0, 1), 0.5556641), ((1, 1, 0), 0.5400391), ((0, 1, 1), 0.5693359)]
)
def test_t6_sequential_fixed_rho_is_order_dependent(order: tuple[int, ...], expected: float) -> None:
    tracker = EventTracker(["x"], TrackerConfig(mode="receipt-order", rho=0.875, one_in_flight=False))
    tracker.init_offline({"x": [1, 0]})
    tickets = [tracker.dispatch("x") for _ in order]
    for ticket, reward in zip(tickets, order, strict=True):
        tracker.record(ticket, float(reward))
    assert tracker.value("x") == pytest.approx(expected, abs=TOL)


histories = st.lists(
    st.tuples(st.integers(min_value=0, max_value=30), st.sampled_from([0.0, 1.0])), min_size=2, max_size=12
)


@settings(max_examples=40, deadline=None)
@given(histories, st.floats(min_value=0.3, max_value=1.0), st.randoms(use_true_random=False))
def test_event_time_is_bit_identical_under_permutations_and_receipt_order_is_not(
    history: list[tuple[int, float]], rho: float, rnd: object
) -> None:
    history = sorted(history, key=lambda h: h[0])
    orders = [list(range(len(history)))]
    for _ in range(4):
        perm = list(range(len(history)))
        rnd.shuffle(perm)  # type: ignore[attr-defined]
        orders.append(perm)
    event_values = set()
    for order in orders:
        tracker = EventTracker(["x"], TrackerConfig(mode="event-time", rho=rho, one_in_flight=False))
        tracker.init_offline({"x": [1, 0, 0]})
        tickets = _tickets_for(tracker, history)
        for i in order:
            tracker.record(tickets[i], history[i][1])
        event_values.add((tracker.evidence("x"), tracker.value("x")))
    assert len(event_values) == 1

    rewards = [r for _, r in history]
    if 0.0 in rewards and 1.0 in rewards and rho < 1.0:
        receipt_values = []
        for ordered in (sorted(rewards), sorted(rewards, reverse=True)):  # successes last vs first
            tracker = EventTracker(["x"], TrackerConfig(mode="receipt-order", rho=rho, one_in_flight=False))
            tickets = [tracker.dispatch("x") for _ in ordered]
            for ticket, reward in zip(tickets, ordered, strict=True):
                tracker.record(ticket, reward)
            receipt_values.append(tracker.value("x"))
        assert receipt_values[0] > receipt_values[1]


def test_event_time_memory_matches_exact_eq3_over_a_long_run() -> None:
    """Thousands of events: no overflow, and the pruned ledger still equals Eq. 3 in exact arithmetic."""
    rho = Fraction(7, 8)
    tracker = EventTracker(["x"], TrackerConfig(rho=float(rho), one_in_flight=False))
    tracker.init_offline({"x": [1, 1, 0]})
    alpha0, beta0 = (Fraction(v) for v in offline_prior(2, 3, 8.0))
    rng = np.random.default_rng(0)
    history: list[tuple[int, int]] = []
    for step in range(3000):
        tracker.publish()
        if step % 7 == 0:
            reward = int(rng.integers(0, 2))
            tracker.record(tracker.dispatch("x"), float(reward))
            history.append((tracker.version, reward))
        if step in (5, 400, 2999):
            k = tracker.version
            a = rho**k * alpha0 + sum(rho ** (k - ki) * r for ki, r in history)
            b = rho**k * beta0 + sum(rho ** (k - ki) * (1 - r) for ki, r in history)
            assert tracker.value("x") == pytest.approx(float(a / (a + b)), rel=1e-12, abs=1e-15)
            alpha, beta = tracker.evidence("x")
            assert math.isfinite(alpha) and alpha == pytest.approx(float(a), rel=1e-12)
            assert beta == pytest.approx(float(b), rel=1e-12)


def test_unit_domain_rewards_are_exactly_order_invariant() -> None:
    rewards = [0.1, 0.7, 0.3333333333333333, 0.9]
    values = set()
    for order in itertools.permutations(range(4)):
        tracker = EventTracker(["x"], TrackerConfig(reward_domain="unit", one_in_flight=False))
        tickets = [tracker.dispatch("x") for _ in rewards]
        for i in order:
            tracker.record(tickets[i], rewards[i])
        values.add(tracker.value("x"))
    assert len(values) == 1


# --- bookkeeping mode ---------------------------------------------------------------------------------------


def test_bookkeeping_mode_tracks_versions_staleness_and_stats() -> None:
    clock = FakeClock()
    tracker = EventTracker(["q1", "q2"], TrackerConfig.bookkeeping(), clock=clock)
    group = [tracker.dispatch("q1") for _ in range(3)]
    assert [t.dispatch_index for t in group] == [0, 1, 2] and group[0].dispatch_time == 101.0
    assert all(t.baseline is None for t in group)
    tracker.publish()
    tracker.publish()
    receipt = tracker.record(group[1], 2.5)  # any finite reward
    assert receipt.staleness == 2 and receipt.advantage is None
    stats = tracker.task_stats("q1")
    assert (stats.dispatched, stats.recorded, stats.in_flight, stats.mean_reward, stats.last_version) == (
        3,
        1,
        2,
        2.5,
        0,
    )
    assert [t.dispatch_index for t in tracker.in_flight] == [0, 2]
    assert tracker.staleness(group[0]) == 2
    assert tracker.sampling_probabilities() == {"q1": 0.5, "q2": 0.5}
    with pytest.raises(RuntimeError, match="bookkeeping"):
        tracker.value("q1")


# --- persistence ----------------------------------------------------------------------------------------------


def _drive(tracker: EventTracker, steps: int, seed: int) -> list[object]:
    """A deterministic mix of sampling, dispatching, recording and publishing; returns what it saw."""
    rng = np.random.default_rng(seed)
    seen: list[object] = []
    for step in range(steps):
        for task in tracker.sample(2, strict=False):
            seen.append(tracker.dispatch(task))
        flying = tracker.in_flight
        if flying:
            ticket = flying[int(rng.integers(len(flying)))]
            drift = float(rng.uniform(0, 0.05)) if tracker.config.retention == "drift" else None
            seen.append(tracker.record(ticket, float(rng.integers(0, 2)), drift=drift))
        if step % 3 == 2:
            seen.append(tracker.publish())
    return seen


@pytest.mark.parametrize(
    "config", [TrackerConfig.spo_pp(), TrackerConfig.spo(), TrackerConfig.bookkeeping(seed=3)]
)
def test_state_dict_round_trips_exactly_through_json(config: TrackerConfig) -> None:
    tasks = [f"task-{i}" for i in range(6)]
    tracker = EventTracker(tasks, config, clock=FakeClock())
    if config.mode != "bookkeeping":
        tracker.init_offline({t: [i % 2, 1, 0][: i % 4] for i, t in enumerate(tasks)})
    _drive(tracker, 20, seed=1)
    state = json.loads(json.dumps(tracker.state_dict()))
    assert state == tracker.state_dict()
    resumed = EventTracker.from_state_dict(state, clock=FakeClock())
    assert resumed.state_dict() == tracker.state_dict()
    tracker._clock = FakeClock()  # same clock readings from here on for both
    assert _drive(resumed, 20, seed=2) == _drive(tracker, 20, seed=2)
    assert resumed.state_dict() == tracker.state_dict()


def test_load_state_dict_refuses_a_different_setup() -> None:
    state = EventTracker(["a", "b"]).state_dict()
    with pytest.raises(ValueError, match="config"):
        EventTracker(["a", "b"], TrackerConfig(rho=0.9)).load_state_dict(state)
    with pytest.raises(ValueError, match="task id list"):
        EventTracker(["b", "a"]).load_state_dict(state)


# --- errors -------------------------------------------------------------------------------------------------


def test_errors_name_the_offending_value() -> None:
    tracker = EventTracker(["a", "b"], TrackerConfig(one_in_flight=False))
    with pytest.raises(KeyError, match="unknown task id 'zzz'"):
        tracker.dispatch("zzz")
    with pytest.raises(KeyError, match="unknown task id"):
        tracker.value("zzz")
    ticket = tracker.dispatch("a")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        tracker.record(ticket, 0.5)
    with pytest.raises(ValueError, match="finite"):
        tracker.record(ticket, math.nan)
    with pytest.raises(ValueError, match="only used with"):
        tracker.record(ticket, 1.0, drift=0.01)
    tracker.record(ticket, 1.0)
    with pytest.raises(ValueError, match="already recorded"):
        tracker.record(ticket, 1.0)
    with pytest.raises(ValueError, match="never dispatched"):
        tracker.record(Ticket("a", 0, 0.5, 99, 0.0), 1.0)
    forged = tracker.dispatch("b")
    with pytest.raises(ValueError, match="does not match"):
        tracker.record(Ticket("b", 0, 0.9, forged.dispatch_index, forged.dispatch_time), 1.0)
    with pytest.raises(RuntimeError, match="before the first dispatch"):
        tracker.init_offline({"a": [1], "b": [0]})

    unit = EventTracker(["a"], TrackerConfig(reward_domain="unit"))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        unit.record(unit.dispatch("a"), 1.5)
    with pytest.raises(KeyError, match="missing 1"):
        EventTracker(["a", "b"]).init_offline({"a": [1]})
    with pytest.raises(ValueError, match="unique"):
        EventTracker(["a", "a"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "sync"}, "mode must be"),
        ({"rho": 0.0}, "rho must be in"),
        ({"retention": "drift"}, "needs mode='receipt-order'"),
        ({"rho_min": 0.97}, "rho_min <= rho_max"),
        ({"prior_mass": -1.0}, "prior_mass"),
        ({"reward_domain": "real"}, "reward_domain"),
        ({"retention": "kl"}, r"retention must be one of \('constant', 'drift'\), got 'kl'"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrackerConfig(**kwargs)
