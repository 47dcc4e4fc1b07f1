"""Reproduce SPO++ Table 1: SPO++ against SPO and GRPO, matched seeds, beside an lr-0 control, on ALFWorld and
Math-TIR.

For each env and seed it trains SPO++, SPO and GRPO (G = 8) with one config that differs only in the algorithm,
and a control, SPO++ at learning rate 0, at the first seed (each run resumes if its directory already holds it).
Then it compares the matched runs as the paper does: the learning curve's area (ALFWorld: the normalized
trapezoidal AUC, Eq. 7; Math-TIR: the step mean) and its end (mean of the last five points), each pair truncated
to its common budget, reported as paired differences SPO++ − baseline (mean ± sample s.d. over seeds, with the
95 % t interval over seeds), beside each run's held-out gain and, per seed, the difference of the two runs' last
evaluations on the same episodes (both clustered by task). The curve is the held-out evaluation (fixed tasks and
episode seeds), not the training batches. ``streamrl compare`` writes each baseline's plots and report beside
the table::

    python examples/reproduce_table1.py --scale cpu --envs math_tir   # the demo's run x 3 algorithms x 5 seeds + control
    python examples/reproduce_table1.py --scale cpu --envs alfworld --seeds 0 1 2   # ALFWorld's preset, 3 seeds
    python examples/reproduce_table1.py --scale paper --model /models/Qwen3.5-0.8B --dry-run
    python examples/reproduce_table1.py --scale tiny --envs math_tir  # a smoke run of the whole pipeline

``--scale paper`` is SPO++ Table 3 for a GPU box with the model on local disk (the configs ``--dry-run`` prints);
``--scale cpu`` is what 2 CPU cores afford on ``tiny`` from its SFT checkpoints (on Math-TIR 16 runs of 9-14 min two
at a time, about 100 min as two processes: a run's env workers and sandboxes take about 8 GB, so three at once
exhaust 24 GiB; on ALFWorld, ``--seeds 0 1 2``, ten runs of the preset of about 35 min each; its
table and how to read it: docs/evaluation.md, "SPO++ Table 1 on CPU").
``--envs``, ``--seeds``, ``--algos``, ``--no-control`` and ``--train-only`` split the runs into processes; the
command without ``--train-only`` then builds the table from them. Ctrl-C stops the script after the current run
checkpoints; the same command resumes it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from streamrl.algorithms.base import make_algorithm
from streamrl.algorithms.learner import LearnerConfig
from streamrl.algorithms.train import TrainConfig, train
from streamrl.evaluation.compare import (
    CompareConfig,
    compare,
    held_out_evaluations,
    held_out_gain,
    paired_gain,
)
from streamrl.evaluation.curves import HELD_OUT, Spread, compare_curves, load_curve, summarize_curves
from streamrl.utils.stats import t_interval

ALGOS = ("spo++", "spo", "grpo")  # SPO++ and its baselines: SPO (single stream), GRPO (groups of G = 8)
CONTROL = "spo++-lr0"  # the control: SPO++ with learning rate 0 (the frozen start, evaluated like the others)
AREA = {"alfworld": "auc_trapz", "math_tir": "auc_mean"}  # SPO++ App. A: how each env's area is computed

# SPO++ Table 3. ALFWorld: the base policy, 128 canonical games, <= 50 interactions, 1,024 offline rollouts,
# 6,400 online trajectories in updates of 128, publication every update. Math-TIR: the SFT cold start, <= 8 turns,
# 12,000 offline rollouts (8 per prompt), 25,600 online trajectories, publication every two updates. Actor: full
# fine-tuning, lr 1e-6, weight decay 0.1, one epoch; the algorithms' own clip settings (Dual-Clip c = 2 vs 10).
PAPER: dict[str, dict[str, Any]] = {
    "alfworld": {"init": "base", "updates": 50, "batch": 128, "num_envs": 128, "offline_rollouts": 8},
    "math_tir": {"init": "sft", "updates": 200, "batch": 128, "num_envs": 128, "offline_rollouts": 8},
}
PAPER_LEARNER = LearnerConfig(finetune="full", lr=1e-6, weight_decay=0.1, mini_batches=1, epochs=1)
PAPER_EVAL: dict[str, Any] = {"eval_every": 5, "eval_episodes": 200, "backend": "hf", "threads": 8}

# What 2 CPU cores afford, one torch thread per run so two runs share the machine. Math-TIR: exactly the demo's
# run (``streamrl demo``: 60 updates of 64 from its SFT start at its learning rate, the held-out curve every test
# task of the SFT families once, every 10 updates). ALFWorld: its preset (``TrainConfig.for_env("alfworld")``: 60
# updates of 16 whole episodes on the 128 training games, constrained actions, lr 3e-3, chosen on the validation
# games), its held-out curve every ``eval_seen`` game once at updates 0, 20, 40 and 60 rather than the
# validation games the recipe was chosen on, so the comparison does not favour the algorithm it was tuned for.
CPU: dict[str, dict[str, Any]] = {
    "alfworld": {"eval_split": "eval_seen", "eval_episodes": 140, "eval_every": 20, "threads": 1},
}

TINY: dict[str, Any] = {
    "init": "base",
    "updates": 2,
    "batch": 4,
    "num_envs": 4,
    "tasks": 4,
    "offline_rollouts": 1,
}
TINY |= {"eval_every": 1, "eval_episodes": 4, "max_new_tokens": 16, "env_workers": "inprocess"}
TINY_ENV: dict[str, dict[str, Any]] = {"alfworld": {"env_kwargs": {"max_steps": 3}}, "math_tir": {}}


def run_config(scale: str, env: str, algo: str, seed: int, out: Path, model: str) -> TrainConfig:
    """The config of one run; the algorithms' configs differ only in ``algo`` (the control: SPO++ at lr 0)."""
    name = algo
    algo, lr0 = ("spo++", True) if algo == CONTROL else (algo, False)
    run = str(out / env / f"{name}-seed{seed}")
    if scale == "cpu" and env == "math_tir":
        from streamrl.cli.demo import DEMO_60_UPDATES, DemoConfig

        # the demo's run as Table 1 measured it (docs/evaluation.md): 60 updates, each evaluation 405 episodes
        demo = DemoConfig(out=Path(run), seed=seed, threads=1, progress=False, **DEMO_60_UPDATES)
        base = demo.train_config()
        base = replace(base, algo=algo)
    else:
        base = TrainConfig(out=run, env=env, algo=algo, seed=seed, model=model)
        if scale == "paper":
            base = replace(base, **PAPER[env], **PAPER_EVAL, learner=PAPER_LEARNER)
        elif scale == "cpu":
            base = TrainConfig.for_env(env, out=run, algo=algo, seed=seed, model=model, **CPU[env])
        else:
            base = replace(base, **TINY, **TINY_ENV[env])
            if algo == "grpo":  # groups of 2 in batches of 4
                base = replace(base, algorithm={"group_size": 2})
    return replace(base, learner=replace(base.learner, lr=0.0)) if lr0 else base


