"""Learning-curve metrics of training runs, and matched runs compared as SPO++ Table 1 compares them.

A run's curve is one column of its ``metrics.jsonl`` against the update number: by default the held-out
evaluation ``eval/success`` (fixed tasks and episode seeds at every evaluation, the honest curve), or the
training batches' ``batch/success`` (one point per update; the prioritized sampler inflates it). On the curve
r_1 .. r_T (its points in update order):

- ``auc_trapz``: normalized trapezoidal area, (1/(T−1)) Σ_{t=1}^{T−1} (r_t + r_{t+1}) / 2; r_1 if T = 1
  (SPO++ Eq. 7);
- ``auc_mean``: the step-mean area, (1/T) Σ r_t;
- ``final``: the mean of the last five points;
- ``c10``: ½ (AUC_trapz(r_{1:10}) + (1/5) Σ_{t=6}^{10} r_t), early learning in ten points (SPO++ Eq. 8).

The points are taken as equally spaced (the equations index points, not updates): an evaluation every k
updates gives the same weight to each evaluation, and a last evaluation after fewer than k updates (``--updates``
not a multiple of ``--eval-every``) weighs as much as the others.

Matched runs (the same seed under two algorithms) are compared by paired differences: each pair is
truncated to its common budget (the points up to the smaller of the two last updates), the metric is computed
on both, and the differences are reported as mean ± sample standard deviation over the pairs (SPO++ Table 1).
Formulas and meaning: ``docs/evaluation.md``; plots and reports: ``streamrl.evaluation.compare``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamrl.algorithms.run_dir import METRICS_FILE, RunDir
from streamrl.utils.stats import sample_sd

HELD_OUT = "eval/success"
"""The held-out evaluation's success column (the default curve)."""
BATCH = "batch/success"
"""The training batches' success column."""

Pairing = Literal["seed", "order"]


@dataclass(frozen=True)
class Curve:
    """One run's curve: ``values[i]`` of ``column`` at update ``updates[i]`` (updates ascending)."""

    run: Path
    column: str
    updates: tuple[int, ...]
    values: tuple[float, ...]
    seed: int | None = None
    """The run's seed (its ``config.json``), ``None`` if unknown."""
    algo: str | None = None
    """The run's algorithm (its ``config.json``), ``None`` if unknown."""

    def up_to(self, last_update: int) -> Curve:
        """The points at updates ``<= last_update``."""
        keep = [i for i, u in enumerate(self.updates) if u <= last_update]
        return Curve(
            self.run,
            self.column,
            tuple(self.updates[i] for i in keep),
            tuple(self.values[i] for i in keep),
            self.seed,
            self.algo,
        )


# ---------------------------------------------------------------------------------------------------------
# Reading runs


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run``'s ``metrics.jsonl``, one per update in update order (when an update appears twice,
    as after a resume that replayed it, the last row wins). Raises ``FileNotFoundError`` naming the path."""
    return RunDir(run).read_metrics()


def run_config(run: str | Path) -> dict[str, Any]:
    """The run's saved ``config.json`` (``{}`` if it has none)."""
    files = RunDir(run)
    return files.read_config() if files.is_run() else {}


