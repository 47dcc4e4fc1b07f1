"""How many Math-TIR sub-envs one worker process hosts: the start-up a session pays, and its steady state, side by
side on the demo's held-out evaluation.

    python benchmarks/bench_env_hosting.py [--per-worker 1 4 8] [--repeats 3] [--episodes 405] [--num-envs 32]
                                           [--threads 1] [--out benchmarks/results/runtime/env_hosting.json]

Every Math-TIR worker process pays a start-up: an interpreter importing the package, then, at its first tool call
and its first symbolic answer check, a tool sandbox and a grading sandbox whose zygotes each import sympy and numpy
(``envs.sandbox``). A session of ``--num-envs`` sub-envs hosted ``P`` per worker starts ``num_envs / P`` of them.
The trainer starts two sessions (training and held-out evaluation), ``streamrl eval`` one per split.

For each ``P`` of ``--per-worker``, interleaved (1, 4, 8, 1, 4, 8, ...) ``--repeats`` times: a new
``RolloutSession`` of the test split hosted ``P`` per worker plays the demo's held-out evaluation twice (``tiny``
from the demo's cold start, ``--episodes`` episodes as the trainer draws them, temperature 1, the trainer's
evaluation seeds, lock-step) and is closed. The first play pays the start-up (what a run's first evaluation pays),
the second runs on the warm workers (every later evaluation). Per play: wall seconds, seconds to the first
finished episode, seconds in generation calls; per session: the CPU seconds of its worker processes and their
sandboxes (``RUSAGE_CHILDREN``, counted once the session is closed), and whether every play's records (per
episode: key, task, won, reward, steps, action tokens and a hash of its generated token ids) equal the first
play's. ``P = 1`` is the hosting before ``EnvSpec.envs_per_worker``. The load average is recorded: run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from bench_evaluation import ENV, GENERATION, demo_evaluation, session_evaluation, timed  # noqa: E402
from streamrl.algorithms.session import RolloutSession  # noqa: E402
from streamrl.envs.vector import VectorEnvConfig  # noqa: E402


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--per-worker", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3, help="sessions per hosting")
    parser.add_argument(
        "--episodes", type=int, default=405, help="episodes per evaluation (the demo's curve)"
    )
    parser.add_argument("--num-envs", type=int, default=32, help="sub-envs (the demo's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "runtime" / "env_hosting.json")
    args = parser.parse_args(argv)
    bad = [p for p in args.per_worker if p < 1]
    if bad or args.repeats < 1:
        parser.error(f"--per-worker values and --repeats must be >= 1, got {args.per_worker}, {args.repeats}")
    torch.set_num_threads(args.threads)
    backend, tokenizer, tasks, split = demo_evaluation(args.seed, args.episodes)
    sessions: dict[int, list[dict[str, Any]]] = {p: [] for p in args.per_worker}
    reference: list[dict[str, Any]] | None = None
    load_before = os.getloadavg()
    try:
        for _ in range(args.repeats):
            for per in args.per_worker:
                cpu_before = children_cpu_s()
                session = RolloutSession(
                    ENV, split, num_envs=args.num_envs, workers=VectorEnvConfig(envs_per_worker=per)
                )
                plays = []
                try:
                    for _play in ("first", "warm"):
                        timing, recs = timed(
                            lambda tick, s=session: session_evaluation(
                                s, backend, tokenizer, tasks, args.seed, tick
                            )
                        )
                        timing["generation_s"] = round(GENERATION.pop("session"), 2)
                        reference = reference or recs
                        timing["records_identical"] = recs == reference
                        plays.append(timing)
                    workers = len(session.venv.worker_pids())
                finally:
                    session.close()
                sessions[per].append(
                    {
                        "workers": workers,
                        "first": plays[0],
                        "warm": plays[1],
                        "worker_cpu_s": round(children_cpu_s() - cpu_before, 1),
                    }
                )
                print(per, sessions[per][-1], flush=True)
    finally:
        backend.close()

    def median(per: int, *path: str) -> float:
        values = []
        for s in sessions[per]:
            value: Any = s
            for key in path:
                value = value[key]
            values.append(value)
        return round(statistics.median(values), 2)

    summary = {
        str(per): {
            "workers": sessions[per][0]["workers"],
            "first_evaluation_s": median(per, "first", "seconds"),
            "first_result_s": median(per, "first", "first_result_s"),
            "warm_evaluation_s": median(per, "warm", "seconds"),
            "worker_cpu_s_per_session": median(per, "worker_cpu_s"),
            "records_identical": all(
                s[k]["records_identical"] for s in sessions[per] for k in ("first", "warm")
            ),
        }
        for per in args.per_worker
    }
    base = str(args.per_worker[0])
    for row in summary.values():
        row["first_evaluation_vs_" + base] = round(
            summary[base]["first_evaluation_s"] / row["first_evaluation_s"], 2
        )
    result = {
        "benchmark": "bench_env_hosting",
        "what": "Math-TIR sub-envs per worker process: a fresh session's first held-out evaluation (start-up "
        "included), a warm second one, and its workers' CPU seconds, interleaved; medians over repeats",
        "command": "python benchmarks/bench_env_hosting.py " + " ".join(argv or sys.argv[1:]),
        "model": "tiny, the demo's SFT cold start",
        "episodes": args.episodes,
        "num_envs": args.num_envs,
        "threads": args.threads,
        "summary": summary,
        "sessions": {str(p): v for p, v in sessions.items()},
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