def seed_interval(values: list[float]) -> dict[str, Any]:
    """Mean ± sample s.d. of per-seed values and their 95 % t interval over seeds (the seed is the unit when
    asking which algorithm to use: each seed is one independent run of each)."""
    spread = Spread.of(values).to_dict()
    ci = t_interval(values) if len(values) > 1 else None
    return spread | {"ci_low": None if ci is None else ci.low, "ci_high": None if ci is None else ci.high}


def _last_evaluation(run: Path) -> tuple[int, list[dict[str, Any]]]:
    evals = held_out_evaluations(run)
    return max(evals), evals[max(evals)]


def table(out: Path, envs: list[str], seeds: list[int], algos: list[str], control: bool) -> dict[str, Any]:
    """Table 1 from the runs under ``out``, per env:

    - each algorithm's area and end over seeds (mean ± s.d.), and each run's held-out gain, its last evaluation
      against its first on the same episodes with the 95 % interval clustered by task (``paired_gain``);
    - the first algorithm (SPO++) against each other one: the paired differences of area and end over seeds,
      with their t interval over seeds, and per seed the difference of the two runs' last evaluations on the
      same episodes (same tasks, same sampling seeds), clustered by task;
    - the control (SPO++ at learning rate 0) run's gain, which must be 0: it replays its start exactly."""
    rows: dict[str, Any] = {}
    ref = algos[0]
    for env in envs:
        runs = {a: [out / env / f"{a}-seed{s}" for s in seeds] for a in algos}
        curves = {a: [load_curve(r, HELD_OUT) for r in runs[a]] for a in algos}
        area = AREA[env]
        summary = {a: summarize_curves(curves[a]) for a in algos}
        gains = {a: [held_out_gain(r) for r in runs[a]] for a in algos}
        row: dict[str, Any] = {
            "area_metric": area,
            "seeds": seeds,
            "algorithms": {
                a: {
                    "area": summary[a][area].to_dict(),
                    "end": summary[a]["final"].to_dict(),
                    "held_out_gain": gains[a],
                    "held_out_gain_over_seeds": seed_interval([g["mean"] for g in gains[a] if g]),
                }
                for a in algos
            },
            "differences": {},
        }
        for other in algos[1:]:
            cmp = compare_curves(curves[ref], curves[other])
            last = []
            for x, y in zip(runs[ref], runs[other], strict=True):
                (ux, ex), (uy, ey) = _last_evaluation(x), _last_evaluation(y)
                # paired_gain(start, end) is end − start on the same episodes: here ref − other
                last.append({"update": min(ux, uy), **paired_gain(ey, ex).to_dict()} if ux == uy else None)
            row["differences"][f"{ref} - {other}"] = {
                "area": seed_interval(list(cmp.difference[area].values)),
                "end": seed_interval(list(cmp.difference["final"].values)),
                "last_evaluation_by_seed": last,
            }
            compare(
                CompareConfig(runs=tuple(runs[ref]), vs=tuple(runs[other]), out=out / env / f"report-{other}")
            )
        if control:
            row["control"] = {
                "run": CONTROL,
                "seed": seeds[0],
                "held_out_gain": held_out_gain(out / env / f"{CONTROL}-seed{seeds[0]}"),
            }
        rows[env] = row
    return rows


