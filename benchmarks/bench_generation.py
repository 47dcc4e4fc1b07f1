"""Generation throughput of the HF backend: tokens/s for ``tiny`` and ``smollm2-135m``, batch 1 and 8.

Setting (as in docs/platform.md §3): 1 torch thread, fp32 on CPU (bf16 on a GPU if present),
a ~30-token chat prompt, sampling at temperature 1 with no stop (exactly ``new_tokens`` per sequence, EOS
included in the count only if sampled last), one warm-up call, best of ``--repeats``. tok/s is aggregate
over the batch (batch x new tokens / seconds). Writes ``benchmarks/results/generation.json``.

    python benchmarks/bench_generation.py [--models tiny smollm2-135m] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamrl.agents.base import SamplingParams
from streamrl.agents.hf_backend import HFBackend

PROMPT = "You arrive at countertop 1. On the countertop 1, you see a mug 2. Your task is to: put a clean mug in coffeemachine."


def measure(backend: HFBackend, batch: int, new_tokens: int, repeats: int) -> dict[str, float]:
    ids = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    # No EOS stop: every row generates exactly new_tokens (ignore_eos, like vLLM's benchmark mode).
    backend.eos_token_ids = frozenset()
    params = SamplingParams(max_new_tokens=new_tokens, seed=0)
    backend.generate([ids] * batch, params)  # warm-up
    best = float("inf")
    produced = 0
    for _ in range(repeats):
        start = time.perf_counter()
        gens = backend.generate([ids] * batch, params)
        best = min(best, time.perf_counter() - start)
        produced = sum(len(g.token_ids) for g in gens)
    return {
        "batch": batch,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "seconds": best,
        "tok_per_s": produced / best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "generation.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        backend = HFBackend(name)
        params = sum(p.numel() for p in backend.model.parameters())
        for batch in args.batches:
            row = {
                "model": name,
                "params": params,
                "device": str(backend.device),
                "dtype": str(backend.dtype),
            }
            row.update(measure(backend, batch, args.new_tokens, args.repeats))
            print(json.dumps(row), flush=True)
            rows.append(row)
        backend.close()
    report = {
        "benchmark": "HF backend generation throughput",
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the end",
        "note": "aggregate tokens/s over the batch; best of repeats; the CPU is shared, so expect noise",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
