"""Throughput of the single-stream runtime (SPO++) against synchronous groups (GRPO, G = 8) on the same
long-tailed episode lengths, with the real trainer (``streamrl.algorithms.train.Trainer``) in every arm.

Setups (every arm of a setup holds fixed: rollout slots ``num_envs``, latencies, turn distribution, model,
learner, and the number of trained trajectories measured):

* ``latency`` -- the scheduler alone: ``streamrl/Latency-v0`` (episode turn counts drawn from ALFWorld's
  measured distribution, ``streamrl.envs.latency.ALFWORLD_TURNS``; each env step sleeps) and
  ``LatencyBackend`` (a generation call sleeps ``tokens x token latency``, whatever its number of rows, as a
  batched engine does). Only the learner computes (``tiny``, CPU), in a thread while generation goes on
  (``overlap``) in the asynchronous arms; in the synchronous arm it runs between rollouts.
* ``alfworld`` -- ``tiny`` on ALFWorld with the in-process HF backend (real engine, real env): from its
  ALFWorld SFT checkpoint when that is already cached, else from the base model (whose episodes all run to
  ALFWorld's 50-step limit, so there is no straggler to wait for: the bound is 1).

Arms:

* ``grpo-sync``: GRPO, G = 8, ``max_staleness=0`` (the synchronous trainer: each update dispatches B
  episodes and waits for the slowest), B = 8;
* ``spo++``: SPO++ as published -- batches of the first completed episodes *within the current version*;
  old-version episodes still in flight at a publication are drained (filed in the tracker, not trained);
* ``spo++-any``: SPO++ with ``batch_rule="any"``: first completed within the staleness bound, nothing drained
  (the runtime's own throughput; SPO's batch rule);
* ``spo++-b32``: SPO++ as published with B = 32 on the same 8 slots: the drained share falls as B / num_envs
  grows (each publication drains about one episode per slot);
* ``spo++-any-nowindow``: ``spo++-any`` without ``Rollouts``' batch window (an ablation; not run by default).

The asynchronous arms use ``max_staleness=2`` and, on the latency setup, ``overlap=True``; on ALFWorld the
HF backend alternates with the learner (its default) unless the arm's name ends in ``-overlap``.

Reported per arm over the updates after ``--warmup``: trained and generated trajectories/s, the rollout
slots' utilization (time-averaged fraction of the slots holding a running episode, ``Rollouts``' slot
counter), the learner's busy fraction, the simulated engine's busy fraction (latency setup), p50/p95/max
episode latency and turns of the trained episodes, the staleness histogram, the ledger; and the speed-up
over ``grpo-sync`` next to the straggler bound E[max of G lengths] / E[length] of the same distribution (Monte
Carlo). Two speed-ups: end to end (trained trajectories/s), and of the rollouts alone (the learner's time
removed from the synchronous arm, where it is serial: the scheduler's gain, which is what the straggler
bound bounds).

Usage::

    python benchmarks/bench_runtime.py                    # both setups -> benchmarks/results/runtime/runtime.json
    python benchmarks/bench_runtime.py --setups latency --trajectories 32 --warmup 8 --arms grpo-sync spo++-any
    python benchmarks/bench_runtime.py --measure-turns    # re-measure ALFWorld's turn distribution (~6 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import streamrl.envs  # noqa: F401 - registers the env ids
from streamrl.agents.env_specs import register_env_spec
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
from streamrl.agents.latency import LatencyBackend, LatencyBackendConfig, latency_env_spec
from streamrl.algorithms.base import Episode
from streamrl.algorithms.train import TrainConfig, Trainer
from streamrl.envs.latency import ALFWORLD_TURNS, turn_distribution

GROUP = 8


@dataclass(frozen=True)
class Arm:
    name: str
    algo: str
    max_staleness: int
    batch: int
    overlap: bool
    algorithm: Mapping[str, Any] = field(default_factory=dict)
    batch_window: bool = True


ARMS = {
    "grpo-sync": Arm("grpo-sync", "grpo", 0, GROUP, False, {"group_size": GROUP}),
    "spo++": Arm("spo++", "spo++", 2, GROUP, True),
    "spo++-any": Arm("spo++-any", "spo++", 2, GROUP, True, {"batch_rule": "any"}),
    "spo++-b32": Arm("spo++-b32", "spo++", 2, 4 * GROUP, True),
    "spo++-any-nowindow": Arm("spo++-any-nowindow", "spo++", 2, GROUP, True, {"batch_rule": "any"}, False),
}


# --------------------------------------------------------------------------------------------------------
# The straggler bound
# --------------------------------------------------------------------------------------------------------


def straggler_bound(
    turns: Mapping[int, float] | Sequence[int], group: int = GROUP, draws: int = 200_000, seed: int = 0
) -> dict[str, float]:
    """E[max of ``group`` i.i.d. lengths] / E[length], by Monte Carlo (its standard error alongside)."""
    values, probs = turn_distribution(turns)
    rng = np.random.default_rng(seed)
    maxima = rng.choice(values, p=probs, size=(draws, group)).max(axis=1).astype(float)
    mean = float((values * probs).sum())
    return {
        "mean_turns": mean,
        "mean_max_turns": float(maxima.mean()),
        "bound": float(maxima.mean()) / mean,
        "bound_stderr": float(maxima.std() / np.sqrt(draws)) / mean,
    }


# --------------------------------------------------------------------------------------------------------
# One arm
# --------------------------------------------------------------------------------------------------------


def _percentiles(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    arr = np.asarray(xs, dtype=float)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "max": float(arr.max()),
    }


def run_arm(
    arm: Arm,
    *,
    env: str,
    init: str,
    num_envs: int,
    updates: int,
    warmup: int,
    seed: int,
    backend: Any = None,
    out: Path,
) -> dict[str, Any]:
    """Train ``updates`` updates with the arm's algorithm; return the measured window's numbers."""
    per_update: list[list[dict[str, float]]] = []
    marks: dict[str, float] = {}

    def on_update(version: int, batch: Sequence[Episode]) -> None:
        if len(per_update) == warmup and backend is not None:
            marks["t"], marks["engine_busy"] = time.perf_counter(), backend.busy_seconds
        per_update.append(
            [
                {
                    "turns": len(e.trajectory.turns),
                    "episode_s": float(e.trajectory.timings.get("episode_s", 0.0)),
                    "lag": version - e.min_version,
                }
                for e in batch
            ]
        )

    config = TrainConfig(
        out=str(out),
        env=env,  # type: ignore[arg-type]  # a registered spec name
        algo=arm.algo,
        init=init,  # type: ignore[arg-type]
        updates=updates,
        batch=arm.batch,
        num_envs=num_envs,
        max_staleness=arm.max_staleness,
        offline_rollouts=0,
        eval_every=0,
        eval_episodes=0,
        checkpoint_every=0,
        keep_versions=arm.max_staleness + 1,
        overlap=arm.overlap,
        algorithm=dict(arm.algorithm),
        seed=seed,
    )
    started = time.perf_counter()
    trainer = Trainer(config, backend=backend, on_update=on_update, progress=False, log=lambda s: None)
    trainer.rollouts.batch_window = arm.batch_window
    build_s = time.perf_counter() - started
    trainer.run()
    ended = time.perf_counter()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[warmup - 1] if warmup else None, rows[-1]

    def delta(key: str) -> float:
        return float(last[key]) - (float(first[key]) if first is not None else 0.0)

    seconds = delta("time/elapsed_s")
    trained = delta("ledger/trained")
    learner = delta("time/learner_busy_s")
    rollout_seconds = seconds if arm.overlap else seconds - learner
    episodes = [e for update in per_update[warmup:] for e in update]
    staleness: Counter[str] = Counter()
    for row in rows[warmup:]:
        staleness.update({k: int(v) for k, v in row["staleness"].items()})
    result: dict[str, Any] = {
        "arm": arm.name,
        "algo": arm.algo,
        "algorithm_options": dict(arm.algorithm),
        "max_staleness": arm.max_staleness,
        "batch": arm.batch,
        "overlap": arm.overlap,
        "batch_window": arm.batch_window,
        "updates": updates,
        "warmup_updates": warmup,
        "measured": {
            "seconds": seconds,
            "trained": trained,
            "generated": delta("ledger/finished"),
            "dropped_stale": delta("ledger/dropped_stale"),
            "dropped_group": delta("ledger/dropped_group"),
            "failed": delta("ledger/failed"),
        },
        "trajectories_per_s": trained / seconds,
        "generated_per_s": delta("ledger/finished") / seconds,
        "action_tokens_per_s": delta("ledger/trained_tokens") / seconds,
        "slot_utilization": delta("time/rollout_slot_s") / (num_envs * seconds),
        "learner_busy_fraction": learner / seconds,
        "rollout_seconds": rollout_seconds,
        "trajectories_per_rollout_s": trained / rollout_seconds,
        "episode_latency_s": _percentiles([e["episode_s"] for e in episodes]),
        "episode_turns": {
            **_percentiles([e["turns"] for e in episodes]),
            "mean": statistics.fmean(e["turns"] for e in episodes),
        },
        "trained_turns": [int(e["turns"]) for e in episodes],
        "staleness": dict(sorted(staleness.items())),
        "build_s": build_s,
        "wall_s": ended - started,
    }
    if backend is not None and marks:
        result["engine_busy_fraction"] = (backend.busy_seconds - marks["engine_busy"]) / (ended - marks["t"])
        result["engine_rows_per_call"] = backend.rows / max(1, backend.calls)
    print(
        f"  {arm.name:10s} {result['trajectories_per_s']:.3f} traj/s, {result['trajectories_per_rollout_s']:.3f} per "
        f"rollout-s, utilization {result['slot_utilization']:.3f}, learner {result['learner_busy_fraction']:.2f}, "
        f"dropped {result['measured']['dropped_stale']:.0f}, staleness {result['staleness']}",
        flush=True,
    )
    return result


def compare(arms: list[dict[str, Any]], bound: float) -> None:
    """Add each arm's speed-ups over ``grpo-sync`` (when it ran) and their ratio to the straggler bound."""
    sync = next((a for a in arms if a["arm"] == "grpo-sync"), None)
    if sync is None:
        return
    for a in arms:
        a["speedup"] = a["trajectories_per_s"] / sync["trajectories_per_s"]
        a["speedup_rollout"] = a["trajectories_per_rollout_s"] / sync["trajectories_per_rollout_s"]
        a["speedup_over_bound"] = a["speedup"] / bound
        a["speedup_rollout_over_bound"] = a["speedup_rollout"] / bound


