"""Latency and throughput of the Python tool sandbox: the warm zygote pool against a fresh ``python -c``
subprocess per call, on the same snippets.

    python benchmarks/bench_sandbox.py [--calls 60] [--out benchmarks/results/sandbox.json]

Targets (issue 2): the pool >= 5x the calls per second of a fresh subprocess, p99 < 50 ms. The snippets are
what a Math-TIR model writes: plain arithmetic, a loop, fractions, and numpy / sympy (where a fresh
interpreter pays the import on every call and the zygote has it preloaded). The pool gives the code the
full isolation (namespaces, uid drop, rlimits); the baseline runs it with none, so the comparison favours
the baseline. The machine's load average is recorded because the box is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from streamrl.envs.sandbox import SandboxConfig, SandboxPool

SNIPPETS = {
    "arithmetic": "print(12 * 7 + 3 ** 5 - 100 // 7)",
    "loop": "total = 0\nfor i in range(1, 10001):\n    total += i * i\nprint(total)",
    "fractions": "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 30)))",
    "numpy": "import numpy as np\nprint(float(np.linalg.det(np.array([[2.0, 1.0], [1.0, 3.0]]))))",
    "sympy": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x))",
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(latencies: list[float]) -> dict[str, float]:
    total = sum(latencies)
    return {
        "calls": len(latencies),
        "calls_per_s": len(latencies) / total,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 99),
        "mean_ms": 1000 * total / len(latencies),
    }


def fresh_subprocess(code: str) -> str:
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout


def time_calls(call, code: str, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call(code)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=60, help="pool calls per snippet (subprocess: a third)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sandbox.json")
    args = parser.parse_args()

    config = SandboxConfig(pool_size=2)
    pool = SandboxPool(config)
    start = time.perf_counter()
    pool.run("pass")
    startup_s = time.perf_counter() - start
    isolation = pool.isolation
    for code in SNIPPETS.values():  # same answers both ways
        assert pool.run(code).output == fresh_subprocess(code), code

    load_before = os.getloadavg()[0]
    per_snippet: dict[str, dict[str, dict[str, float]]] = {}
    all_pool: list[float] = []
    all_fresh: list[float] = []
    for name, code in SNIPPETS.items():
        pool.run(code)  # warm
        pool_lat = time_calls(lambda c: pool.run(c), code, args.calls)
        fresh_lat = time_calls(fresh_subprocess, code, max(5, args.calls // 3))
        all_pool += pool_lat
        all_fresh += fresh_lat
        per_snippet[name] = {"pool": summarize(pool_lat), "fresh_subprocess": summarize(fresh_lat)}
        print(
            f"{name:11s} pool p50 {per_snippet[name]['pool']['p50_ms']:7.1f} ms  p99 "
            f"{per_snippet[name]['pool']['p99_ms']:7.1f} ms | fresh p50 "
            f"{per_snippet[name]['fresh_subprocess']['p50_ms']:7.1f} ms"
        )

    # Throughput with as many client threads as zygotes.
    codes = [code for code in SNIPPETS.values() for _ in range(args.calls // 2)]
    start = time.perf_counter()
    with ThreadPoolExecutor(config.pool_size) as ex:
        list(ex.map(pool.run, codes))
    threaded_calls_per_s = len(codes) / (time.perf_counter() - start)
    pool.close()

    # Mixed workload: every snippet equally often, calls/s from the mean latency over all of them.
    pool_mean = statistics.fmean(statistics.fmean(v) for v in _by_snippet(all_pool, args.calls))
    fresh_mean = statistics.fmean(
        statistics.fmean(v) for v in _by_snippet(all_fresh, max(5, args.calls // 3))
    )
    # sympy is the last snippet; sympy.solve itself takes tens of ms of CPU, the others measure the overhead
    p99_no_sympy = 1000 * percentile(all_pool[: -args.calls], 99)
    overall = {
        "pool": {
            "calls_per_s": 1 / pool_mean,
            "p50_ms": 1000 * statistics.median(all_pool),
            "p99_ms": 1000 * percentile(all_pool, 99),
            "p99_ms_without_sympy": p99_no_sympy,
            "threaded_calls_per_s": threaded_calls_per_s,
            "startup_s": startup_s,
        },
        "fresh_subprocess": {
            "calls_per_s": 1 / fresh_mean,
            "p50_ms": 1000 * statistics.median(all_fresh),
            "p99_ms": 1000 * percentile(all_fresh, 99),
        },
        "speedup_calls_per_s": fresh_mean / pool_mean,
    }
    speedup, pool_p99 = fresh_mean / pool_mean, 1000 * percentile(all_pool, 99)
    result = {
        "benchmark": "sandbox",
        "command": "python benchmarks/bench_sandbox.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1min_before": load_before,
            "load_avg_1min_after": os.getloadavg()[0],
        },
        "config": {"pool_size": config.pool_size, "calls_per_snippet": args.calls},
        "isolation": isolation,
        "snippets": per_snippet,
        "overall": overall,
        "targets": {
            "speedup_at_least_5x": speedup >= 5,
            "pool_p99_below_50ms": pool_p99 < 50,
            "pool_p99_without_sympy_below_50ms": p99_no_sympy < 50,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(overall, indent=2))
    print(f"wrote {args.out}")


def _by_snippet(latencies: list[float], per: int) -> list[list[float]]:
    return [latencies[i : i + per] for i in range(0, len(latencies), per)]


if __name__ == "__main__":
    main()
