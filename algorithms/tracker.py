"""The event tracker: the policy clock and the prompt memory every algorithm shares.

Sections (§), test oracles (T1-T13) and project decisions (D1-D18) cited in this module are those of
``docs/reference.md`` (§3 SPO, §4 SPO++).

The clock counts published policy versions ``k``; the event coordinate ``z = k * (-ln rho)`` advances by
``-ln rho`` per policy event (reference §4.2). ``dispatch(task_id)`` hands out a frozen :class:`Ticket`
(task, generating version, baseline v̂ frozen at dispatch, dispatch order, time); ``record(ticket, reward)``
files the outcome at the event that generated it and returns a :class:`Receipt` with the advantage
``R - v̂_frozen``. Three prompt-memory modes:

- ``"event-time"`` (SPO++ Eq. 3): alpha_q = rho^(k_q) alpha_0 + sum_{i in H_q} rho^(k_q - k_i) R_i (beta
  likewise with 1 - R_i). Exactly invariant to the order in which receipts arrive.
- ``"receipt-order"`` (SPO Eq. 2): alpha <- rho alpha + R, beta <- rho beta + 1 - R in learner receipt order,
  with rho constant or drift-derived, rho = clamp(2^(-D / 0.06), 0.875, 0.96) (SPO recipe).
- ``"bookkeeping"`` (GRPO, SAO): versions, in-flight tickets, staleness and per-task statistics only.

A prioritized sampler draws tasks with w = sqrt(v̂ (1 - v̂)) + 0.05 without replacement (reference §3.5). Given
``strata`` (a label per task, e.g. ALFWorld's task type), it first shares the probability equally among the strata
that have an eligible task and then, within each, in proportion to w: the prioritized sampler's lean towards tasks
near v̂ = 1/2 then cannot starve a whole kind of task of training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any, Literal, get_args

import numpy as np
from torch import Tensor

MemoryMode = Literal["event-time", "receipt-order", "bookkeeping"]
Retention = Literal["constant", "drift"]
RewardDomain = Literal["binary", "unit"]

STATE_FORMAT = 1
_PRUNE_BITS = 64  # ledger entries weighted below 2^-64 of the newest one are dropped (below fp resolution)


@dataclass(frozen=True)
class TrackerConfig:
    """Configuration of :class:`EventTracker`. Presets: :meth:`spo`, :meth:`spo_pp`, :meth:`bookkeeping`."""

    mode: MemoryMode = "event-time"
    """Prompt memory. ``"event-time"`` (default; SPO++ Eq. 3), ``"receipt-order"`` (SPO Eq. 2) or
    ``"bookkeeping"`` (GRPO, SAO: no baseline, uniform sampler)."""

    rho: float = 0.875
    """Retention per policy event, in (0, 1]. Event-time: weight rho^(k_q - k_i), z step -ln rho (SPO++: 0.875).
    Receipt-order with ``retention="constant"``: the fixed rho (SPO recipe ``rho.value``)."""

    retention: Retention = "constant"
    """Receipt-order only. ``"drift"``: rho = clamp(2^(-D / drift_half_life), rho_min, rho_max) with D supplied
    per record by the learner (SPO recipe, ``rho.type="kl"``); ``"constant"``: rho = :attr:`rho`."""

    rho_min: float = 0.875
    """Lower clamp of drift-derived rho (SPO ``clip_lower`` 0.875); also sets the prior mass 1/(1 - rho_min)."""

    rho_max: float = 0.96
    """Upper clamp of drift-derived rho (SPO: hard-coded 0.96)."""

    drift_half_life: float = 0.06
    """D_half of the SPO retention 2^(-D / D_half) (SPO: hard-coded 0.06)."""

    prior_mass: float | None = None
    """Total Beta mass N_0 of the offline prior; ``None`` = 1 / (1 - rho_min) (= 8, reference §3.3)."""

    reward_domain: RewardDomain = "binary"
    """Rewards the prompt memory accepts: ``"binary"`` (R in {0, 1}; SPO, SPO++) or ``"unit"`` (R in [0, 1],
    fractional Beta evidence, the adaptive-EMA form of reference §3.1; decision D18). Bookkeeping mode accepts any finite R."""

    sampler_eps: float = 0.05
    """Floor epsilon of the sampler weight sqrt(v̂ (1 - v̂)) + eps (SPO, SPO++: 0.05)."""

    one_in_flight: bool = True
    """At most one in-flight ticket per task (SPO++ experimental regime). GRPO groups need ``False``."""

    seed: int = 0
    """Seed of the sampler's numpy ``Generator`` (its state is part of ``state_dict``)."""

    def __post_init__(self) -> None:
        if self.mode not in get_args(MemoryMode):
            raise ValueError(f"mode must be one of {get_args(MemoryMode)}, got {self.mode!r}")
        if self.retention not in get_args(Retention):
            raise ValueError(f"retention must be one of {get_args(Retention)}, got {self.retention!r}")
        if self.retention == "drift" and self.mode != "receipt-order":
            raise ValueError(f"retention='drift' needs mode='receipt-order' (SPO), got mode={self.mode!r}")
        if self.reward_domain not in get_args(RewardDomain):
            raise ValueError(
                f"reward_domain must be one of {get_args(RewardDomain)}, got {self.reward_domain!r}"
            )
        if not 0 < self.rho <= 1:
            raise ValueError(f"rho must be in (0, 1], got {self.rho}")
        if not 0 < self.rho_min <= self.rho_max < 1:
            raise ValueError(
                f"need 0 < rho_min <= rho_max < 1, got rho_min={self.rho_min}, rho_max={self.rho_max}"
            )
        if self.drift_half_life <= 0:
            raise ValueError(f"drift_half_life must be > 0, got {self.drift_half_life}")
        if self.prior_mass is not None and self.prior_mass <= 0:
            raise ValueError(f"prior_mass must be > 0 or None, got {self.prior_mass}")
        if self.sampler_eps < 0:
            raise ValueError(f"sampler_eps must be >= 0, got {self.sampler_eps}")

    @property
    def offline_prior_mass(self) -> float:
        """N_0, the total Beta mass of an offline-initialized task."""
        return self.prior_mass if self.prior_mass is not None else 1.0 / (1.0 - self.rho_min)

    @classmethod
    def spo(cls, **overrides: Any) -> TrackerConfig:
        """SPO recipe: receipt-order Beta tracker with drift-derived rho in [0.875, 0.96]."""
        return cls(**{"mode": "receipt-order", "retention": "drift", **overrides})

    @classmethod
    def spo_pp(cls, **overrides: Any) -> TrackerConfig:
        """SPO++: event-time memory, rho = 0.875 per policy event, one in-flight request per task."""
        return cls(**{"mode": "event-time", "rho": 0.875, "one_in_flight": True, **overrides})

    @classmethod
    def bookkeeping(cls, **overrides: Any) -> TrackerConfig:
        """GRPO, SAO: no prompt memory; several tickets per task may be in flight (groups)."""
        return cls(**{"mode": "bookkeeping", "one_in_flight": False, **overrides})