# --------------------------------------------------------------------------------------------------------
# Setups
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencySetup:
    """0.4 s a generation call (4 tokens at 0.1 s: the time a ~1B model on a GPU engine takes for an ALFWorld
    turn, with few tokens so the CPU learner stays cheap) and 20 ms an env step or reset."""

    token_latency_s: float = 0.1
    tokens_per_turn: int = 4
    step_latency_s: float = 0.02
    reset_latency_s: float = 0.02
    num_envs: int = GROUP


def run_latency(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    setup = LatencySetup()
    register_env_spec(
        "latency-bench",
        latency_env_spec(step_latency_s=setup.step_latency_s, reset_latency_s=setup.reset_latency_s),
        replace=True,
    )
    bound = straggler_bound(ALFWORLD_TURNS)
    print(f"latency setup: straggler bound E[max of {GROUP}]/E[len] = {bound['bound']:.3f}", flush=True)
    seeds: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        arms = []
        for name in args.arms:
            arm = ARMS[name]
            warmup = -(-args.warmup // arm.batch)
            backend = LatencyBackend(
                LatencyBackendConfig(
                    token_latency_s=setup.token_latency_s, tokens_per_turn=setup.tokens_per_turn
                ),
                scorer=HFBackend("tiny", config=HFBackendConfig(device="cpu", seed=seed)),
            )
            arms.append(
                run_arm(
                    arm,
                    env="latency-bench",
                    init="base",
                    num_envs=setup.num_envs,
                    updates=warmup + args.trajectories // arm.batch,
                    warmup=warmup,
                    seed=seed,
                    backend=backend,
                    out=root / f"latency-{name}-{seed}",
                )
            )
        compare(arms, bound["bound"])
        seeds.append({"seed": seed, "arms": arms})
    return {
        "setup": {
            **setup.__dict__,
            "turns": "ALFWORLD_TURNS",
            "model": "tiny (learner only)",
            "init": "base",
        },
        "straggler_bound": bound,
        "seeds": seeds,
        "summary": _summary(seeds),
    }


def _alfworld_init() -> str:
    """``sft`` when tiny's ALFWorld SFT checkpoint is already cached (building it is not this benchmark's
    business), else ``base``."""
    from streamrl.agents.models import cache_root, resolve_model
    from streamrl.sft import SFTConfig

    target = cache_root() / "sft" / f"{resolve_model('tiny').name}-sft-{SFTConfig.for_env('alfworld').key()}"
    return "sft" if target.is_dir() else "base"


def run_alfworld(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    init = _alfworld_init()
    print(f"alfworld setup: tiny from {init}", flush=True)
    arms = []
    for name in args.alfworld_arms:
        arm = ARMS[name.removesuffix("-overlap")]
        if name.endswith("-overlap"):
            arm = Arm(name, arm.algo, arm.max_staleness, arm.batch, True, arm.algorithm)
        elif arm.overlap:  # the in-process HF backend alternates with the learner by default (one process)
            arm = Arm(name, arm.algo, arm.max_staleness, arm.batch, False, arm.algorithm)
        arms.append(
            run_arm(
                arm,
                env="alfworld",
                init=init,
                num_envs=GROUP,
                updates=args.alfworld_updates,
                warmup=args.alfworld_warmup,
                seed=0,
                out=root / f"alfworld-{name}",
            )
        )
    # The same distribution: the turn counts the synchronous arm trained (all of its episodes, unselected).
    sync = next(a for a in arms if a["arm"] == "grpo-sync")
    bound = straggler_bound(sync["trained_turns"])
    compare(arms, bound["bound"])
    return {
        "setup": {"env": "alfworld", "model": "tiny", "init": init, "backend": "hf", "num_envs": GROUP},
        "straggler_bound": {**bound, "from": "turn counts of grpo-sync's trained episodes"},
        "arms": arms,
    }


def _summary(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    if "speedup" not in seeds[0]["arms"][0]:
        return {}
    keys = (
        "trajectories_per_s",
        "slot_utilization",
        "speedup",
        "speedup_rollout",
        "speedup_over_bound",
        "speedup_rollout_over_bound",
    )
    names = [a["arm"] for a in seeds[0]["arms"]]
    out: dict[str, Any] = {}
    for name in names:
        per = [next(a for a in s["arms"] if a["arm"] == name) for s in seeds]
        out[name] = {k: statistics.fmean(a[k] for a in per) for k in keys}
        out[name]["targets_met"] = {
            "speedup_rollout >= 0.9 bound": out[name]["speedup_rollout_over_bound"] >= 0.9,
            "utilization >= 0.95": out[name]["slot_utilization"] >= 0.95,
        }
    return out


# --------------------------------------------------------------------------------------------------------
# ALFWorld's turn distribution
# --------------------------------------------------------------------------------------------------------


def measure_turns(seeds: int = 4) -> dict[int, int]:
    """Episode lengths of ``ALFWorldSearchAgent(search="random")`` on the 128 generated training games, agent
    seeds ``0 .. seeds-1``, ALFWorld's 50-step limit: the histogram ``ALFWORLD_TURNS`` holds."""
    import gymnasium as gym
    from streamrl.agents.alfworld_agents import ALFWorldSearchAgent
    from streamrl.agents.rollout import play_episode

    env = gym.make("streamrl/ALFWorld-v0", split="train", max_steps=50)
    counts: Counter[int] = Counter()
    try:
        for seed in range(seeds):
            agent = ALFWorldSearchAgent(search="random", seed=seed)
            for task in env.unwrapped.task_ids:
                counts[len(play_episode(env, agent, seed=seed, options={"task_id": task}).turns)] += 1
    finally:
        env.close()
    return dict(sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setups", nargs="+", default=["latency", "alfworld"], choices=["latency", "alfworld"]
    )
    parser.add_argument(
        "--arms", nargs="+", default=[a for a in ARMS if a != "spo++-any-nowindow"], choices=list(ARMS)
    )
    parser.add_argument("--trajectories", type=int, default=96, help="trained trajectories measured per arm")
    parser.add_argument("--warmup", type=int, default=16, help="trained trajectories before the measurement")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument(
        "--alfworld-arms",
        nargs="+",
        default=["grpo-sync", "spo++", "spo++-any-overlap"],
        choices=[*ARMS, "spo++-overlap", "spo++-any-overlap"],
    )
    parser.add_argument("--alfworld-updates", type=int, default=3)
    parser.add_argument("--alfworld-warmup", type=int, default=1)
    parser.add_argument(
        "--measure-turns", action="store_true", help="only re-measure ALFWORLD_TURNS and print it"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "runtime" / "runtime.json"
    )
    args = parser.parse_args()
    if args.measure_turns:
        measured = measure_turns()
        print(json.dumps({"turns": measured, "same_as_ALFWORLD_TURNS": measured == dict(ALFWORLD_TURNS)}))
        return
    if any(args.trajectories % ARMS[a].batch for a in args.arms) or args.warmup < 0:
        parser.error(f"--trajectories must be a multiple of every arm's batch, got {args.trajectories}")
    if not 0 <= args.alfworld_warmup < args.alfworld_updates:
        parser.error("--alfworld-warmup must be fewer than --alfworld-updates")
    report: dict[str, Any] = {
        "benchmark": "async single-stream runtime (SPO++) vs synchronous groups (GRPO, G = 8)",
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "platform": f"{platform.machine()} {os.cpu_count()} cpus",
            "python": platform.python_version(),
            "loadavg_start": list(os.getloadavg()),
        },
        "targets": "latency setup: speed-up >= 0.9 of the straggler bound, slot utilization >= 0.95",
    }
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp:
        root = Path(tmp)
        if "latency" in args.setups:
            report["latency"] = run_latency(args, root)
        if "alfworld" in args.setups:
            report["alfworld"] = run_alfworld(args, root)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
