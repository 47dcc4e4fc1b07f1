"""Env steps/s of ALFWorld on Ray env actors against env worker processes, on one machine.

For each N in ``--sizes`` (default 1, 2, 4, 8) this drives N ALFWorld sub-envs, one per worker, first-ready
(``benchmarks/bench_vector.py``'s streaming driver: a uniformly random admissible command, a new episode as
soon as one ends) for ``--seconds`` of wall time after every sub-env has finished one episode, through

* ``process``: ``VectorEnvConfig(backend="subprocess")``, one worker process per sub-env (the default);
* ``ray``: ``VectorEnvConfig(backend="ray")``, one Ray actor per sub-env (one logical CPU each) on a local Ray
  instance started with ``max(sizes)`` logical CPUs, so that every actor is placed whatever the core count;

and reports the median env steps/s of ``--repeats`` runs, with the load average before and after each run
(the machine may be shared). The Ray instance's own processes (GCS, raylet) run during both measurements.
What it tells: how much a Ray actor's call path (a task submission and an object-store round trip per
step, against one pipe round trip) costs next to an ALFWorld step, and so how many env actors a node needs
for a given env-step rate (``docs/scaling.md``).

Usage::

    python benchmarks/bench_ray_envs.py                             # writes benchmarks/results/runtime/ray_envs.json
    python benchmarks/bench_ray_envs.py --sizes 1 --seconds 3 --repeats 1 --out /tmp/ray_envs.json  # smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
from bench_vector import SETUPS, measure, run_streaming
from streamrl.utils.ray import local_ray_options

BACKENDS = {"process": "subprocess", "ray": "ray"}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", choices=sorted(SETUPS), default="alfworld")
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=20.0, help="wall time per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per point (median reported)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "runtime" / "ray_envs.json"
    )
    args = parser.parse_args()
    if min(args.sizes) < 1:
        parser.error(f"--sizes must be >= 1, got {args.sizes}")

    started = time.perf_counter()
    ray.init(num_cpus=max(args.sizes), include_dashboard=False, logging_level="ERROR", **local_ray_options())
    ray_start_s = time.perf_counter() - started
    factory, make_policy = SETUPS[args.env]()
    print(f"{args.env}: {factory.name}; local Ray instance up in {ray_start_s:.1f} s")
    m = functools.partial(measure, factory=factory, make_policy=make_policy, repeats=args.repeats)
    throughput: dict[str, dict[str, Any]] = {}
    try:
        for n in args.sizes:
            point = {
                name: m(f"{name} ({n})", run_streaming, n, args.seconds, backend)
                for name, backend in BACKENDS.items()
            }
            point["ray_over_process"] = point["ray"]["steps_per_s"] / point["process"]["steps_per_s"]
            throughput[str(n)] = point
    finally:
        ray.shutdown()

    report = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "ray": ray.__version__},
        "settings": {"env": args.env, "seconds": args.seconds, "repeats": args.repeats, "sizes": args.sizes},
        "env_id": factory.name,
        "ray_start_s": ray_start_s,
        "throughput": throughput,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
