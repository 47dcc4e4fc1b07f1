"""The statistics evaluation reports: Wilson intervals, unbiased pass@k, Student-t intervals of a mean.

Plain Python (no SciPy): each function is a closed form or a short series, checked in
``tests/test_evaluation_stats.py`` against hand-computed values and published tables. Formulas and their
meaning: ``docs/evaluation.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    z = _z(confidence)
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # at 0 (n) successes the bound is exactly 0 (1); the closed form leaves a rounding residue
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
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
