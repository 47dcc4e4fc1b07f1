"""``streamrl compare``: training runs side by side -- SPO++ Table 1's metrics, learning curves, diagnostics.

``compare(CompareConfig(runs=(...), vs=(...), out=...))`` reads each run's ``metrics.jsonl`` and writes to
``out``:

- ``compare.json`` and the markdown tables: for each curve column (held-out ``eval/success``, training
  ``batch/success``) the metrics of ``streamrl.evaluation.curves`` -- AUC (trapezoidal, Eq. 7; step mean),
  the final five points, C10 (Eq. 8) -- as mean ± sample s.d. over each side's runs, and, with ``vs``, the
  paired differences of matched runs (same seed), each pair truncated to its common budget (SPO++ Table 1);
- ``learning_curves.png``: each column against the update, every run a thin line, each side's mean thick with
  a shaded ±1 standard error across runs and a trailing mean of the last five points dashed (SPO++ Figure 1);
- ``diagnostics.png``: the learner's approximate KL between the rollout and the updated policy
  (``learner/approx_kl``, the k3 estimator), the PPO clip fraction, the gradient norm and the mean staleness of
  the trained tokens (from the ``staleness`` histogram), per update;
- ``report.md``: the runs (each with its own held-out gain, its last evaluation against its first on the same
  episodes with the 95 % interval clustered by task), the tables, both figures, and how to read them.

The plotting functions (``plot_learning_curves``, ``plot_diagnostics``) are usable on their own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.algorithms.run_dir import RunDir
from streamrl.evaluation.curves import (
    BATCH,
    HELD_OUT,
    Curve,
    Pairing,
    compare_curves,
    comparison_table,
    load_curve,
    read_metrics,
    run_config,
    summarize_curves,
    summary_table,
)
from streamrl.utils.stats import (
    ClusteredMeanInterval,
    MeanInterval,
    clustered_t_interval,
    sample_sd,
    t_interval,
)


@dataclass(frozen=True)
class CompareConfig:
    """``streamrl compare``: compare training runs (SPO++ Table 1: AUC, final, C10, paired differences of
    matched seeds), plot their learning curves and diagnostics, and write a markdown report."""

    runs: tuple[Path, ...] = ()
    """Run directories of the first side (``streamrl train --out``)."""
    vs: tuple[Path, ...] = ()
    """Run directories of the second side, matched to the first (same seeds); empty: no paired comparison."""
    out: Path | None = None
    """Directory for report.md, compare.json and the PNG plots (required)."""
    labels: tuple[str, ...] = ()
    """Names of the sides (one, or two with --vs); empty: each side's algorithm (A / B if they coincide)."""
    columns: tuple[str, ...] = (HELD_OUT, BATCH)
    """metrics.jsonl columns to compare as curves; one no run has is left out with a note."""
    pairing: Pairing = "seed"
    """How matched runs pair up: seed (same config seed) or order (the i-th of each side)."""
    trailing: int = 5
    """Points in the plotted trailing mean."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("runs: give at least one run directory")
        if self.out is None:
            raise ValueError("out is required: the directory the report is written to")
        sides = 2 if self.vs else 1
        if self.labels and len(self.labels) != sides:
            raise ValueError(f"labels: give {sides} label(s) for {sides} side(s), got {list(self.labels)}")
        if self.trailing < 1:
            raise ValueError(f"trailing must be >= 1, got {self.trailing}")
        if not self.columns:
            raise ValueError("columns: give at least one metrics.jsonl column")


DIAGNOSTICS: tuple[tuple[str, str], ...] = (
    ("learner/approx_kl", "approx. KL (rollout ‖ updated policy, k3)"),
    ("learner/clip_frac", "PPO clip fraction"),
    ("learner/grad_norm", "gradient norm"),
    ("staleness", "mean staleness of trained tokens (versions)"),
)
"""(metrics.jsonl column, panel title) of the diagnostics figure; ``staleness`` is a histogram, shown as its mean."""


def diagnostic_series(rows: Sequence[Mapping[str, Any]], column: str) -> tuple[list[int], list[float]]:
    """(updates, values) of ``column`` over ``rows``; for the ``staleness`` histogram ({versions: tokens}) the
    mean staleness of each update."""
    updates, values = [], []
    for row in rows:
        value = row.get(column)
        if column == "staleness" and isinstance(value, Mapping) and value:
            total = sum(float(n) for n in value.values())
            value = sum(int(k) * float(n) for k, n in value.items()) / total if total else None
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            updates.append(int(row.get("update", 0)))
            values.append(float(value))
    return updates, values


def trailing_mean(values: Sequence[float], window: int = 5) -> list[float]:
    """Point t's mean of points max(1, t − window + 1) .. t (a causal moving average)."""
    out = []
    for t in range(len(values)):
        chunk = values[max(0, t - window + 1) : t + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _mean_and_se(
    series: Sequence[tuple[Sequence[int], Sequence[float]]],
) -> tuple[list[int], list[float], list[float]]:
    """At each update any series has: the mean over the series that have it and its standard error (0 where
    only one has it)."""
    at: dict[int, list[float]] = {}
    for updates, values in series:
        for u, v in zip(updates, values, strict=True):
            at.setdefault(u, []).append(v)
    xs = sorted(at)
    means, ses = [], []
    for u in xs:
        vals = at[u]
        means.append(sum(vals) / len(vals))
        ses.append(sample_sd(vals) / math.sqrt(len(vals)) if len(vals) > 1 else 0.0)
    return xs, means, ses


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _draw(
    ax: Any, series: Sequence[tuple[Sequence[int], Sequence[float]]], color: str, label: str, trailing: int
) -> None:
    for updates, values in series:
        ax.plot(updates, values, color=color, alpha=0.35, linewidth=0.8)
    xs, means, ses = _mean_and_se(series)
    if not xs:
        return
    ax.plot(xs, means, color=color, linewidth=2.2, label=f"{label} (mean of {len(series)})")
    if len(series) > 1:
        ax.fill_between(
            xs,
            [m - s for m, s in zip(means, ses, strict=True)],
            [m + s for m, s in zip(means, ses, strict=True)],
            color=color,
            alpha=0.2,
            linewidth=0,
        )
    if trailing > 1 and len(xs) > 1:
        ax.plot(
            xs,
            trailing_mean(means, trailing),
            color=color,
            linewidth=1.4,
            linestyle="--",
            label=f"{label}, {trailing}-point trailing mean",
        )


COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def plot_learning_curves(
    groups: Mapping[str, Mapping[str, Sequence[Curve]]], path: str | Path, trailing: int = 5
) -> Path:
    """One panel per column (``groups[column][side label] = curves``): thin replicates, thick mean, shaded ±1
    standard error across runs, dashed trailing mean (SPO++ Figure 1). Writes a PNG to ``path``."""
    plt = _pyplot()
    columns = list(groups)
    fig, axes = plt.subplots(1, len(columns), figsize=(6 * len(columns), 4), squeeze=False)
    for ax, column in zip(axes[0], columns, strict=True):
        for color, (label, curves) in zip(COLORS, groups[column].items(), strict=False):
            _draw(ax, [(c.updates, c.values) for c in curves], color, label, trailing)
        ax.set_title(
            {
                HELD_OUT: "held-out success (eval/success)",
                BATCH: "training batch success (batch/success)",
            }.get(column, column)
        )
        ax.set_xlabel("update")
        ax.set_ylabel(column)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


_LEGEND = "thin: single runs; thick: their mean, shaded ±1 standard error across runs; dashed: trailing mean"


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.suptitle(_LEGEND, fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    plt.close(fig)
    return Path(path)


def plot_diagnostics(groups: Mapping[str, Sequence[str | Path]], path: str | Path, trailing: int = 5) -> Path:
    """The ``DIAGNOSTICS`` panels per update for each side (``groups[label] = run directories``): thin runs,
    thick mean with ±1 standard error, dashed trailing mean. Writes a PNG to ``path``."""
    plt = _pyplot()
    rows = {label: [read_metrics(run) for run in runs] for label, runs in groups.items()}
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (column, title) in zip(axes.flat, DIAGNOSTICS, strict=True):
        drawn = False
        for color, (label, runs_rows) in zip(COLORS, rows.items(), strict=False):
            series = [diagnostic_series(r, column) for r in runs_rows]
            series = [s for s in series if s[0]]
            if series:
                _draw(ax, series, color, label, trailing)
                drawn = True
        ax.set_title(title if drawn else f"{title}: not logged")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _labels(config: CompareConfig) -> list[str]:
    if config.labels:
        return list(config.labels)
    names = []
    for side in (config.runs, config.vs) if config.vs else (config.runs,):
        algos = {run_config(run).get("algo") for run in side}
        names.append(str(algos.pop()) if len(algos) == 1 and None not in algos else "")
    if len(names) == 2:
        return names if names[0] != names[1] and "" not in names else ["A", "B"]
    return [names[0] or "runs"]


def _has_column(runs: Sequence[Path], column: str) -> bool:
    return any(isinstance(row.get(column), int | float) for run in runs for row in read_metrics(run))


def compare(config: CompareConfig) -> dict[str, Any]:
    """Write ``config.out``'s report, tables and plots (module doc); returns ``markdown`` (the tables),
    ``report`` / ``json`` (the paths written), ``plots`` and ``tables`` (per column: the paired comparison's
    or the summary's dict). A missing run directory raises ``FileNotFoundError`` naming it."""
    sides = [config.runs, config.vs] if config.vs else [config.runs]
    everything = [run for side in sides for run in side]
    for run in everything:
        read_metrics(run)  # a missing run or metrics file: FileNotFoundError naming it
    labels = _labels(config)
    assert config.out is not None  # CompareConfig requires it
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = [c for c in config.columns if _has_column(everything, c)]
    skipped = [c for c in config.columns if c not in columns]
    if not columns:
        raise ValueError(f"no run has any of the columns {list(config.columns)} in its metrics.jsonl")

    tables: dict[str, Any] = {}
    markdown: list[str] = []
    curves: dict[str, dict[str, list[Curve]]] = {}
    for column in columns:
        per_side = [[load_curve(run, column) for run in side] for side in sides]
        curves[column] = dict(zip(labels, per_side, strict=True))
        if config.vs:
            comparison = compare_curves(per_side[0], per_side[1], config.pairing)
            tables[column] = comparison.to_dict()
            markdown.append(comparison_table(comparison, (labels[0], labels[1])))
        else:
            summary = summarize_curves(per_side[0])
            tables[column] = {name: spread.to_dict() for name, spread in summary.items()}
            markdown.append(summary_table(per_side[0], labels[0]))
    plots = [
        plot_learning_curves(curves, out / "learning_curves.png", config.trailing),
        plot_diagnostics(dict(zip(labels, sides, strict=True)), out / "diagnostics.png", config.trailing),
    ]
    runs_info = [
        {"label": label, "run": str(run), **_run_facts(run)}
        for label, side in zip(labels, sides, strict=True)
        for run in side
    ]
    result = {
        "labels": labels,
        "runs": runs_info,
        "columns": columns,
        "skipped_columns": skipped,
        "tables": tables,
        "plots": [str(p) for p in plots],
    }
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    tables_md = "\n\n".join(markdown)
    (out / "report.md").write_text(_report_markdown(labels, runs_info, tables_md, skipped, bool(config.vs)))
    return {
        **result,
        "markdown": tables_md,
        "report": str(out / "report.md"),
        "json": str(out / "compare.json"),
    }


def _run_facts(run: Path) -> dict[str, Any]:
    config = run_config(run)
    rows = read_metrics(run)
    held_out = [r["eval/success"] for r in rows if isinstance(r.get("eval/success"), int | float)]
    return {
        "algo": config.get("algo"),
        "env": config.get("env"),
        "seed": config.get("seed"),
        "updates": max((int(r.get("update", 0)) for r in rows), default=0),
        "first_eval": held_out[0] if held_out else None,
        "last_eval": held_out[-1] if held_out else None,
        "held_out_gain": held_out_gain(run),
    }


def held_out_evaluations(run: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The held-out evaluations' per-episode records by update (``evals/update-N.jsonl``)."""
    return RunDir(run).evaluations()


def held_out_ends(
    evals: Mapping[int, Sequence[Mapping[str, Any]]],
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """A run's first and last held-out evaluations (``held_out_evaluations``) on the episodes the last played: the
    start's records of the last's keys, since an evaluation between the ends (a run stopped before its final one,
    ``TrainConfig.final_eval_episodes``) plays the first of the start's episodes."""
    last = list(evals[max(evals)])
    keys = {r["key"] for r in last}
    return [r for r in evals[min(evals)] if r["key"] in keys], last


def _paired(
    start: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]]
) -> tuple[list[float], list[str]]:
    """The per-episode success differences end − start on the same episodes (by key), and their tasks."""
    a = {r["key"]: (r["task_id"], float(r["won"])) for r in start}
    b = {r["key"]: (r["task_id"], float(r["won"])) for r in end}
    if a.keys() != b.keys() or any(a[k][0] != b[k][0] for k in a):
        raise ValueError("the two evaluations did not play the same episodes (keys and tasks differ)")
    keys = sorted(a)
    return [b[k][1] - a[k][1] for k in keys], [a[k][0] for k in keys]


def paired_gain(
    start: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]]
) -> ClusteredMeanInterval:
    """Mean per-episode success difference end − start on the same episodes, with its 95 % interval clustered by
    task (``clustered_t_interval``; the demo plays every test task equally often, so it is the t interval over
    the per-task mean differences)."""
    return clustered_t_interval(*_paired(start, end))