def pp(x: dict[str, Any], interval: bool = True) -> str:
    """A ``seed_interval`` (or spread) in percentage points: ``mean ± s.d. [low, high]``."""
    if x["mean"] is None:
        return "n/a"
    text = f"{100 * x['mean']:+.2f}" + ("" if x["sd"] is None else f" ± {100 * x['sd']:.2f}")
    if interval and x.get("ci_low") is not None:
        text += f" [{100 * x['ci_low']:+.2f}, {100 * x['ci_high']:+.2f}]"
    return text


def markdown(rows: dict[str, Any]) -> str:
    def gain(g: dict[str, Any] | None) -> str:
        return "–" if g is None else f"{g['mean']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]"

    lines = [
        "| env | algorithm | area | end | held-out gain (pp, mean ± s.d. [95 % over seeds]) | per seed (clustered by task) |",
        "|---|---|---|---|---|---|",
    ]
    for env, r in rows.items():
        for a, x in r["algorithms"].items():
            lines.append(
                f"| {env} | {a} | {x['area']['mean']:.3f} | {x['end']['mean']:.3f} | "
                f"{pp(x['held_out_gain_over_seeds'])} | {'; '.join(gain(g) for g in x['held_out_gain'])} |"
            )
        if "control" in r:
            c = r["control"]
            lines.append(f"| {env} | {c['run']} (seed {c['seed']}) | | | | {gain(c['held_out_gain'])} |")
    lines += [
        "",
        "| env | difference | Δ area (pp) | Δ end (pp) | Δ at the last evaluation, per seed (same episodes, clustered by task) | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for env, r in rows.items():
        for name, d in r["differences"].items():
            lines.append(
                f"| {env} | {name} | {pp(d['area'])} | {pp(d['end'])} | "
                f"{'; '.join(gain(g) for g in d['last_evaluation_by_seed'])} | {len(r['seeds'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=["cpu", "paper", "tiny"], default="cpu")
    parser.add_argument(
        "--envs", nargs="+", choices=["alfworld", "math_tir"], default=["alfworld", "math_tir"]
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--algos", nargs="+", choices=ALGOS, default=list(ALGOS), help="the first is the reference"
    )
    parser.add_argument(
        "--control", action=argparse.BooleanOptionalAction, default=True,
        help=f"also train the control ({CONTROL}: SPO++ at learning rate 0) at the first seed",
    )  # fmt: skip
    parser.add_argument("--train-only", action="store_true", help="train (or resume) the runs; no table")
    parser.add_argument(
        "--model", default="tiny", help="registry name or local model directory (paper: 0.8B)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/table1"))
    parser.add_argument("--dry-run", action="store_true", help="print the configs, check them, train nothing")
    a = parser.parse_args(argv)
    if a.scale == "paper" and a.model == "tiny":
        parser.error(
            "--scale paper needs --model: a local directory of the paper's model (e.g. Qwen3.5-0.8B)"
        )
    if len(a.seeds) < 2 and not (a.dry_run or a.train_only):  # one seed trains; only the table pairs
        parser.error("paired differences need at least two seeds (the paper: 3 to 5)")
    arms = [(algo, s) for s in a.seeds for algo in a.algos]
    if a.control:
        arms.insert(0, (CONTROL, a.seeds[0]))
    configs = [run_config(a.scale, e, algo, s, a.out, a.model) for e in a.envs for algo, s in arms]
    if a.dry_run:
        for c in configs:  # the algorithm with its env preset, and the config's JSON round trip
            make_algorithm(c.algo, env=c.env, **dict(c.algorithm))
            assert TrainConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
        print(json.dumps([c.to_dict() for c in configs], indent=1))
        return {"configs": [c.to_dict() for c in configs]}
    started = time.perf_counter()
    for c in configs:
        run = train(c, resume=(Path(c.out) / "config.json").is_file())
        if run["interrupted"]:  # Ctrl-C / SIGTERM: the run checkpointed; running this again resumes it
            print(f"interrupted in {c.out} at update {run['updates']}; run the same command to resume")
            return {"interrupted": c.out}
    if a.train_only:
        return {"trained": [c.out for c in configs]}
    rows = table(a.out, a.envs, a.seeds, a.algos, a.control)
    result = {"scale": a.scale, "wall_s": round(time.perf_counter() - started, 1), "table": rows}
    (a.out / "table1.json").write_text(json.dumps(result, indent=2))
    text = markdown(rows)
    (a.out / "table1.md").write_text(text + "\n")
    print(text)
    print(f"wall time {result['wall_s']:.0f} s; reports: {a.out}/<env>/report-<algorithm>/report.md")
    return result


if __name__ == "__main__":
    main()
