"""The statistics evaluation reports: Wilson intervals, unbiased pass@k, Student-t intervals of a mean, and the
same intervals clustered by task.

Why clustered: an evaluation plays each task several times (samples, seeds), and episodes of one task are not
independent draws -- a hard task is hard for every sample. The unit that is drawn is the task, so an interval
that counts episodes as independent is too narrow whenever outcomes correlate within tasks.
``clustered_t_interval`` and ``clustered_wilson_interval`` treat the task as the unit; the episode-level
``t_interval`` and ``wilson_interval`` are kept beside them.

Plain Python (no SciPy): each function is a closed form or a short series, checked in
``tests/utils/test_stats.py`` against hand-computed values and published tables. Formulas and their
meaning: ``docs/evaluation.md``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from statistics import NormalDist


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927): with p = successes / n and z the normal
    quantile, center (p + z²/2n) / (1 + z²/n) and half-width z / (1 + z²/n) · √(p(1−p)/n + z²/4n²).

    Unlike the normal ("Wald") interval it stays inside [0, 1] and is not empty at 0 or n successes. It treats
    the n episodes as independent draws.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    return _wilson(successes / n, n, _z(confidence))


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    """Wilson's interval of a proportion ``p`` observed on (an effective) ``n``, at the normal quantile ``z``."""
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at 0 (n) successes the bound is exactly 0 (1); the closed form leaves a rounding residue
    low = 0.0 if p == 0 else max(0.0, center - half)
    high = 1.0 if p == 1 else min(1.0, center + half)
    return low, high


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from ``n`` samples of which ``c`` succeeded (Chen et al. 2021, Eq. 1):
    1 − C(n−c, k) / C(n, k), the probability that at least one of k samples drawn without replacement from
    the n succeeds; computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i) (their numerically stable form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def student_t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile (> 0.5) of Student's t with ``df`` degrees of freedom.

    Solves A(t | df) = 2·probability − 1 by bisection, where A(t | ν) = P(|T| ≤ t) is the finite series of
    Abramowitz & Stegun 26.7.3 (ν odd) / 26.7.4 (ν even) in θ = atan(t / √ν): exact for integer ν.
    """
    if not 0.5 < probability < 1:
        raise ValueError(f"probability must be in (0.5, 1), got {probability}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    target = 2 * probability - 1
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _t_two_sided(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def _t_two_sided(t: float, df: int) -> float:
    """A(t | df) = P(|T| ≤ t), Abramowitz & Stegun 26.7.3-4."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # 26.7.4: sinθ (1 + ½cos²θ + (1·3)/(2·4)cos⁴θ + … up to cos^{ν−2}θ)
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= cos2 * (2 * j - 1) / (2 * j)
            total += term
        return sin * total
    if df == 1:
        return 2 * theta / math.pi
    # 26.7.3: (2/π)(θ + sinθ cosθ (1 + (2/3)cos²θ + … up to cos^{ν−3}θ))
    term, total = 1.0, 1.0
    for j in range(1, (df - 1) // 2):
        term *= cos2 * (2 * j) / (2 * j + 1)
        total += term
    return 2 / math.pi * (theta + sin * math.sqrt(cos2) * total)


@dataclass(frozen=True)
class MeanInterval:
    """The mean of n values with its confidence interval (Student t on n − 1 degrees of freedom)."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    """Sample standard deviation (n − 1 in the denominator)."""
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict[str, float | int]:
        return {
            "mean": self.mean,
            "ci_low": self.low,
            "ci_high": self.high,
            "n": self.n,
            "sd": self.sd,
            "confidence": self.confidence,
        }


def sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation (denominator n − 1); ``nan`` for fewer than two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def t_interval(values: Sequence[float], confidence: float = 0.95) -> MeanInterval:
    """Mean of ``values`` ± t_{(1+confidence)/2, n−1} · s / √n (needs n >= 2)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval of a mean needs at least 2 values, got {n}")
    mean = sum(values) / n
    sd = sample_sd(values)
    half = student_t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return MeanInterval(mean, mean - half, mean + half, n, sd, confidence)


# ----------------------------------------------------------------------------------------------------------
# Intervals clustered by task


@dataclass(frozen=True)
class ClusteredMeanInterval:
    """The mean of n episode values from ``tasks`` tasks, with its task-clustered interval
    (``clustered_t_interval``): mean ± t_{(1+confidence)/2, ⌊df⌋} · se."""

    mean: float
    low: float
    high: float
    n: int
    """Episodes."""
    tasks: int
    """Distinct tasks (the clusters)."""
    se: float
    """The cluster-robust (CR2) standard error of the mean."""
    df: float
    """Bell-McCaffrey degrees of freedom (tasks − 1 when every task has as many episodes)."""
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "mean": self.mean,
            "ci_low": self.low,
            "ci_high": self.high,
            "n": self.n,
            "tasks": self.tasks,
            "se": self.se,
            "df": self.df,
            "confidence": self.confidence,
            "method": "clustered by task (CR2 s.e., Bell-McCaffrey df)",
        }


def _by_task(values: Sequence[float], tasks: Sequence[Hashable]) -> list[list[float]]:
    """``values`` grouped by their task, in order of first appearance."""
    if len(values) != len(tasks):
        raise ValueError(f"need one task per value, got {len(values)} values and {len(tasks)} tasks")
    groups: dict[Hashable, list[float]] = {}
    for value, task in zip(values, tasks, strict=True):
        groups.setdefault(task, []).append(float(value))
    return list(groups.values())


def clustered_t_interval(
    values: Sequence[float], tasks: Sequence[Hashable], confidence: float = 0.95
) -> ClusteredMeanInterval:
    """The mean of the episode values ``values`` (``tasks[i]`` the task of ``values[i]``) with an interval that
    takes the task as the unit: a cluster-robust standard error and Student t on the tasks' degrees of freedom.

    The estimate is the pooled mean ȳ over all N episodes (what the reports show). Its variance is the CR2
    estimator of the intercept-only model (Bell & McCaffrey 2002; the small-sample choice Imbens & Kolesár 2016
    recommend), which for a mean is a closed form: with task g's m_g episodes and residual total
    e_g = Σ_j (y_gj − ȳ),

      se² = Σ_g e_g² / (1 − m_g/N) / N²,

    on df = N² / (Σ_g m_g² + ((Σ_g a_g)² − Σ_g a_g²) / N²), a_g = m_g² / (1 − m_g/N) -- the Bell-McCaffrey
    (Satterthwaite) degrees of freedom of that estimator when episodes were independent; the quantile uses ⌊df⌋
    (conservative; the t series is exact for integer df).

    Balanced (every task m episodes) this is exactly the t interval over the G per-task means (se² = s²_means / G,
    df = G − 1); with one episode per task it is the episode-level ``t_interval``. Unbalanced, each task weighs
    by its episodes, as the pooled mean does (a t interval over per-task means would estimate the unweighted
    task average instead, another quantity), and the degrees of freedom fall below G − 1 as a few large tasks
    dominate. Needs at least two tasks.
    """
    groups = _by_task(values, tasks)
    n, g = len(values), len(groups)
    if g < 2:
        raise ValueError(
            f"an interval clustered by task needs episodes of at least 2 tasks, got {g} task(s) ({n} episodes)"
        )
    mean = sum(values) / n
    weights = [1 / (1 - len(x) / n) for x in groups]  # (1 − m_g/N)^-1: CR2's adjustment of task g
    se = math.sqrt(sum(w * (sum(x) - len(x) * mean) ** 2 for w, x in zip(weights, groups, strict=True))) / n
    a = [w * len(x) ** 2 for w, x in zip(weights, groups, strict=True)]
    df = n * n / (sum(len(x) ** 2 for x in groups) + (sum(a) ** 2 - sum(v * v for v in a)) / (n * n))
    half = student_t_quantile(0.5 + confidence / 2, _whole_df(df)) * se
    return ClusteredMeanInterval(mean, mean - half, mean + half, n, g, se, df, confidence)


def _whole_df(df: float) -> int:
    """⌊df⌋, at least 1 (a balanced design's df = G − 1 may carry a rounding residue below the integer)."""
    return max(1, math.floor(df + 1e-9))


def clustered_wilson_interval(
    outcomes: Sequence[bool | float], tasks: Sequence[Hashable], confidence: float = 0.95
) -> tuple[float, float]:
    """The success rate of 0/1 ``outcomes`` (``tasks[i]`` the task of episode i) with a Wilson interval on the
    effective number of episodes of a clustered sample (Korn & Graubard 1998):

      n* = min(N, p(1 − p) / se² · (z / t_{⌊df⌋})²),

    se and df those of ``clustered_t_interval`` (CR2, Bell-McCaffrey). p(1 − p)/se² is N over the design effect
    (how much the clustering inflates the binomial variance); the factor (z/t)² makes Wilson's normal quantile
    carry the t quantile's width; the cap at N never makes the interval narrower than ``wilson_interval``'s. A
    Wilson form rather than p ± t·se keeps the interval inside [0, 1] and not empty at 0 or N successes, where
    se is 0 and n* = N. Needs at least two tasks.
    """
    values = [float(o) for o in outcomes]
    if any(v not in (0.0, 1.0) for v in values):
        raise ValueError(
            f"outcomes must be 0/1 (success or failure), got {sorted(set(values) - {0.0, 1.0})[:3]}"
        )
    interval = clustered_t_interval(values, tasks, confidence)
    p, n = interval.mean, interval.n
    z = _z(confidence)
    effective = float(n)
    if 0 < p < 1 and interval.se > 0:
        t = student_t_quantile(0.5 + confidence / 2, _whole_df(interval.df))
        effective = min(effective, p * (1 - p) / interval.se**2 * (z / t) ** 2)
    return _wilson(p, effective, z)
