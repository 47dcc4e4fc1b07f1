"""Reproduce SPO++ Table 1: SPO++ against SPO, matched seeds, on ALFWorld and Math-TIR.

For each env and seed it trains SPO++ and SPO with one config that differs only in the algorithm (each run
resumes if its directory already holds it), then compares the matched runs as the paper does: the learning
curve's area (ALFWorld: the normalized trapezoidal AUC, Eq. 7; Math-TIR: the step mean) and its end (mean of the
last five points), each pair truncated to its common budget, reported as paired differences SPO++ − SPO
(mean ± sample s.d. over seeds). The curve is the held-out evaluation (fixed tasks and episode seeds), not the
training batches. ``streamrl compare`` writes each env's plots and report beside the table::

    python examples/reproduce_table1.py --scale cpu                 # tiny, both envs, seeds 0 1 2 (~2 h on 2 cores)
    python examples/reproduce_table1.py --scale paper --model /models/Qwen3.5-0.8B --dry-run
    python examples/reproduce_table1.py --scale tiny --envs math_tir  # a smoke run of the whole pipeline

``--scale paper`` is SPO++ Table 3 for a GPU box with the model on local disk (the configs ``--dry-run`` prints);
``--scale cpu`` is what 2 CPU cores afford on ``tiny`` from its SFT checkpoints (its table and how to read it:
docs/evaluation.md, "SPO++ Table 1 on CPU"); ``--envs`` splits it into one process per env. Ctrl-C stops the
script after the current run checkpoints; the same command resumes it.
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
from streamrl.evaluation.compare import CompareConfig, compare
from streamrl.evaluation.curves import HELD_OUT, compare_curves, load_curve

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

# What 2 CPU cores afford. Math-TIR: exactly the demo's run (``streamrl demo``: 60 updates of 64 from its 3-epoch
# SFT start, lr 1e-4, the held-out curve every test task of the SFT families once, every 10 updates), one torch
# thread, so two runs share the machine. ALFWorld: the first 32 training games, 25-step episodes, 2 offline
# rollouts per game, 3 updates of 16, the held-out curve 32 ``eval_seen`` episodes at updates 0 and 3 (a held-out
# ALFWorld episode costs about 10 s).
CPU: dict[str, dict[str, Any]] = {
    "alfworld": {
        "updates": 3, "batch": 16, "num_envs": 16, "tasks": 32, "offline_rollouts": 2, "eval_every": 3,
        "eval_episodes": 32, "env_kwargs": {"max_steps": 25}, "learner": LearnerConfig(lr=1e-4, mini_batches=4),
    },
}  # fmt: skip

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
        from streamrl.cli.demo import DemoConfig

        base = DemoConfig(out=Path(run), seed=seed, threads=1, progress=False).train_config()
        base = replace(base, algo=algo)
    else:
        base = TrainConfig(out=run, env=env, algo=algo, seed=seed, model=model)
        if scale == "paper":
            base = replace(base, **PAPER[env], **PAPER_EVAL, learner=PAPER_LEARNER)
        elif scale == "cpu":
            base = replace(base, **CPU[env])
        else:
            base = replace(base, **TINY, **TINY_ENV[env])
    return replace(base, learner=replace(base.learner, lr=0.0)) if lr0 else base


def table(out: Path, envs: list[str], seeds: list[int]) -> dict[str, Any]:
    """Table 1 from the runs under ``out``: per env, area and end of both algorithms and their paired difference."""
    rows: dict[str, Any] = {}
    for env in envs:
        curves = {a: [load_curve(out / env / f"{a}-seed{s}", HELD_OUT) for s in seeds] for a in ALGOS}
        cmp = compare_curves(curves["spo++"], curves["spo"])
        area = AREA[env]
        rows[env] = {
            "area_metric": area,
            "spo_area": cmp.b[area].to_dict(),
            "spo++_area": cmp.a[area].to_dict(),
            "delta_area": cmp.difference[area].to_dict(),
            "delta_end": cmp.difference["final"].to_dict(),
            "seeds": seeds,
        }
        runs = tuple(out / env / f"{a}-seed{s}" for a in ALGOS for s in seeds)
        compare(CompareConfig(runs=runs[: len(seeds)], vs=runs[len(seeds) :], out=out / env / "report"))
    return rows


def markdown(rows: dict[str, Any]) -> str:
    def pp(spread: dict[str, Any]) -> str:
        mean, sd = spread["mean"], spread["sd"]
        return "n/a" if mean is None else f"{100 * mean:+.2f}" + ("" if sd is None else f" ± {100 * sd:.2f}")

    lines = [
        "| env | area | SPO | SPO++ | Δ area (pp) | Δ end (pp) | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for env, r in rows.items():
        lines.append(
            f"| {env} | {r['area_metric']} | {r['spo_area']['mean']:.3f} | {r['spo++_area']['mean']:.3f} | "
            f"{pp(r['delta_area'])} | {pp(r['delta_end'])} | {len(r['seeds'])} |"
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
    if len(a.seeds) < 2 and not a.dry_run:
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
    rows = table(a.out, a.envs, a.seeds)
    result = {"scale": a.scale, "wall_s": round(time.perf_counter() - started, 1), "table": rows}
    (a.out / "table1.json").write_text(json.dumps(result, indent=2))
    text = markdown(rows)
    (a.out / "table1.md").write_text(text + "\n")
    print(text)
    print(f"wall time {result['wall_s']:.0f} s; reports: {a.out}/<env>/report/report.md")
    return result


if __name__ == "__main__":
    main()