@dataclass(frozen=True)
class Ticket:
    """What the dispatcher hands out with a request; immutable, carried with the trajectory.

    ``baseline`` is v̂ frozen at dispatch (reference §4.2; ``None`` in bookkeeping mode), ``version`` the policy
    version that will generate the request, ``dispatch_index`` the global dispatch order (unique per
    tracker), ``dispatch_time`` the tracker clock at dispatch.
    """

    task_id: str
    version: int
    baseline: float | None
    dispatch_index: int
    dispatch_time: float


@dataclass(frozen=True)
class Receipt:
    """A filed outcome: ``advantage = reward - ticket.baseline`` (SPO Eq. 1, pre-update baseline; ``None``
    without a baseline), ``staleness`` = versions published between dispatch and record, and ``retention``
    = the rho applied to the task's memory (per event in event-time mode; ``None`` in bookkeeping mode)."""

    ticket: Ticket
    reward: float
    advantage: float | None
    staleness: int
    retention: float | None = None


@dataclass
class TaskStats:
    """Per-task bookkeeping kept in every mode."""

    dispatched: int = 0
    recorded: int = 0
    reward_sum: float = 0.0
    in_flight: int = 0
    last_version: int | None = None
    """Generating version of the latest recorded outcome."""

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.recorded if self.recorded else math.nan