def numeric_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The columns holding a finite number in at least one row, sorted."""
    return sorted({k for row in rows for k, v in row.items() if _number(v) is not None})


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def load_curve(run: str | Path, column: str = HELD_OUT) -> Curve:
    """``column`` of ``run``'s metrics against the update number (rows without a finite value skipped).

    Raises ``ValueError`` naming the numeric columns the run has when no row holds ``column`` (a run with
    ``--eval-every 0`` has no ``eval/success``)."""
    rows = read_metrics(run)
    kept: list[tuple[int, float]] = []
    for row in rows:
        value = _number(row.get(column))
        if value is not None:
            kept.append((int(row.get("update", 0)), value))
    if not kept:
        available = [c for c in numeric_columns(rows) if c.split("/")[0] in ("eval", "batch", "learner")]
        raise ValueError(
            f"run {str(run)!r} has no {column!r} values in {METRICS_FILE}"
            + (" (no held-out evaluation: trained with eval_every=0?)" if column == HELD_OUT else "")
            + f"; columns with values: {available}"
        )
    config = run_config(run)
    seed = config.get("seed")
    return Curve(
        Path(run),
        column,
        tuple(u for u, _ in kept),
        tuple(v for _, v in kept),
        int(seed) if isinstance(seed, int) else None,
        str(config["algo"]) if "algo" in config else None,
    )


# ---------------------------------------------------------------------------------------------------------
# The metrics of one curve


def _check(values: Sequence[float]) -> list[float]:
    if len(values) == 0:
        raise ValueError("a curve metric needs at least one point, got an empty curve")
    return [float(v) for v in values]


def auc_trapz(values: Sequence[float]) -> float:
    """SPO++ Eq. 7: (1/(T−1)) Σ_{t=1}^{T−1} (r_t + r_{t+1}) / 2, and r_1 when T = 1."""
    r = _check(values)
    if len(r) == 1:
        return r[0]
    return sum((a + b) / 2 for a, b in itertools.pairwise(r)) / (len(r) - 1)


def auc_mean(values: Sequence[float]) -> float:
    """The step-mean area (1/T) Σ_{t=1}^{T} r_t."""
    r = _check(values)
    return sum(r) / len(r)


def final_mean(values: Sequence[float], last: int = 5) -> float:
    """The mean of the last ``last`` points (of all of them when there are fewer)."""
    if last < 1:
        raise ValueError(f"last must be >= 1, got {last}")
    r = _check(values)[-last:]
    return sum(r) / len(r)


def c10(values: Sequence[float]) -> float:
    """SPO++ Eq. 8: ½ (AUC_trapz(r_{1:10}) + (1/5) Σ_{t=6}^{10} r_t); needs at least ten points (the first
    ten are used)."""
    r = _check(values)
    if len(r) < 10:
        raise ValueError(f"C10 needs at least 10 points, the curve has {len(r)}")
    return 0.5 * (auc_trapz(r[:10]) + sum(r[5:10]) / 5)


CURVE_METRICS: dict[str, Callable[[Sequence[float]], float]] = {
    "auc_trapz": auc_trapz,
    "auc_mean": auc_mean,
    "final": final_mean,
    "c10": c10,
}
"""Metric name -> function of the curve's values, in the order tables list them."""


def curve_metrics(values: Sequence[float]) -> dict[str, float | None]:
    """Every metric of ``CURVE_METRICS`` on ``values``; ``c10`` is ``None`` for curves of fewer than 10 points."""
    return {
        name: (None if name == "c10" and len(values) < 10 else fn(values))
        for name, fn in CURVE_METRICS.items()
    }


# ---------------------------------------------------------------------------------------------------------
# Matched runs


def pair_curves(
    a: Sequence[Curve], b: Sequence[Curve], pairing: Pairing = "seed"
) -> list[tuple[Curve, Curve]]:
    """Matched pairs of ``a`` and ``b``, each truncated to its common budget (the points at updates up to the
    smaller of the two last updates).

    ``pairing="seed"``: the runs with the same seed (each side's seeds must be known, distinct and the same
    set); ``"order"``: ``a[i]`` with ``b[i]``. A pair whose truncated curves are evaluated at different updates
    (another ``eval_every``) is not matched: ``ValueError`` naming both runs.
    """
    if not a or not b:
        raise ValueError(f"paired comparison needs runs on both sides, got {len(a)} and {len(b)}")
    if pairing == "order":
        if len(a) != len(b):
            raise ValueError(f"pairing by order needs as many runs on each side, got {len(a)} and {len(b)}")
        pairs = list(zip(a, b, strict=True))
    elif pairing == "seed":
        seeds_a, seeds_b = [c.seed for c in a], [c.seed for c in b]
        for side, seeds, curves in (("first", seeds_a, a), ("second", seeds_b, b)):
            if None in seeds or len(set(seeds)) != len(seeds):
                raise ValueError(
                    f"pairing by seed needs distinct known seeds on each side; the {side} side's runs "
                    f"{[str(c.run) for c in curves]} have seeds {seeds} (use pairing='order' to pair by position)"
                )
        if set(seeds_a) != set(seeds_b):
            raise ValueError(
                f"matched runs need the same seeds on both sides: {sorted(seeds_a, key=str)} vs "
                f"{sorted(seeds_b, key=str)} (use pairing='order' to pair by position)"
            )
        by_seed = {c.seed: c for c in b}
        pairs = [(c, by_seed[c.seed]) for c in sorted(a, key=lambda c: c.seed or 0)]
    else:
        raise ValueError(f"pairing must be 'seed' or 'order', got {pairing!r}")
    out = []
    for x, y in pairs:
        if x.column != y.column:
            raise ValueError(f"cannot pair curves of different columns: {x.column!r} and {y.column!r}")
        budget = min(x.updates[-1], y.updates[-1])
        tx, ty = x.up_to(budget), y.up_to(budget)
        if tx.updates != ty.updates:
            raise ValueError(
                f"runs {str(x.run)!r} and {str(y.run)!r} have {x.column!r} at different updates "
                f"({list(tx.updates)} vs {list(ty.updates)}): matched runs need the same evaluation schedule"
            )
        out.append((tx, ty))
    return out


