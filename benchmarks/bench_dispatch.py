"""Thrown-away work of the dispatch rules: stale drops, idle rollout slots and trained trajectories/s of SPO++ in
the demo's configuration, ``dispatch="fill"`` (SPO++ as published) beside ``dispatch="trainable"``, each with
the learner alternating with generation (the HF backend's default) or overlapping it (``-overlap`` arms).

The demo's run (``cli/demo.py``: SPO++ on Math-TIR, ``tiny`` from an SFT start, B = 64, 32 slots, publication every
2 updates, ``max_staleness=1``), shortened: ``--updates`` updates, no held-out evaluation, offline values from the
cache (``STREAMRL_CACHE``), 1 torch thread. The arms run one after the other, ``--repeats`` times interleaved
(fill, trainable, ..., fill, trainable, ...), each from the same start and seed.

Each arm runs the real ``Trainer``, instrumented (a subclass in this file, nothing in the package) to record:

- every finished episode: its dispatch version and the version when it returned, turns, action tokens,
  seconds in flight, seconds between its dispatch and the next publication, and what became of it (trained,
  dropped as stale when it returned, drained from the buffer at a publication);
- the rollout slots' idle slot-seconds (``num_envs`` minus the running episodes, integrated over time), split by
  phase: ``rollout`` (the trainer is collecting a batch), ``learner`` (an update and its publication: the batch
  boundary), the rest (start-up, offline values);
- per update: episodes in flight when the learner starts.

Reported per arm over the updates after ``--warmup``: stale-drop fraction (dropped stale / finished, the demo's
metric), slot utilization (occupied / (num_envs x time): overall, and during rollout phases only), trained and
finished trajectories/s, the idle slot-seconds per phase, and the dropped against the trained episodes (turns,
tokens, seconds in flight, where their dispatch fell in the version).

Usage (the machine's load is written into the JSON: ratios side by side are what counts)::

    cp -r CACHE /tmp/hb_cache   # a cache holding the demo's start and its offline values
    STREAMRL_CACHE=/tmp/hb_cache OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/bench_dispatch.py \\
        --updates 16 --repeats 2 --arms fill trainable fill-overlap trainable-overlap --sft '{"epochs": 8, "select_best_of": 100, "restarts": 0, "restart_below": 0.0}'
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
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def instrumented_trainer(config: Any) -> Any:
    """A ``Trainer`` of ``config`` that records episodes, idle slot-seconds by phase and per-update state."""
    from streamrl.algorithms.base import Episode
    from streamrl.algorithms.train import Trainer

    class Recorded(Trainer):
        def _build(self) -> None:
            super()._build()
            self.phase = "other"
            self.idle: dict[str, float] = {"rollout": 0.0, "learner": 0.0, "other": 0.0}
            self.held: dict[str, float] = {"rollout": 0.0, "learner": 0.0, "other": 0.0}
            self.episodes: list[dict[str, Any]] = []
            self.updates_log: list[dict[str, Any]] = []
            self.publications: list[float] = []
            self.dispatch_times: dict[int, float] = {}
            rollouts = self.rollouts
            count = rollouts._count_slots
            num_envs = rollouts.venv.num_envs

            def count_slots() -> None:  # the occupancy interval that closes now, by the trainer's phase
                now = time.perf_counter()
                dt = now - rollouts._slots_since
                running = len(rollouts._running)
                self.idle[self.phase] += (num_envs - running) * dt
                self.held[self.phase] += running * dt
                count()

            rollouts._count_slots = count_slots  # type: ignore[method-assign]

        def _set_phase(self, phase: str) -> None:
            self.rollouts._count_slots()
            self.phase = phase

        def _dispatch(self) -> None:
            before = self.ledger.dispatched
            super()._dispatch()
            now = time.perf_counter()
            for job in self.rollouts.running[
                -(self.ledger.dispatched - before) or len(self.rollouts.running) :
            ]:
                self.dispatch_times.setdefault(job.ticket.dispatch_index, now)

        def _receive(self, episode: Episode) -> None:
            stale_before = self.ledger.dropped_stale
            super()._receive(episode)
            if episode.failed:
                fate = "failed"
            elif self.ledger.dropped_stale > stale_before:
                fate = "stale_on_return"
            else:
                fate = "buffered"
            self._record(episode, fate)

        def _record(self, episode: Episode, fate: str) -> None:
            t = episode.trajectory
            self.episodes.append(
                {
                    "index": episode.ticket.dispatch_index,
                    "dispatch_version": episode.ticket.version,
                    "return_version": self.tracker.version,
                    "turns": len(t.turns),
                    "action_tokens": t.num_action_tokens,
                    "episode_s": float(t.timings.get("episode_s", 0.0)),
                    "dispatched_at": self.dispatch_times.get(episode.ticket.dispatch_index, 0.0)
                    - self.started,
                    "returned_at": time.perf_counter() - self.started,
                    "update_at_return": self.updates,
                    "fate": fate,
                }
            )

        def _next_batch(self) -> list[Episode] | None:
            self._set_phase("rollout")
            batch = super()._next_batch()
            self._set_phase("learner")
            if batch is not None:
                trained = {e.ticket.dispatch_index for e in batch}
                for record in self.episodes:
                    if record["index"] in trained:
                        record["fate"] = "trained"
                self.updates_log.append(
                    {
                        "update": self.updates + 1,
                        "in_flight_at_learner": len(self.rollouts.running),
                        "learner_started": time.perf_counter() - self.started,
                    }
                )
            return batch

        def _publish(self) -> int:
            buffered = {e.ticket.dispatch_index for e in self.pending.episodes}
            version = super()._publish()
            self.publications.append(time.perf_counter() - self.started)
            kept = {e.ticket.dispatch_index for e in self.pending.episodes}
            for record in self.episodes:
                if record["index"] in buffered - kept:
                    record["fate"] = "drained"
            return version

        def _train_on(self, batch: list[Episode], pool: Any) -> dict[str, Any]:
            row = super()._train_on(batch, pool)
            self._set_phase("other")
            self.updates_log[-1].update(
                {
                    "learner_done": time.perf_counter() - self.started,
                    "ledger": {k: v for k, v in row.items() if k.startswith("ledger/")},
                    "occupied_slot_s": self.rollouts.occupied_slot_seconds(),
                    "idle": dict(self.idle),
                    "held": dict(self.held),
                }
            )
            return row

    return Recorded(config, progress=False, log=lambda message: None)


def summarize(trainer: Any, warmup: int, wall_s: float) -> dict[str, Any]:
    """The arm's numbers over the updates after ``warmup`` (module doc)."""
    log = trainer.updates_log
    start, end = log[warmup - 1] if warmup else None, log[-1]
    t0 = start["learner_done"] if start else 0.0
    window = end["learner_done"] - t0

    def delta(key: str, phase: str) -> float:
        return end[key][phase] - (start[key][phase] if start else 0.0)

    ledger_end, ledger_start = end["ledger"], (start["ledger"] if start else {})

    def ledger(name: str) -> int:
        return int(ledger_end[f"ledger/{name}"]) - int(ledger_start.get(f"ledger/{name}", 0))

    num_envs = trainer.config.num_envs
    idle = {phase: delta("idle", phase) for phase in ("rollout", "learner", "other")}
    held = {phase: delta("held", phase) for phase in ("rollout", "learner", "other")}
    occupied = sum(held.values())
    finished = ledger("finished")
    dropped = ledger("dropped_stale")
    records = [r for r in trainer.episodes if r["returned_at"] > t0]

    def describe(fates: Sequence[str]) -> dict[str, Any]:
        chosen = [r for r in records if r["fate"] in fates]
        if not chosen:
            return {"n": 0}
        to_publication = []
        for r in chosen:
            later = [p for p in trainer.publications if p >= r["dispatched_at"]]
            if later:
                to_publication.append(later[0] - r["dispatched_at"])
        return {
            "n": len(chosen),
            "turns": statistics.fmean(r["turns"] for r in chosen),
            "action_tokens": statistics.fmean(r["action_tokens"] for r in chosen),
            "episode_s": statistics.fmean(r["episode_s"] for r in chosen),
            "dispatch_to_next_publication_s": statistics.fmean(to_publication) if to_publication else None,
            "versions_behind_at_return": statistics.fmean(
                r["return_version"] - r["dispatch_version"] for r in chosen
            ),
        }

    learner_s = sum(u["learner_done"] - u["learner_started"] for u in log[warmup:])
    return {
        "updates_measured": len(log) - warmup,
        "window_s": window,
        "wall_s": wall_s,
        "finished": finished,
        "trained": ledger("trained"),
        "dropped_stale": dropped,
        "stale_drop_fraction": dropped / finished if finished else None,
        "slot_utilization": occupied / (num_envs * window),
        "slot_utilization_rollout_phase": held["rollout"] / (held["rollout"] + idle["rollout"]),
        "idle_slot_s": idle,
        "idle_slot_fraction_by_phase": {k: v / (num_envs * window) for k, v in idle.items()},
        "learner_s": learner_s,
        "learner_fraction": learner_s / window,
        "trained_per_s": ledger("trained") / window,
        "finished_per_s": finished / window,
        "generated_tokens_per_s": ledger("generated_tokens") / window,
        "trained_tokens_per_s": ledger("trained_tokens") / window,
        "in_flight_at_learner": [u["in_flight_at_learner"] for u in log[warmup:]],
        "trained_episodes": describe(["trained"]),
        "dropped_episodes": describe(["stale_on_return", "drained"]),
        "dropped_on_return": sum(r["fate"] == "stale_on_return" for r in records),
        "drained_from_buffer": sum(r["fate"] == "drained" for r in records),
        "per_update": [
            {
                "update": u["update"],
                "in_flight_at_learner": u["in_flight_at_learner"],
                "learner_s": round(u["learner_done"] - u["learner_started"], 2),
                "dropped_stale": u["ledger"]["ledger/dropped_stale"],
                "finished": u["ledger"]["ledger/finished"],
            }
            for u in log
        ],
    }


