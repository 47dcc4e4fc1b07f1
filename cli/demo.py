"""``streamrl demo``: the toolkit's main job on the embedded default, end to end, with a report.

On ``tiny`` and Math-TIR it:

1. gets the cold-start model -- an SFT checkpoint of Math-TIR, by default the demo's recipe, Math-TIR's preset
   stopped early (``DEMO_COLD_START``; shipped, or built by its recipe on first use);
2. initializes the prompt values offline (``offline_rollouts`` rollouts per training task, cached per checkpoint);
3. trains with SPO++ on the single-stream runtime, evaluating a fixed set of held-out test episodes (the same
   tasks and episode seeds every time) before the first update and every ``eval_every`` updates, the curve; the
   evaluations before the first update and at the end play ``final_eval_factor`` times as many, the curve's first;
4. compares the trained policy with the starting checkpoint on the ends' episodes, paired: the mean of the
   per-episode differences with its 95 % interval clustered by task (each test task is played several times, and
   its episodes are not independent), the episode-level Student-t interval beside it;
5. writes ``report.md`` (the tables, the curves, what to look at), ``demo.json`` and ``demo.png``.

Why these settings. Learning on 2 CPU cores is narrow: a few points of held-out success in minutes, the same
size as the noise of one 64-episode batch. Two things make it visible. The held-out evaluation is paired: a
frozen policy plays every evaluation's episodes identically (same tasks, same sampling seeds), so its curve is a
flat line at the start's value -- the frozen-policy control costs no extra run -- and the paired interval of a
changed policy is several times narrower than the two independent ones. And the training curve is shown with a
trailing mean, beside the held-out one, because the prioritized sampler moves the batches toward tasks near
v̂ = ½ and so moves their success even for a frozen policy: read learning from the held-out curve.

Interrupted (Ctrl-C, or killed), the same command resumes the run from its last checkpoint; run to the end, it
only rewrites the report.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamrl.algorithms.run_dir import RunDir
from streamrl.evaluation.compare import (
    held_out_ends,
    held_out_evaluations,
    paired_gain,
    paired_gain_by_episode,
)
from streamrl.utils.stats import clustered_wilson_interval, wilson_interval

DEMO_COLD_START: Mapping[str, Any] = {"stop_above": 0.25, "restart_below": 0.25}
"""The demo's SFT recipe, as overrides of Math-TIR's preset: the preset's training run stopped after the first
epoch whose validation reaches 25 % (epoch 3 of 12 at seed 0: the same bytes as the preset's run up to there),
restarted with another seed if none does. A start weaker than the preset's, so that the demo's few minutes of
SPO++ have room to show a gain beyond the paired interval (from the preset's stronger start they show none), and
built on the reproducible kernel path like every shipped checkpoint (docs/training.md, "The demo"; docs/sft.md,
the shipped checkpoints)."""
DEMO_60_UPDATES: Mapping[str, Any] = {"updates": 60, "final_eval_factor": 1}
"""The demo's run until 2026-12-06 (60 updates, every evaluation 405 episodes), as ``DemoConfig`` overrides: what
Table 1 at CPU scale (``examples/reproduce_table1.py``) and the LoRA benchmark (``benchmarks/bench_lora.py``)
measured, so their documented numbers still reproduce now that the demo trains 40 updates with longer ends."""


@dataclass(frozen=True)
class DemoConfig:
    """``streamrl demo``: SPO++ on Math-TIR from the cold-start checkpoint of ``tiny``, a paired held-out evaluation
    of the start and the trained adapter, and a report (``OUT/report.md``)."""

    out: Path = Path("runs/demo")
    """Run directory; an unfinished demo there is resumed, a finished one only re-reported."""
    updates: int = 40
    """SPO++ updates (publication every two, the paper's Math-TIR setting). The held-out curve is flat after about
    30 on every seed measured, so 40 leave the time for the ends' longer evaluation (``final_eval_factor``) within
    the demo's budget (docs/training.md, "The demo")."""
    batch: int = 64
    """Trajectories per update."""
    num_envs: int = 32
    """Episodes in flight."""
    lr: float = 2e-4
    """Learning rate (full fine-tuning: ``tiny`` has 2M parameters). From the demo's start, 2e-4 gained more than
    1e-4 at each of three seeds (docs/training.md, "The demo")."""
    mini_batches: int = 4
    """Optimizer steps per update."""
    finetune: Literal["auto", "full", "lora"] = "auto"
    """``"auto"`` (full fine-tuning: ``tiny`` is below the LoRA threshold), ``"full"`` or ``"lora"`` (a peft
    adapter of ``lora_rank`` / ``lora_alpha`` on every linear layer; give it its own ``lr``)."""
    lora_rank: int = 16
    """``finetune="lora"``: the adapter's rank."""
    lora_alpha: int = 32
    """``finetune="lora"``: the adapter's scale numerator (scale = alpha / rank)."""
    offline_rollouts: int = 4
    """Rollouts per training task that initialize the prompt values (cached per checkpoint)."""
    eval_every: int = 10
    """Updates between held-out evaluations."""
    eval_episodes: int = 405
    """Held-out episodes per evaluation (every test task equally often): 405 plays each Math-TIR test task of the
    SFT families once, so the paired interval's unit, the task, has 405 draws."""
    final_eval_factor: int = 4
    """The start's and the end's evaluations, whose paired difference is the demo's result, play
    ``final_eval_factor`` x ``eval_episodes`` episodes (``TrainConfig.final_eval_episodes``): 4 plays each test task
    four times there, while the curve in between plays the first ``eval_episodes`` of them, each task once. It
    narrows the clustered interval by about 40 % for about two minutes more (docs/training.md, "The demo")."""
    threads: int = 2
    """torch threads (both cores of a 2-core machine; 1 if something else runs beside the demo)."""
    seed: int = 0
    progress: bool = True
    """Progress bars."""
    init: Literal["sft", "base"] = "sft"
    """Start from the SFT checkpoint (the demo) or the untrained model (a smoke test of the pipeline)."""
    cold_start: Literal["demo", "preset"] = "demo"
    """``init="sft"``: which SFT checkpoint -- ``"demo"``: the demo's recipe (``DEMO_COLD_START``, shipped);
    ``"preset"``: Math-TIR's preset (``SFTConfig.math_tir()``, what ``streamrl train`` starts from)."""
    tasks: int | None = None
    """Train on the first N Math-TIR training tasks (``None`` = all)."""
    extra_tasks: int = 0
    """Train on this many more generated problems of the SFT families besides the training split's 271
    (``MathTIRConfig.extra_train``; never a test problem). 0 by default: 500 more gained no more held out and cost
    a fresh clone their offline values (docs/training.md, "The demo")."""
    max_new_tokens: int | None = None
    """Tokens per turn; ``None`` = Math-TIR's default."""

    def __post_init__(self) -> None:
        for name in ("updates", "batch", "num_envs", "eval_every", "eval_episodes", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.extra_tasks < 0:
            raise ValueError(
                f"extra_tasks must be >= 0 (0: the training split's own tasks), got {self.extra_tasks}"
            )
        if self.final_eval_factor < 1:
            raise ValueError(
                f"final_eval_factor must be >= 1 (1: the ends play eval_episodes too), got {self.final_eval_factor}"
            )
        if self.eval_episodes < 2:  # n distinct tasks for n up to the test split's size
            raise ValueError(
                f"eval_episodes must be >= 2 (a paired interval clustered by task needs two tasks), "
                f"got {self.eval_episodes}"
            )

    def train_config(self) -> Any:
        from streamrl.algorithms.learner import LearnerConfig
        from streamrl.algorithms.train import TrainConfig

        return TrainConfig(
            out=str(self.out),
            env="math_tir",
            algo="spo++",
            model="tiny",
            init=self.init,
            sft=dict(DEMO_COLD_START) if self.init == "sft" and self.cold_start == "demo" else {},
            tasks=self.tasks,
            env_kwargs={"extra_train": self.extra_tasks} if self.extra_tasks else {},
            max_new_tokens=self.max_new_tokens,
            updates=self.updates,
            batch=self.batch,
            num_envs=self.num_envs,
            offline_rollouts=self.offline_rollouts,
            eval_every=self.eval_every,
            eval_episodes=self.eval_episodes,
            final_eval_episodes=self.eval_episodes * self.final_eval_factor,
            threads=self.threads,
            seed=self.seed,
            learner=LearnerConfig(
                finetune=self.finetune,
                lr=self.lr,
                mini_batches=self.mini_batches,
                lora_rank=self.lora_rank,
                lora_alpha=self.lora_alpha,
            ),
        )


def run_demo(config: DemoConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) the demo run and write its report; returns the report's numbers (``demo.json``)."""
    from streamrl.algorithms.train import train

    started = time.perf_counter()
    train_config = config.train_config()
    resume = RunDir(config.out).is_run()
    final = train_config.final_eval_episodes
    ends = f" ({final} at the start and the end)" if config.final_eval_factor > 1 else ""
    log(
        f"streamrl demo: SPO++ on Math-TIR, tiny from its SFT checkpoint, {config.updates} updates of "
        f"{config.batch}, held-out evaluation of {config.eval_episodes} episodes every {config.eval_every} "
        f"updates{ends} -> {config.out}" + (" (resuming)" if resume else "")
    )
    run = train(train_config, resume=resume, progress=config.progress)
    if run["interrupted"]:  # Ctrl-C: the run checkpointed; a report of half a run would compare nothing
        log(f"interrupted at update {run['updates']}; `streamrl demo` again resumes it and writes the report")
        return {"interrupted": True, "updates": run["updates"], "run_dir": str(config.out)}
    summary = write_report(config.out)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    (config.out / "demo.json").write_text(json.dumps(summary, indent=2))
    log(summary_text(summary))
    log(f"report: {config.out / 'report.md'}")
    return summary


# ---------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------


def write_report(run: str | Path) -> dict[str, Any]:
    """``report.md`` and ``demo.png`` for a finished (or partial) run with held-out evaluations; returns the
    numbers: start and end success with intervals clustered by task (``ci_low``, ``ci_high``) and Wilson's over
    episodes (``episode_ci``), the paired gain clustered by task and over episodes (``paired_gain_episode``),
    the curves."""
    run = Path(run)
    from streamrl.evaluation.curves import read_metrics

    evals = held_out_evaluations(run)
    first, last = min(evals), max(evals)
    rows = read_metrics(run)
    batch = [(int(r["update"]), float(r["batch/success"])) for r in rows if "batch/success" in r]

    def rate(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        wins = sum(bool(r["won"]) for r in records)
        tasks = [r["task_id"] for r in records]
        lo, hi = clustered_wilson_interval([bool(r["won"]) for r in records], tasks)
        return {
            "success": wins / len(records),
            "ci_low": lo,
            "ci_high": hi,
            "episodes": len(records),
            "tasks": len(set(tasks)),
            "episode_ci": list(wilson_interval(wins, len(records))),
        }

    # The curve's evaluations play the first of the ends' episodes (TrainConfig.final_eval_episodes): every
    # point of the curve is over the episodes all evaluations share, the ends' comparison over all of theirs.
    shared = set.intersection(*({r["key"] for r in recs} for recs in evals.values()))
    on_curve = {u: [r for r in recs if r["key"] in shared] for u, recs in sorted(evals.items())}
    start = held_out_ends(evals)[0]  # a run stopped before its end: the start's episodes its last one played
    gain = paired_gain(start, evals[last]) if last != first else None
    summary: dict[str, Any] = {
        "run": str(run),
        "start": {"update": first, **rate(start)},
        "end": {"update": last, **rate(evals[last])},
        "paired_gain": gain.to_dict() if gain is not None else None,
        "paired_gain_episode": (
            paired_gain_by_episode(start, evals[last]).to_dict() if last != first else None
        ),
        # [update, success, half-width of the 95 % interval (clustered by task) of its difference to the start]
        "held_out_curve": [
            [u, rate(recs)["success"], 0.0 if u == first else paired_gain(on_curve[first], recs).half_width]
            for u, recs in on_curve.items()
        ],
        "curve_episodes": len(shared),
        "batch_curve": batch,
        "learns": bool(gain is not None and gain.low > 0),
    }
    plot = plot_demo(summary, run / "demo.png")
    (run / "report.md").write_text(_markdown(summary, plot.name))
    return summary


def summary_text(summary: Mapping[str, Any]) -> str:
    """The result in three lines."""
    s, e, g = summary["start"], summary["end"], summary["paired_gain"]
    lines = [
        f"held-out success (update {s['update']}): {s['success']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]",
        f"held-out success (update {e['update']}): {e['success']:.3f} [{e['ci_low']:.3f}, {e['ci_high']:.3f}]",
    ]
    if g is not None:
        verdict = "excludes 0: it learned" if g["ci_low"] > 0 else "includes 0: no clear gain"
        ep = summary["paired_gain_episode"]
        lines.append(
            f"paired gain on the same {g['n']} episodes of {g['tasks']} tasks: {g['mean']:+.3f} "
            f"[{g['ci_low']:+.3f}, {g['ci_high']:+.3f}] (95 %, clustered by task, {verdict}; "
            f"over episodes as if independent [{ep['ci_low']:+.3f}, {ep['ci_high']:+.3f}])"
        )
    return "\n".join(lines)


def plot_demo(summary: Mapping[str, Any], path: Path, trailing: int = 5) -> Path:
    """Held-out success (with Wilson intervals) beside the frozen-policy line, and the training batches'
    success with a trailing mean."""
    from streamrl.evaluation.compare import _pyplot, trailing_mean

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    updates = [u for u, _, _ in summary["held_out_curve"]]
    values = [v for _, v, _ in summary["held_out_curve"]]
    halves = [h for _, _, h in summary["held_out_curve"]]
    n = summary.get("curve_episodes", summary["start"]["episodes"])
    left.errorbar(
        updates, values, yerr=halves, color="tab:blue", marker="o", capsize=3,
        label="SPO++ (bars: 95 % paired interval of the difference to the start, clustered by task)",
    )  # fmt: skip
    left.axhline(
        values[0],
        color="gray",
        linestyle="--",
        label="frozen policy (start; same episodes)",
    )
    left.set_title(f"held-out success, {n} fixed test episodes")
    left.set_xlabel("update")
    left.set_ylabel("success rate")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    if summary["batch_curve"]:
        bu = [u for u, _ in summary["batch_curve"]]
        bv = [v for _, v in summary["batch_curve"]]
        right.plot(bu, bv, color="tab:orange", alpha=0.35, linewidth=0.8, label="batch success")
        right.plot(
            bu, trailing_mean(bv, trailing), color="tab:orange", linewidth=2, label=f"{trailing}-update mean"
        )
    right.set_title("training batches (prioritized sampler: not a learning curve alone)")
    right.set_xlabel("update")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _markdown(summary: Mapping[str, Any], plot: str) -> str:
    s, e, g = summary["start"], summary["end"], summary["paired_gain"]
    lines = [
        "# streamrl demo: SPO++ on Math-TIR (tiny, CPU)",
        "",
        f"Run: `{summary['run']}`. Held-out: {s['episodes']} fixed episodes of the Math-TIR test split (every "
        "task equally often, the same sampling seeds at every evaluation), sampled at temperature 1.",
        "",
        "| policy | update | held-out success | 95 % interval (by task) | 95 % interval (episodes, Wilson) |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("start (SFT checkpoint)", s), ("trained (SPO++)", e)):
        lines.append(
            f"| {name} | {r['update']} | {r['success']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | "
            f"[{r['episode_ci'][0]:.3f}, {r['episode_ci'][1]:.3f}] |"
        )
    lines.append("")
    if g is not None:
        ep = summary["paired_gain_episode"]
        lines += [
            f"**Paired gain** (trained − start, per episode, the same {g['n']} episodes of {g['tasks']} tasks): "
            f"**{g['mean']:+.3f}**, 95 % interval [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}] clustered by task"
            + (": it excludes 0." if g["ci_low"] > 0 else ": it includes 0, no clear gain in this run.")
            + f" Over episodes as if independent it would be [{ep['ci_low']:+.3f}, {ep['ci_high']:+.3f}].",
            "",
        ]
    curve = ", ".join(f"{u}: {v:.3f}" for u, v, _ in summary["held_out_curve"])
    n = summary.get("curve_episodes", s["episodes"])
    if n != s["episodes"]:
        curve += f" (the first {n} of the {s['episodes']} episodes, which every evaluation played)"
    lines += [
        f"![learning curves]({plot})",
        "",
        f"Held-out success by update: {curve}.",
        "",
        "## What to look at",
        "",
        "- **The held-out curve against the dashed line.** The dashed line is the frozen policy: it would play "
        "every evaluation's episodes exactly as at the start (same tasks, same sampling seeds), so it stays at the "
        "start's value -- the learning-rate-0 control, for free. Points above it are learning.",
        "- **The paired gain**, not the two intervals of the table: the same episodes under both policies differ "
        "only where the policy changed, so the paired interval is far narrower than the two success intervals "
        "suggest.",
        "- **Intervals clustered by task.** Each test task is played several times; its episodes share the task's "
        "difficulty and are not independent draws, so the unit is the task (with every task equally often: the "
        "t interval over the per-task mean differences). The episode-level interval beside it treats every "
        "episode as independent and is too narrow when outcomes correlate within tasks.",
        "- **The training batches** (right) rise partly without learning: SPO++'s sampler draws tasks near "
        "v̂ = ½ more often as the tracker learns the task values, which moves batch success for a frozen policy too. "
        "Its trailing mean is a sanity check, not the result.",
        "- More: `streamrl compare RUN --out DIR` (curves, PPO KL, clip fraction, grad norm, staleness), "
        "`streamrl eval run:RUN --vs run:RUN@0` (pass@k, breakdowns by family, greedy and sampled).",
        "",
    ]
    return "\n".join(lines)
