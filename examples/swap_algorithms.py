"""Swap the algorithm with one argument: SPO, SPO++, GRPO or SAO on the same env, model, runtime and learner.

Everything but ``--algo`` is the same config, so the runs differ only in what the algorithm module decides (its
tracker, how a batch forms, the advantages and the loss; SAO adds a critic). Each run evaluates the same
held-out episodes before and after training, and the example prints the paired difference::

    python examples/swap_algorithms.py --algo grpo            # a short real run from the SFT checkpoint
    python examples/swap_algorithms.py --algo sao --env alfworld
    python examples/swap_algorithms.py --algo spo --tiny      # seconds: the untrained model, 2 updates

The same from the command line is ``streamrl train --algo ALGO ...`` with the same flags.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from streamrl.algorithms.train import TrainConfig, train
from streamrl.evaluation.curves import read_metrics

SHORT: dict[str, Any] = {"updates": 20, "batch": 64, "num_envs": 32, "eval_every": 10, "eval_episodes": 200}
TINY: dict[str, Any] = {"updates": 2, "batch": 4, "num_envs": 4, "tasks": 8, "offline_rollouts": 1}
TINY |= {
    "max_new_tokens": 16,
    "eval_every": 1,
    "eval_episodes": 4,
    "init": "base",
    "env_workers": "inprocess",
}
TINY_ALGO: dict[
    str, dict[str, Any]
] = {  # what a smoke run needs for groups (GRPO) and a critic warm-up (SAO)
    "grpo": {"algorithm": {"group_size": 4}, "batch": 8, "num_envs": 8, "tasks": 2},
    "sao": {"algorithm": {"warmup_updates": 1}, "updates": 3},
}
TINY_ENV: dict[str, dict[str, Any]] = {"alfworld": {"env_kwargs": {"max_steps": 3}}}


def held_out(run_dir: Path) -> tuple[float, float, float, float]:
    """(success before, success after, paired difference, its 95 % half-width clustered by task) from the run's
    evaluations."""
    evals = [r for r in read_metrics(run_dir) if "eval/success" in r]
    last = evals[-1]
    return evals[0]["eval/success"], last["eval/success"], last["eval/delta"], last["eval/delta_ci95"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="spo++", choices=["spo", "spo++", "grpo", "sao"])
    parser.add_argument("--env", default="math_tir", choices=["math_tir", "alfworld"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="run directory (default: a new temporary one)")
    parser.add_argument(
        "--tiny", action="store_true", help="2 updates of 4 on the untrained model (a smoke run)"
    )
    a = parser.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix=f"{a.algo}-{a.env}-")
    size = {**TINY, **TINY_ALGO.get(a.algo, {}), **TINY_ENV.get(a.env, {})} if a.tiny else SHORT
    summary = train(TrainConfig(out=out, env=a.env, algo=a.algo, seed=a.seed, **size))
    before, after, delta, half = held_out(Path(out))
    print(
        f"{a.algo} on {a.env}: held-out success {before:.3f} -> {after:.3f} "
        f"(paired difference {delta:+.3f} +/- {half:.3f}, 95 % clustered by task); run in {out}"
    )
    return {**summary, "before": before, "after": after, "delta": delta, "delta_ci95": half}


if __name__ == "__main__":
    main()