ARMS = ("fill", "trainable", "fill-overlap", "trainable-overlap")
"""``dispatch`` value, and ``-overlap``: generation goes on while the learner updates (``overlap=True``; the HF
backend and the learner then share the cores)."""


def run_arm(base: Any, arm: str, root: Path, repeat: int, warmup: int) -> dict[str, Any]:
    dispatch, _, overlap = arm.partition("-")
    config = replace(base, out=str(root / f"{arm}-{repeat}"), dispatch=dispatch, overlap=bool(overlap))
    started = time.perf_counter()
    trainer = instrumented_trainer(config)
    trainer.run()
    return summarize(trainer, warmup, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="updates left out of the measurement")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--arms", nargs="+", default=["fill", "trainable"], choices=ARMS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", type=json.loads, default=None, help="the cold start's SFT overrides (JSON)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "runtime" / "dispatch.json"
    )
    args = parser.parse_args()
    if args.updates <= args.warmup:
        parser.error(f"--updates ({args.updates}) must exceed --warmup ({args.warmup})")

    import torch

    torch.set_num_threads(1)
    from streamrl.cli.demo import DemoConfig

    demo = DemoConfig(updates=args.updates, threads=1, seed=args.seed, progress=False)
    base = replace(demo.train_config(), eval_every=0, eval_episodes=0, checkpoint_every=0)
    if args.sft is not None:
        base = replace(base, sft=dict(args.sft))
    arms: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_dispatch_") as tmp:
        for repeat in range(args.repeats):
            for arm in args.arms:
                result = run_arm(base, arm, Path(tmp), repeat, args.warmup)
                result["load_average_after"] = os.getloadavg()
                arms[arm].append(result)
                print(
                    f"{arm} #{repeat}: stale {result['stale_drop_fraction']:.3f}, slots "
                    f"{result['slot_utilization']:.3f} (rollout phase {result['slot_utilization_rollout_phase']:.3f})"
                    f", trained/s {result['trained_per_s']:.3f}, window {result['window_s']:.0f} s",
                    flush=True,
                )
                write_report(
                    args, base, load_before, arms
                )  # after every arm: a killed run keeps what it measured
    print(json.dumps(json.loads(args.out.read_text())["summary"], indent=2))
    print(f"-> {args.out}")