def paired_gain_by_episode(
    start: Sequence[Mapping[str, Any]], end: Sequence[Mapping[str, Any]]
) -> MeanInterval:
    """``paired_gain``'s mean with the episode-level paired t interval (episodes taken as independent)."""
    return t_interval(_paired(start, end)[0])


def held_out_gain(run: str | Path) -> dict[str, Any] | None:
    """The run's last held-out evaluation against its first, paired on the same episodes, with the 95 % interval
    clustered by task (``paired_gain``); ``None`` without two evaluations on the same episodes of two tasks
    or more."""
    files = RunDir(run)
    evals = files.evaluations() if files.evals.is_dir() and any(files.evals.iterdir()) else {}
    if len(evals) < 2 or len({r["task_id"] for r in evals[min(evals)]}) < 2:
        return None
    try:
        return paired_gain(*held_out_ends(evals)).to_dict()
    except ValueError:  # the evaluations played different episodes (a run resumed with other settings)
        return None


def _report_markdown(
    labels: Sequence[str],
    runs: Sequence[Mapping[str, Any]],
    tables: str,
    skipped: Sequence[str],
    paired: bool,
) -> str:
    def cell(value: Any) -> str:
        return "–" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))

    lines = [f"# {' vs '.join(labels)}", "", "## Runs", ""]
    lines += [
        "| side | run | algo | env | seed | updates | held-out success first → last | last − first (95 %, by task) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        g = r["held_out_gain"]
        gain = "–" if g is None else f"{g['mean']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]"
        lines.append(
            f"| {r['label']} | `{r['run']}` | {cell(r['algo'])} | {cell(r['env'])} | {cell(r['seed'])} | {r['updates']} | "
            f"{cell(r['first_eval'])} → {cell(r['last_eval'])} | {gain} |"
        )
    lines += ["", "## Learning-curve metrics", "", tables, ""]
    if skipped:
        lines += [f"Columns no run logged (left out): {', '.join(skipped)}.", ""]
    lines += [
        "## Learning curves",
        "",
        "![learning curves](learning_curves.png)",
        "",
        "## Diagnostics",
        "",
        "![diagnostics](diagnostics.png)",
        "",
        "## How to read this",
        "",
        "- **Held-out success** (`eval/success`) is measured on fixed tasks with the same episode seeds at every "
        "evaluation: the honest curve. **Batch success** (`batch/success`) is what the policy achieved on the tasks "
        "it trained on; SPO/SPO++'s prioritized sampler picks tasks near 50 % success, so it is not an estimate "
        "of how good the policy is.",
        "- **AUC** (trapezoidal, SPO++ Eq. 7; and the step mean) summarizes the whole curve, so it rewards learning "
        "early; **final** is the mean of the last five points; **C10** (SPO++ Eq. 8) weighs the first ten points' "
        "area and their last five equally: early learning.",
    ]
    if paired:
        lines.append(
            "- The paired column is the difference of matched runs (same seed), each pair truncated to its common "
            "budget: mean ± sample standard deviation over the pairs (SPO++ Table 1). A difference whose s.d. is as "
            "large as its mean is not distinguishable from zero with this many seeds."
        )
    lines += [
        "- **last − first** is each run's own held-out gain: its last evaluation against its first on the same "
        "episodes, with the 95 % interval clustered by task (the unit: a task's repeated episodes are not "
        "independent). The table's spreads are over runs, the independent unit across seeds.",
        "- Thin lines are single runs, thick lines their mean with a shaded ±1 standard error across runs, dashed "
        "lines a trailing mean. One evaluation's standard error is at least √(p(1−p)/n) (about .035 at p = .3 and "
        "200 episodes of distinct tasks; more when tasks repeat): differences smaller than that are noise.",
        "- Diagnostics: a KL or clip fraction that grows steadily means updates move the policy further than the "
        "trust region intends; a gradient norm spike precedes instability; staleness is how many versions old the "
        "trained tokens were (bounded by max_staleness).",
        "",
        "Formulas: docs/evaluation.md.",
    ]
    return "\n".join(lines) + "\n"
