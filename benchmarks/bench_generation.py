"""Generation throughput of the HF backend: today's decode path against the previous one, side by side.

The previous path is ``agents/hf_backend.py`` as of ``--baseline-rev`` (the commit before the static-cache
decoder), loaded from git into this process, so both run on the same model files, thread and machine state.
Setting (the issue's): 1 torch thread, fp32 on CPU, batch 32, prompts of 190-210 tokens (distinct rows,
left/right padding exercised), 64 new tokens per row (no EOS stop, like vLLM's ``ignore_eos``), sampling at
temperature 1. Each repeat times both paths back to back, alternating which goes first; the reported ratio is
the median of the per-repeat ratios.

Also measured, in the same run:

- **prefill vs decode**: each path's time at ``max_new_tokens=1`` (prompt + one sampling step); the decode
  tok/s is ``rows x (new - 1) / (t(new) - t(1))``;
- **arithmetic floor**: a dense fp32 matmul's GFLOP/s on the same thread (1024 x 1024, best of 20, measured
  before and after); the floor of generation is ``2 x parameters`` FLOP per new token (the issue's measure,
  attention and the prompt aside); ``floor_fraction`` = tok/s over ``GFLOP/s / (2 x parameters)``, end to end
  and for the decode phase alone; ``model_flop_fraction`` also counts the prompt's ``2 x (parameters -
  embedding)`` FLOP per token;
- **greedy identity**: both paths' greedy ids on the benchmark batch, with and without EOS stops;
- **log-probs**: the new path's sampled log-probs against the teacher-forced ``score`` (the learner's
  ``token_logprobs`` computation), max abs difference.

- **episodes of several turns** (``--turns``, default 4): each row's next prompt is its prompt, the tokens it
  generated and a 40-token observation, as ``LLMAgent`` builds a ``"full"``-context episode; the time of all
  turns' calls for the previous path, the static decoder with every prompt run whole (``prefix_cache_bytes=0``)
  and the static decoder reusing each row's kept history (the default), with their greedy ids compared.

Writes ``benchmarks/results/generation/generation.json``:

    OMP_NUM_THREADS=1 python benchmarks/bench_generation.py [--models tiny smollm2-135m] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamrl.agents.base import SamplingParams
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig

BASELINE_REV = "247823534b08e326e5bedbca1869ee7a06f49065"
"""The last commit whose ``agents/hf_backend.py`` decodes through the transformers forward with per-row
generators (the path the static-cache decoder replaced)."""

TEXT = (
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 6, a cabinet 5, a cabinet 4, "
    "a cabinet 3, a cabinet 2, a cabinet 1, a coffeemachine 1, a countertop 3, a countertop 2, a countertop 1, "
    "a drawer 3, a drawer 2, a drawer 1, a fridge 1, a garbagecan 1, a microwave 1, a shelf 3, a shelf 2, a "
    "shelf 1, a sinkbasin 1, a stoveburner 4, a stoveburner 3, a stoveburner 2, a stoveburner 1, and a toaster 1. "
    "Your task is to: put a clean mug in coffeemachine. > go to countertop 1. You arrive at countertop 1. On the "
    "countertop 1, you see a apple 1, a butterknife 2, a mug 2, and a peppershaker 1. > take mug 2 from "
    "countertop 1. You pick up the mug 2 from the countertop 1. > go to sinkbasin 1. You arrive at sinkbasin 1. "
    "On the sinkbasin 1, you see nothing. > clean mug 2 with sinkbasin 1. You clean the mug 2 using the "
    "sinkbasin 1. What is 12 * 7 + 3? Use python: ```python\nprint(12 * 7 + 3)\n```\n```output\n87\n```\n"
)


def load_baseline(rev: str) -> Any:
    """``agents/hf_backend.py`` as of ``rev``, imported as a module of its own (it imports the rest of
    ``streamrl.agents`` as it is now)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:agents/hf_backend.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    name = "streamrl_baseline_hf_backend"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = f"{rev[:12]}:agents/hf_backend.py"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def make_prompts(tokenizer: Any, batch: int, length: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``length - 10`` to ``length + 10`` tokens cut from a long env-like text."""
    stream: list[int] = tokenizer(TEXT * 8, add_special_tokens=False)["input_ids"]
    prompts = []
    for row in range(batch):
        size = length - 10 + (row * 7) % 21
        start = (row * 37) % (len(stream) - size)
        prompts.append(stream[start : start + size])
    return prompts


def matmul_gflops(size: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def timed(backend: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """Wall and CPU seconds (this process's, one torch thread) of one ``generate`` call."""
    wall, cpu = time.perf_counter(), time.process_time()
    backend.generate(prompts, params)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(name: str, args: argparse.Namespace, baseline: Any) -> dict[str, Any]:
    new = HFBackend(name, config=HFBackendConfig(device="cpu", num_threads=args.threads))
    old = baseline.HFBackend(name, config=baseline.HFBackendConfig(device="cpu", num_threads=args.threads))
    parameters = sum(p.numel() for p in new.model.parameters())
    embedding = new.model.get_input_embeddings().weight.numel()
    prompts = make_prompts(new.tokenizer, args.batch, args.prompt_tokens)
    eos = new.eos_token_ids
    for backend in (new, old):
        backend.eos_token_ids = frozenset()  # every row generates exactly new_tokens
    sampled = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    first = SamplingParams(max_new_tokens=1, seed=0)
    paths = {"previous": old, "static_cache": new}
    for backend in paths.values():  # warm-up
        backend.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))
    gflops = matmul_gflops()
    clocks = ("wall", "cpu")
    times: dict[tuple[str, str], list[float]] = {
        (p, c): [] for p in paths for c in clocks
    }  # one generate call of new_tokens
    prefill: dict[tuple[str, str], list[float]] = {
        (p, c): [] for p in paths for c in clocks
    }  # the same at max_new_tokens=1
    for repeat in range(args.repeats):
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for path in order:
            for clock, seconds in zip(clocks, timed(paths[path], prompts, sampled), strict=True):
                times[path, clock].append(seconds)
            for clock, seconds in zip(clocks, timed(paths[path], prompts, first), strict=True):
                prefill[path, clock].append(seconds)
        last = {k: v[-1] for k, v in times.items()}
        print(
            f"{name} repeat {repeat}: wall {last['previous', 'wall']:.3f} / {last['static_cache', 'wall']:.3f} s, "
            f"cpu {last['previous', 'cpu']:.3f} / {last['static_cache', 'cpu']:.3f} s",
            flush=True,
        )
    gflops = max(gflops, matmul_gflops())
    produced = args.batch * args.new_tokens
    decoded = args.batch * (args.new_tokens - 1)
    floor_tok_s = gflops * 1e9 / (2 * parameters)
    model_flop = 2 * parameters * produced + 2 * (parameters - embedding) * sum(len(p) for p in prompts)
    row: dict[str, Any] = {
        "model": name,
        "parameters": parameters,
        "embedding_parameters": embedding,
        "batch": args.batch,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "new_tokens": args.new_tokens,
        "matmul_gflops": gflops,
        "floor_tok_per_s": floor_tok_s,
    }
    for clock in clocks:
        old_t, new_t = times["previous", clock], times["static_cache", clock]
        old_d = [t - p for t, p in zip(old_t, prefill["previous", clock], strict=True)]
        new_d = [t - p for t, p in zip(new_t, prefill["static_cache", clock], strict=True)]
        row[f"ratio_{clock}"] = statistics.median(a / b for a, b in zip(old_t, new_t, strict=True))
        row[f"decode_ratio_{clock}"] = statistics.median(a / b for a, b in zip(old_d, new_d, strict=True))
    for path in paths:
        for clock in clocks:
            runs, first_runs = times[path, clock], prefill[path, clock]
            median = statistics.median(runs)
            decode = statistics.median(t - p for t, p in zip(runs, first_runs, strict=True))
            row[f"{path}_{clock}"] = {
                "seconds": runs,
                "first_token_seconds": first_runs,
                "tok_per_s_median": produced / median,
                "tok_per_s_best": produced / min(runs),
                "decode_tok_per_s_median": decoded / decode,
                "floor_fraction_median": produced / median / floor_tok_s,
                "decode_floor_fraction_median": decoded / decode / floor_tok_s,
                "model_flop_fraction_median": model_flop / median / (gflops * 1e9),
            }
    # Greedy identity, without and with EOS stops (rows that end early leave the batch).
    identity = {}
    for label, stops in (("no_eos", frozenset()), ("eos", eos)):
        for backend in paths.values():
            backend.eos_token_ids = stops
        greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
        a = [g.token_ids for g in old.generate(prompts, greedy)]
        b = [g.token_ids for g in new.generate(prompts, greedy)]
        identity[label] = {"rows": len(a), "identical_rows": sum(x == y for x, y in zip(a, b, strict=True))}
    row["greedy_identity"] = identity
    row["greedy_ids_identical"] = all(v["identical_rows"] == v["rows"] for v in identity.values())
    gens = new.generate(prompts, sampled)
    scored = new.score(
        [p + g.token_ids for p, g in zip(prompts, gens, strict=True)], [len(p) for p in prompts]
    )
    row["sampled_logprob_vs_score_max_abs"] = max(
        abs(a - b) for g, s in zip(gens, scored, strict=True) for a, b in zip(g.logprobs, s, strict=True)
    )
    row["episodes"] = measure_turns(name, args, baseline, prompts)
    new.close()
    old.close()
    return row