def write_report(
    args: argparse.Namespace, base: Any, load_before: Sequence[float], arms: dict[str, list[dict[str, Any]]]
) -> None:
    done = {arm: results for arm, results in arms.items() if results}

    def mean(arm: str, key: str) -> float:
        return statistics.fmean(r[key] for r in done[arm])

    keys = ("stale_drop_fraction", "slot_utilization", "slot_utilization_rollout_phase", "trained_per_s")
    summary: dict[str, Any] = {arm: {key: mean(arm, key) for key in keys} for arm in done}
    if "fill" in done:
        summary["trained_per_s_over_fill"] = {
            arm: summary[arm]["trained_per_s"] / summary["fill"]["trained_per_s"] for arm in done
        }
    report: dict[str, Any] = {
        "benchmark": "bench_dispatch",
        "command": " ".join(["python", *sys.argv]),
        "setup": {
            "config": {k: v for k, v in base.to_dict().items() if k != "out"},
            "updates": args.updates,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "streamrl_cache": os.environ.get("STREAMRL_CACHE"),
        },
        "machine": {
            "platform": f"{platform.machine()} {os.cpu_count()} cpus",
            "python": platform.python_version(),
            "load_average_before": list(load_before),
            "note": "shared machine, loaded by other jobs: compare the arms' ratios, not absolute rates",
        },
        "summary": summary,
        "arms": done,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