# ---------------------------------------------------------------------------------------------------------
# Pure pieces: retention, drift, offline prior, sampler weights
# ---------------------------------------------------------------------------------------------------------


def spo_retention(
    drift: float, *, half_life: float = 0.06, rho_min: float = 0.875, rho_max: float = 0.96
) -> float:
    """SPO drift-derived retention rho = clamp(2^(-D / D_half), rho_min, rho_max) (SPO recipe; oracle T3).

    rho is unclamped only for D in [0.003534, 0.011559]; D = 0 (first visit) gives rho_max.
    """
    if not math.isfinite(drift) or drift < 0:
        raise ValueError(f"drift D must be a finite number >= 0, got {drift}")
    return min(max(2.0 ** (-drift / half_life), rho_min), rho_max)


def logprob_drift(stored_logp: Tensor, new_logp: Tensor, mask: Tensor) -> Tensor:
    """SPO's drift D per trajectory: masked mean |logp_stored(y_prev) - logp_theta_now(y_prev)| (SPO recipe).

    ``stored_logp`` are the log-probs of the task's previous response stored right after the update that
    consumed it; ``new_logp`` the same tokens under the just-updated policy. (B, T) in, (B,) out; a row with an
    empty mask (no stored response: first visit) gives D = 0. A mean |k1| per token, not a true KL.
    """
    if not (stored_logp.shape == new_logp.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(
            f"stored_logp {tuple(stored_logp.shape)}, new_logp {tuple(new_logp.shape)} and mask "
            f"{tuple(mask.shape)} must share one (B, T) shape"
        )
    m = mask.to(new_logp.dtype)
    return ((stored_logp - new_logp).abs() * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)


def offline_prior(successes: float, n0: int, prior_mass: float) -> tuple[float, float]:
    """Jeffreys-smoothed Beta prior of total mass N_0 from n_0 offline outcomes (reference §3.3; oracle T2).

    alpha_0 = N_0 (s + 1/2) / (n_0 + 1), beta_0 = N_0 (n_0 - s + 1/2) / (n_0 + 1); n_0 = 0 gives (1/2, 1/2).
    """
    if n0 < 0 or not 0 <= successes <= n0:
        raise ValueError(f"need 0 <= successes <= n0, got successes={successes}, n0={n0}")
    if n0 == 0:
        return 0.5, 0.5
    return prior_mass * (successes + 0.5) / (n0 + 1), prior_mass * (n0 - successes + 0.5) / (n0 + 1)


def sampling_weights(values: np.ndarray | Sequence[float], eps: float = 0.05) -> np.ndarray:
    """SPO/SPO++ sampler weights w = sqrt(v̂ (1 - v̂)) + eps (SPO recipe, gamma = 0; oracle T4)."""
    v = np.asarray(values, dtype=np.float64)
    if np.any((v < 0) | (v > 1)) or not np.all(np.isfinite(v)):
        raise ValueError(f"values must lie in [0, 1], got {v[(v < 0) | (v > 1) | ~np.isfinite(v)][:5]}")
    return np.sqrt(v * (1.0 - v)) + eps


# ---------------------------------------------------------------------------------------------------------
# Prompt memories
# ---------------------------------------------------------------------------------------------------------


class _EventTimeMemory:
    """SPO++ Eq. 3 for one task, read through the (a, b, k_ref) accumulator.

    (a, b) is the evidence at the newest version with evidence, k_ref: a = rho^(k_ref) alpha_0 +
    sum_i rho^(k_ref - k_i) R_i. Reading at k_q >= k_ref scales both by rho^(k_q - k_ref), so v̂ = a / (a + b)
    needs no scaling and nothing grows like rho^(-k) (overflow-safe).

    Exact order invariance (decision D2): rather than folding each receipt into (a, b) as it arrives (equal only up
    to rounding order), the memory keeps an exact per-version ledger (sum of R as a ``Fraction``, count) and
    rebuilds (a, b) from it in version order on each record. For a fixed visible history the result is
    bit-identical under every receipt permutation. Entries (and the prior) older than k_ref - H, where
    rho^H <= 2^-64, are dropped: their weight is below double precision relative to the newest entry.
    """

    def __init__(self, rho: float, alpha0: float, beta0: float) -> None:
        self.rho = rho
        self.alpha0, self.beta0 = alpha0, beta0
        self.prior_active = True
        self.ledger: dict[int, tuple[Fraction, int]] = {}
        self.horizon = None if rho == 1.0 else math.ceil(_PRUNE_BITS * math.log(2) / -math.log(rho))
        self._rebuild()

    def add(self, version: int, reward: float) -> None:
        if self.horizon is not None and version < self.k_ref - self.horizon:
            return  # weight below 2^-64 of the newest evidence; it would be pruned at once
        s, n = self.ledger.get(version, (Fraction(0), 0))
        self.ledger[version] = (s + Fraction(reward), n + 1)
        self._rebuild()

    def _rebuild(self) -> None:
        self.k_ref = max(self.ledger, default=0)
        if self.horizon is not None:
            oldest = self.k_ref - self.horizon
            self.ledger = {k: e for k, e in self.ledger.items() if k >= oldest}
            self.prior_active = self.prior_active and oldest <= 0
        a = b = 0.0
        if self.prior_active:
            decay = self.rho**self.k_ref
            a, b = decay * self.alpha0, decay * self.beta0
        for k in sorted(self.ledger):  # canonical order: the sum does not depend on receipt order
            s, n = self.ledger[k]
            decay = self.rho ** (self.k_ref - k)
            a += decay * float(s)
            b += decay * float(n - s)
        self.a, self.b = a, b

    def value(self) -> float:
        return self.a / (self.a + self.b)

    def evidence(self, version: int) -> tuple[float, float]:
        decay = self.rho ** (version - self.k_ref)
        return decay * self.a, decay * self.b

    def state(self) -> dict[str, Any]:
        return {
            "alpha0": self.alpha0,
            "beta0": self.beta0,
            "prior_active": self.prior_active,
            "ledger": [[k, s.numerator, s.denominator, n] for k, (s, n) in sorted(self.ledger.items())],
        }

    @classmethod
    def from_state(cls, rho: float, state: Mapping[str, Any]) -> _EventTimeMemory:
        mem = cls(rho, state["alpha0"], state["beta0"])
        mem.prior_active = bool(state["prior_active"])
        mem.ledger = {int(k): (Fraction(int(num), int(den)), int(n)) for k, num, den, n in state["ledger"]}
        mem._rebuild()
        return mem


class _ReceiptOrderMemory:
    """SPO Eq. 2 for one task: alpha <- rho alpha + R, beta <- rho beta + (1 - R), in receipt order."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta

    def add(self, reward: float, rho: float) -> None:
        self.alpha = rho * self.alpha + reward
        self.beta = rho * self.beta + (1.0 - reward)

    def value(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    def evidence(self, version: int) -> tuple[float, float]:
        return self.alpha, self.beta

    def state(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _ReceiptOrderMemory:
        return cls(float(state["alpha"]), float(state["beta"]))


# ---------------------------------------------------------------------------------------------------------
# The tracker
# ---------------------------------------------------------------------------------------------------------


class EventTracker:
    """Policy clock, prompt memory, in-flight tickets and the prioritized task sampler.

    Typical use (SPO++)::

        tracker = EventTracker(task_ids, TrackerConfig.spo_pp())
        tracker.init_offline({task: [0, 1, 0, ...] for task in task_ids})   # n_0 outcomes per task
        for task in tracker.sample(free_slots, strict=False):
            submit(tracker.dispatch(task))
        receipt = tracker.record(ticket, reward)   # receipt.advantage = R - v̂ frozen at dispatch
        tracker.publish()                          # after the learner publishes version k + 1

    SPO (``TrackerConfig.spo()``) records after its update with ``record(ticket, reward, drift=D)``, D from
    :func:`logprob_drift` (0 on a task's first visit). ``clock`` stamps dispatch times (tests pass a fake).
    ``strata`` (task id -> label, every task labelled) balances the sampler over the labels
    (:meth:`sampling_probabilities`); it is configuration, not state: a resumed tracker is given it again.
    """

    def __init__(
        self,
        task_ids: Iterable[str],
        config: TrackerConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        strata: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config if config is not None else TrackerConfig()
        self._clock = clock
        self._task_ids: list[str] = list(task_ids)
        if not self._task_ids:
            raise ValueError("an event tracker needs at least one task id")
        for task_id in self._task_ids:
            if not isinstance(task_id, str):
                raise TypeError(
                    f"task ids must be str (stable keys), got {task_id!r} of type {type(task_id).__name__}"
                )
        if len(set(self._task_ids)) != len(self._task_ids):
            raise ValueError("task ids must be unique")
        self._index = {task_id: i for i, task_id in enumerate(self._task_ids)}
        self._version = 0
        self._next_dispatch = 0
        self._in_flight: dict[int, Ticket] = {}
        self._stats = {task_id: TaskStats() for task_id in self._task_ids}
        self._rng = np.random.default_rng(self.config.seed)
        self._offline_initialized = False
        self._memory: dict[str, Any] = {task_id: self._new_memory(0.5, 0.5) for task_id in self._task_ids}
        self.strata: dict[str, str] | None = None
        if strata is not None:
            unlabelled = [t for t in self._task_ids if t not in strata]
            if unlabelled:
                raise ValueError(
                    f"strata must label every task; {len(unlabelled)} of {len(self._task_ids)} have no label, "
                    f"e.g. {unlabelled[:3]}"
                )
            self.strata = {t: str(strata[t]) for t in self._task_ids}

    def _new_memory(self, alpha0: float, beta0: float) -> Any:
        if self.config.mode == "event-time":
            return _EventTimeMemory(self.config.rho, alpha0, beta0)
        if self.config.mode == "receipt-order":
            return _ReceiptOrderMemory(alpha0, beta0)
        return None

    # -- clock ----------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The latest published policy version k (0 = the initial policy)."""
        return self._version

    @property
    def event_step(self) -> float:
        """-ln rho: how far z advances per policy event (SPO++: 0.1335314 for rho = 0.875)."""
        return -math.log(self.config.rho)

    @property
    def event_coordinate(self) -> float:
        """z = k * (-ln rho); z_0 = 0 anchors the offline prior at version 0 (decision D1)."""
        return self._version * self.event_step

    def publish(self) -> int:
        """Advance the clock by one policy event after the learner published new weights; returns k."""
        self._version += 1
        return self._version

    # -- prompt memory --------------------------------------------------------------------------------------

    @property
    def task_ids(self) -> list[str]:
        return list(self._task_ids)

    def _check_task(self, task_id: str) -> None:
        if task_id not in self._index:
            shown = ", ".join(repr(t) for t in self._task_ids[:3])
            raise KeyError(
                f"unknown task id {task_id!r}; this tracker knows {len(self._task_ids)} tasks ({shown}, ...)"
            )

    def _require_memory(self, what: str) -> None:
        if self.config.mode == "bookkeeping":
            raise RuntimeError(f"{what} needs a prompt memory; this tracker is in 'bookkeeping' mode")

    def init_offline(self, outcomes: Mapping[str, Sequence[float]]) -> None:
        """Set each task's prior from its n_0 offline outcomes (reference §3.3, §4.4; oracle T2).

        Jeffreys-smoothed with total mass N_0 = ``config.offline_prior_mass``; an empty list gives (1/2, 1/2).
        With ``reward_domain="binary"`` scores are binarized as score > 0 (SPO recipe); with ``"unit"`` they
        must lie in [0, 1]. The table must cover every task (as the SPO recipe requires) and be given before
        the first dispatch.
        """
        self._require_memory("init_offline")
        if self._next_dispatch > 0:
            raise RuntimeError("init_offline must be called before the first dispatch")
        unknown = [t for t in outcomes if t not in self._index]
        if unknown:
            raise KeyError(f"offline outcomes for unknown task ids: {unknown[:5]}")
        missing = [t for t in self._task_ids if t not in outcomes]
        if missing:
            raise KeyError(f"the offline table must cover every task; missing {len(missing)}: {missing[:5]}")
        for task_id in self._task_ids:
            scores = [float(x) for x in outcomes[task_id]]
            if self.config.reward_domain == "binary":
                scores = [1.0 if x > 0 else 0.0 for x in scores]
            else:
                for x in scores:
                    self._check_reward(x)
            alpha0, beta0 = offline_prior(sum(scores), len(scores), self.config.offline_prior_mass)
            self._memory[task_id] = self._new_memory(alpha0, beta0)
        self._offline_initialized = True

    def value(self, task_id: str) -> float:
        """v̂ = alpha / (alpha + beta) that a dispatch of ``task_id`` would freeze now."""
        self._require_memory("value")
        self._check_task(task_id)
        return float(self._memory[task_id].value())

    def evidence(self, task_id: str) -> tuple[float, float]:
        """(alpha, beta) of ``task_id`` read at the current version (event-time: Eq. 3 at z_q = z_k)."""
        self._require_memory("evidence")
        self._check_task(task_id)
        alpha, beta = self._memory[task_id].evidence(self._version)
        return float(alpha), float(beta)

    # -- sampler --------------------------------------------------------------------------------------------

    def sampling_probabilities(self, candidates: Sequence[str] | None = None) -> dict[str, float]:
        """p(x) = w(x) / sum w over ``candidates`` (default: all tasks) that may be dispatched now.

        w = sqrt(v̂ (1 - v̂)) + eps (reference §3.5 with gamma = 0, §4.4); uniform in bookkeeping mode. With
        ``one_in_flight`` tasks that have a ticket in flight are left out. With ``strata``,
        p(x) = w(x) / (K sum of w over the eligible tasks of x's stratum), K the number of strata with an eligible
        task of positive weight: each such stratum gets 1 / K, shared within it as the sampler would.
        """
        pool = self._eligible(candidates)
        if not pool:
            return {}
        if self.config.mode == "bookkeeping":
            weights = np.ones(len(pool))
        else:
            weights = sampling_weights([self._memory[t].value() for t in pool], self.config.sampler_eps)
        if self.strata is not None:
            labels = [self.strata[t] for t in pool]
            mass: dict[str, float] = {}
            for label, w in zip(labels, weights.tolist(), strict=True):
                mass[label] = mass.get(label, 0.0) + w
            weights = np.array(
                [
                    w / mass[label] if mass[label] > 0 else 0.0
                    for label, w in zip(labels, weights, strict=True)
                ]
            )
        total = weights.sum()
        if total <= 0:
            raise ValueError("all sampler weights are 0; use sampler_eps > 0")
        return dict(zip(pool, (weights / total).tolist(), strict=True))

    def _eligible(self, candidates: Sequence[str] | None) -> list[str]:
        pool = self._task_ids if candidates is None else list(candidates)
        for task_id in pool:
            self._check_task(task_id)
        if len(set(pool)) != len(pool):
            raise ValueError("candidates must not repeat a task id")
        if self.config.one_in_flight:
            pool = [t for t in pool if self._stats[t].in_flight == 0]
        return pool

    def sample(self, n: int, *, candidates: Sequence[str] | None = None, strict: bool = True) -> list[str]:
        """Draw ``n`` distinct task ids by weighted sampling without replacement (SPO recipe
        ``np.random.choice(M, n, replace=False, p=w / sum w)``) from the tracker's seeded generator.

        With ``strict=False`` fewer tasks come back when fewer are eligible (an async dispatcher filling its
        free slots); with ``strict=True`` that is an error. Sampling does not dispatch.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        probs = self.sampling_probabilities(candidates)
        if n > len(probs):
            if strict:
                raise ValueError(
                    f"asked for {n} tasks but only {len(probs)} can be dispatched now"
                    + (" (one_in_flight excludes tasks in flight)" if self.config.one_in_flight else "")
                    + "; pass strict=False to take what is available"
                )
            n = len(probs)
        if n == 0:
            return []
        pool = list(probs)
        picks = self._rng.choice(len(pool), size=n, replace=False, p=np.fromiter(probs.values(), float))
        return [pool[i] for i in picks]

    # -- dispatch / record ----------------------------------------------------------------------------------

    def dispatch(self, task_id: str) -> Ticket:
        """Freeze the baseline of ``task_id`` at the current version and hand out a ticket (reference §4.2)."""
        self._check_task(task_id)
        stats = self._stats[task_id]
        if self.config.one_in_flight and stats.in_flight > 0:
            raise RuntimeError(
                f"task {task_id!r} already has a ticket in flight and one_in_flight=True; record or cancel it first"
            )
        baseline = None if self.config.mode == "bookkeeping" else float(self._memory[task_id].value())
        ticket = Ticket(task_id, self._version, baseline, self._next_dispatch, float(self._clock()))
        self._next_dispatch += 1
        self._in_flight[ticket.dispatch_index] = ticket
        stats.dispatched += 1
        stats.in_flight += 1
        return ticket

    def _held_ticket(self, ticket: Ticket) -> Ticket:
        """Validate ``ticket`` against the in-flight table without removing it."""
        held = self._in_flight.get(ticket.dispatch_index)
        if held is None:
            if 0 <= ticket.dispatch_index < self._next_dispatch:
                raise ValueError(
                    f"ticket #{ticket.dispatch_index} ({ticket.task_id!r}) was already recorded or cancelled"
                )
            raise ValueError(
                f"ticket #{ticket.dispatch_index} ({ticket.task_id!r}) was never dispatched by this tracker"
            )
        if held != ticket:
            raise ValueError(
                f"ticket {ticket} does not match the ticket dispatched as #{ticket.dispatch_index}: {held}"
            )
        return held

    def _check_reward(self, reward: float) -> None:
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        if self.config.mode == "bookkeeping":
            return
        if self.config.reward_domain == "binary" and reward not in (0.0, 1.0):
            raise ValueError(
                f"reward must be 0 or 1 with reward_domain='binary', got {reward}; use 'unit' for [0, 1]"
            )
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward must lie in [0, 1] for the Beta prompt memory, got {reward}")

    def record(self, ticket: Ticket, reward: float, *, drift: float | None = None) -> Receipt:
        """File ``reward`` at the event that generated ``ticket`` and release it from flight.

        Event-time: the outcome enters Eq. 3 at coordinate z of ``ticket.version``, visible to later
        dispatches only. Receipt-order: Eq. 2 with rho = :attr:`TrackerConfig.rho`, or with
        rho = :func:`spo_retention` of ``drift`` (required, and only allowed, with ``retention="drift"``;
        decision D16). Files at ``ticket.version`` even after newer versions were published (decision D3).
        """
        held = self._held_ticket(ticket)
        reward = float(reward)
        self._check_reward(reward)
        drift_mode = self.config.mode == "receipt-order" and self.config.retention == "drift"
        if drift_mode and drift is None:
            raise ValueError("retention='drift' needs drift=D for every record (D = 0 on a first visit)")
        if not drift_mode and drift is not None:
            raise ValueError(
                f"drift is only used with mode='receipt-order', retention='drift'; got drift={drift}"
            )

        rho: float | None = None
        if self.config.mode == "event-time":
            self._memory[held.task_id].add(held.version, reward)
            rho = self.config.rho
        elif self.config.mode == "receipt-order":
            c = self.config
            if drift is None:
                rho = c.rho
            else:
                rho = spo_retention(drift, half_life=c.drift_half_life, rho_min=c.rho_min, rho_max=c.rho_max)
            self._memory[held.task_id].add(reward, rho)

        del self._in_flight[held.dispatch_index]
        stats = self._stats[held.task_id]
        stats.in_flight -= 1
        stats.recorded += 1
        stats.reward_sum += reward
        stats.last_version = (
            held.version if stats.last_version is None else max(stats.last_version, held.version)
        )
        advantage = None if held.baseline is None else reward - held.baseline
        return Receipt(held, reward, advantage, self._version - held.version, rho)

    def cancel(self, ticket: Ticket) -> None:
        """Release ``ticket`` without filing an outcome (a failed request that should not enter memory)."""
        held = self._held_ticket(ticket)
        del self._in_flight[held.dispatch_index]
        self._stats[held.task_id].in_flight -= 1

    @property
    def in_flight(self) -> list[Ticket]:
        """Tickets dispatched and neither recorded nor cancelled, in dispatch order."""
        return [self._in_flight[i] for i in sorted(self._in_flight)]

    def staleness(self, ticket: Ticket) -> int:
        """Policy versions published since ``ticket`` was dispatched."""
        return self._version - ticket.version

    def task_stats(self, task_id: str) -> TaskStats:
        """A copy of the bookkeeping of ``task_id``."""
        self._check_task(task_id)
        return replace(self._stats[task_id])

    # -- persistence ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as JSON-serializable built-in types (exact round trip)."""
        memory: dict[str, Any] = {}
        if self.config.mode != "bookkeeping":
            memory = {t: self._memory[t].state() for t in self._task_ids}
        return {
            "format": STATE_FORMAT,
            "config": asdict(self.config),
            "task_ids": list(self._task_ids),
            "version": self._version,
            "next_dispatch": self._next_dispatch,
            "offline_initialized": self._offline_initialized,
            "in_flight": [asdict(t) for t in self.in_flight],
            "stats": {t: asdict(s) for t, s in self._stats.items()},
            "memory": memory,
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output into a tracker built with the same config and task ids."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"unsupported tracker state format {state.get('format')!r}; expected {STATE_FORMAT}"
            )
        config = TrackerConfig(**state["config"])
        if config != self.config:
            raise ValueError(f"state was saved with config {config}, this tracker has {self.config}")
        if list(state["task_ids"]) != self._task_ids:
            raise ValueError("state was saved with a different task id list (ids and order must match)")
        self._version = int(state["version"])
        self._next_dispatch = int(state["next_dispatch"])
        self._offline_initialized = bool(state["offline_initialized"])
        self._in_flight = {int(t["dispatch_index"]): Ticket(**t) for t in state["in_flight"]}
        self._stats = {t: TaskStats(**s) for t, s in state["stats"].items()}
        if config.mode == "event-time":
            self._memory = {t: _EventTimeMemory.from_state(config.rho, s) for t, s in state["memory"].items()}
        elif config.mode == "receipt-order":
            self._memory = {t: _ReceiptOrderMemory.from_state(s) for t, s in state["memory"].items()}
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, clock: Callable[[], float] = time.time
    ) -> EventTracker:
        """Rebuild a tracker (config, tasks and all) from :meth:`state_dict` output."""
        tracker = cls(state["task_ids"], TrackerConfig(**state["config"]), clock=clock)
        tracker.load_state_dict(state)
        return tracker


__all__ = [
    "EventTracker",
    "MemoryMode",
    "Receipt",
    "Retention",
    "RewardDomain",
    "TaskStats",
    "Ticket",
    "TrackerConfig",
    "logprob_drift",
    "offline_prior",
    "sampling_weights",
    "spo_retention",
]