def measure_turns(
    name: str, args: argparse.Namespace, baseline: Any, prompts: list[list[int]]
) -> dict[str, Any]:
    """Seconds of ``args.turns`` successive calls whose prompts continue the previous turn's rows (module doc)."""
    arms = {
        "previous": baseline.HFBackend(
            name, config=baseline.HFBackendConfig(device="cpu", num_threads=args.threads)
        ),
        "static_whole_prompts": HFBackend(
            name, config=HFBackendConfig(device="cpu", num_threads=args.threads, prefix_cache_bytes=0)
        ),
        "static_prefix_reuse": HFBackend(
            name, config=HFBackendConfig(device="cpu", num_threads=args.threads)
        ),
    }
    observation = make_prompts(arms["previous"].tokenizer, args.batch, 40)
    for backend in arms.values():
        backend.eos_token_ids = frozenset()
        backend.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))

    def episode(backend: Any, params: SamplingParams) -> tuple[float, list[list[int]]]:
        rows, seconds = [list(p) for p in prompts], 0.0
        for _ in range(args.turns):
            start = time.perf_counter()
            gens = backend.generate(rows, params, seeds=list(range(len(rows))))
            seconds += time.perf_counter() - start
            rows = [r + g.token_ids + o for r, g, o in zip(rows, gens, observation, strict=True)]
        return seconds, rows

    sampled = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in list(arms) if repeat % 2 == 0 else list(reversed(arms)):
            times[arm].append(episode(arms[arm], sampled)[0])
        print(
            f"{name} episodes repeat {repeat}: " + ", ".join(f"{a} {t[-1]:.3f} s" for a, t in times.items())
        )
    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    final = {arm: episode(backend, greedy)[1] for arm, backend in arms.items()}
    produced = args.batch * args.new_tokens * args.turns
    out: dict[str, Any] = {
        "turns": args.turns,
        "observation_tokens": 40,
        "prompt_tokens_last_turn": [
            min(map(len, final["previous"])) - 40 - args.new_tokens,
            max(map(len, final["previous"])) - 40 - args.new_tokens,
        ],
        "greedy_ids_identical": final["previous"]
        == final["static_whole_prompts"]
        == final["static_prefix_reuse"],
        "reused_tokens": arms["static_prefix_reuse"].prefix_cache.reused_tokens,
    }
    for arm, runs in times.items():
        out[arm] = {"seconds": runs, "tok_per_s_median": produced / statistics.median(runs)}
    for arm in ("static_whole_prompts", "static_prefix_reuse"):
        out[f"ratio_{arm}_vs_previous"] = statistics.median(
            a / b for a, b in zip(times["previous"], times[arm], strict=True)
        )
    out["ratio_prefix_reuse_vs_whole_prompts"] = statistics.median(
        a / b for a, b in zip(times["static_whole_prompts"], times["static_prefix_reuse"], strict=True)
    )
    for backend in arms.values():
        backend.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=4, help="turns of the episode measurement")
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "generation" / "generation.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline_rev)
    rows = []
    for name in args.models:
        row = measure(name, args, baseline)
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {
        "benchmark": "HF backend generation: static-cache decoder against the previous decode path, side by side",
        "command": " ".join(["python", *sys.argv]),
        "baseline": f"{args.baseline_rev}:agents/hf_backend.py",
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the end",
        "note": "tok/s = batch x new tokens / seconds of one generate call (prefill included); ratios are "
        "medians of per-repeat ratios of back-to-back runs; the CPU may be shared, which the ratios absorb "
        "better than the absolute rates",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