@dataclass(frozen=True)
class Spread:
    """Mean ± sample standard deviation of one metric over runs (or over paired differences)."""

    mean: float | None
    sd: float | None
    """``None`` with fewer than two values."""
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        """The spread of the values that exist (``None`` values, e.g. C10 of a short curve, left out)."""
        kept = tuple(float(v) for v in values if v is not None)
        if not kept:
            return cls(None, None, ())
        sd = sample_sd(kept)
        return cls(sum(kept) / len(kept), None if math.isnan(sd) else sd, kept)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "sd": self.sd, "n": len(self.values), "values": list(self.values)}

    def text(self, digits: int = 3) -> str:
        """``mean ± sd`` (``mean`` alone for one value, ``–`` for none)."""
        if self.mean is None:
            return "–"
        if self.sd is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f}"


def summarize_curves(curves: Sequence[Curve]) -> dict[str, Spread]:
    """Each metric's mean ± sample s.d. over ``curves`` (unpaired, each curve whole)."""
    per_run = [curve_metrics(c.values) for c in curves]
    return {name: Spread.of([m[name] for m in per_run]) for name in CURVE_METRICS}


@dataclass(frozen=True)
class PairedComparison:
    """SPO++ Table 1 for one column: each metric on both sides and their paired difference (a − b)."""

    column: str
    pairs: tuple[tuple[Curve, Curve], ...]
    a: dict[str, Spread]
    b: dict[str, Spread]
    difference: dict[str, Spread]

    def to_dict(self) -> dict[str, Any]:
        return {
            "column": self.column,
            "pairs": [
                {
                    "a": str(x.run),
                    "b": str(y.run),
                    "seed_a": x.seed,
                    "seed_b": y.seed,
                    "common_budget": x.updates[-1],
                    "points": len(x.values),
                }
                for x, y in self.pairs
            ],
            "metrics": {
                name: {
                    "a": self.a[name].to_dict(),
                    "b": self.b[name].to_dict(),
                    "difference": self.difference[name].to_dict(),
                }
                for name in CURVE_METRICS
            },
        }


def compare_curves(a: Sequence[Curve], b: Sequence[Curve], pairing: Pairing = "seed") -> PairedComparison:
    """Matched runs ``a`` vs ``b`` (``pair_curves``): every metric on each truncated pair, reported as mean ±
    sample s.d. over the pairs for each side and for the paired differences a − b (SPO++ Table 1). A metric
    missing on either curve of a pair (C10 of fewer than ten points) leaves that pair out of its difference."""
    pairs = pair_curves(a, b, pairing)
    ma = [curve_metrics(x.values) for x, _ in pairs]
    mb = [curve_metrics(y.values) for _, y in pairs]
    diff: dict[str, Spread] = {}
    for name in CURVE_METRICS:
        diffs: list[float | None] = []
        for x, y in zip(ma, mb, strict=True):
            vx, vy = x[name], y[name]
            diffs.append(None if vx is None or vy is None else vx - vy)
        diff[name] = Spread.of(diffs)
    return PairedComparison(
        column=pairs[0][0].column,
        pairs=tuple(pairs),
        a={name: Spread.of([m[name] for m in ma]) for name in CURVE_METRICS},
        b={name: Spread.of([m[name] for m in mb]) for name in CURVE_METRICS},
        difference=diff,
    )


METRIC_NAMES = {
    "auc_trapz": "AUC (trapz, Eq. 7)",
    "auc_mean": "AUC (step mean)",
    "final": "final (last 5)",
    "c10": "C10 (Eq. 8)",
}


def comparison_table(comparison: PairedComparison, labels: tuple[str, str] = ("A", "B")) -> str:
    """The comparison as a markdown table: one row per metric, columns a, b and the paired difference a − b
    (mean ± sample s.d. over the pairs)."""
    a, b = labels
    lines = [
        f"| {comparison.column} | {a} | {b} | {a} − {b} (paired) |",
        "|---|---|---|---|",
    ]
    for name in CURVE_METRICS:
        lines.append(
            f"| {METRIC_NAMES[name]} | {comparison.a[name].text()} | {comparison.b[name].text()} | "
            f"{comparison.difference[name].text()} |"
        )
    lines.append(
        f"\n{len(comparison.pairs)} pair(s), mean ± sample s.d. over pairs; each pair truncated to its common budget."
    )
    return "\n".join(lines)


def summary_table(curves: Sequence[Curve], label: str) -> str:
    """Unpaired runs' metrics as a markdown table (mean ± sample s.d. over runs)."""
    summary = summarize_curves(curves)
    column = curves[0].column if curves else ""
    lines = [f"| {column} | {label} |", "|---|---|"]
    lines += [f"| {METRIC_NAMES[name]} | {summary[name].text()} |" for name in CURVE_METRICS]
    lines.append(f"\n{len(curves)} run(s), mean ± sample s.d. over runs.")
    return "\n".join(lines)
