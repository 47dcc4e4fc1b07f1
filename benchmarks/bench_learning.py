"""Does RL learn on CPU? SPO++ runs beside learning-rate-0 controls, judged on a fixed held-out evaluation.

For each seed, two ``streamrl train`` runs with the same config: the learner at its learning rate, and a control
at learning rate 0 -- the same dispatching, sampling and evaluation, a policy that cannot change. The control
is the noise floor: the prioritized sampler makes the *batch* success of a frozen policy drift (it moves toward
tasks near v = 1/2), so learning is read from the held-out evaluation (the same tasks and episode seeds at every
version and in both runs), never from the training curve alone.

    python benchmarks/bench_learning.py --seeds 0 1 2 --updates 60 --jobs 2

writes ``benchmarks/results/learning/learning.json``: per run the held-out curve and batch-success curve; per seed the
held-out success before/after and the paired difference to its control.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "learning"


def _command(args: argparse.Namespace, seed: int, lr: float, out: Path) -> list[str]:
    return [
        sys.executable, "-c", "from streamrl.cli.main import main; raise SystemExit(main())", "train",
        "--out", str(out), "--env", args.env, "--algo", args.algo, "--updates", str(args.updates),
        "--batch", str(args.batch), "--num-envs", str(args.num_envs), "--seed", str(seed), "--lr", str(lr),
        "--eval-every", str(args.eval_every), "--eval-episodes", str(args.eval_episodes),
        "--mini-batches", str(args.mini_batches), "--checkpoint-every", "0", "--no-progress",
        *args.extra,
    ]  # fmt: skip


def _read(out: Path) -> dict[str, object]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["update"], r["eval/success"]) for r in rows if "eval/success" in r]
    batches = [(r["update"], r["batch/success"]) for r in rows if "batch/success" in r]
    last = rows[-1]
    return {
        "eval": evals,
        "batch_success": batches,
        "before": evals[0][1],
        "after": evals[-1][1],
        "after_mean_last2": sum(e for _, e in evals[-2:]) / len(evals[-2:]),
        # the last evaluation's paired difference to the first (same episodes), its 95 % half-width clustered by task
        "paired_delta": next((r.get("eval/delta") for r in reversed(rows) if "eval/delta" in r), None),
        "paired_ci95": next((r.get("eval/delta_ci95") for r in reversed(rows) if "eval/delta" in r), None),
        "elapsed_s": last.get("time/elapsed_s"),
        "seconds_per_update": (last.get("time/elapsed_s") or 0) / max(1, last.get("update", 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="math_tir")
    parser.add_argument("--algo", default="spo++")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one torch thread each)")
    parser.add_argument(
        "--no-controls",
        action="store_true",
        help="skip the lr-0 runs (a frozen policy's held-out success is the update-0 evaluation: same seeds)",
    )
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bench_learning"))
    parser.add_argument("--output", type=Path, default=RESULTS / "learning.json")
    parser.add_argument("extra", nargs="*", help="more streamrl train flags (after --)")
    args = parser.parse_args()

    stamp = time.strftime("%Y%m%d-%H%M%S")
    plan = [(seed, lr) for seed in args.seeds for lr in ((args.lr,) if args.no_controls else (args.lr, 0.0))]
    outs = {key: args.runs_dir / f"{stamp}-{args.algo}-{args.env}-seed{key[0]}-lr{key[1]:g}" for key in plan}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    running: list[tuple[tuple[int, float], subprocess.Popen[bytes]]] = []
    queue = list(plan)
    while queue or running:
        while queue and len(running) < args.jobs:
            key = queue.pop(0)
            outs[key].parent.mkdir(parents=True, exist_ok=True)
            log = (outs[key].parent / f"{outs[key].name}.log").open("wb")
            print(f"start seed {key[0]} lr {key[1]:g} -> {outs[key]}", flush=True)
            running.append(
                (key, subprocess.Popen(_command(args, *key, outs[key]), stdout=log, stderr=log, env=env))
            )
        time.sleep(2)
        for item in list(running):
            if item[1].poll() is not None:
                running.remove(item)
                if item[1].returncode != 0:
                    raise SystemExit(f"run {item[0]} failed (exit {item[1].returncode}); see its .log")
                print(f"done seed {item[0][0]} lr {item[0][1]:g}", flush=True)

    runs = {f"seed{seed}-lr{lr:g}": _read(outs[(seed, lr)]) for seed, lr in plan}
    seeds = {}
    for seed in args.seeds:
        learn = runs[f"seed{seed}-lr{args.lr:g}"]
        control = runs.get(f"seed{seed}-lr0", {"before": learn["before"], "after": learn["before"]})
        seeds[str(seed)] = {
            "before": learn["before"],
            "after": learn["after"],
            "control_after": control["after"],
            "gain": learn["after"] - learn["before"],  # type: ignore[operator]
            "control_gain": control["after"] - control["before"],  # type: ignore[operator]
            "paired_vs_control": learn["after"] - control["after"],  # type: ignore[operator]
        }
    result = {
        "command": " ".join(["python", "benchmarks/bench_learning.py", *sys.argv[1:]]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": time.perf_counter() - started,
        "seeds": seeds,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps(seeds, indent=2))


if __name__ == "__main__":
    main()
