"""Learner throughput: tokens/s of ``Learner.update`` against the micro-batch size, full fine-tuning and LoRA,
and data-parallel learner ranks.

    python benchmarks/bench_learner.py [--model tiny] [--episodes 64] [--micro 1024 4096 16384 65536]
                                       [--ranks 1 2] [--repeats 1] [--out benchmarks/results/learner.json]

The batch is real: ``--episodes`` Math-TIR training episodes played once by the model through the runtime
(``Rollouts`` / ``collect`` on a streaming vector env, the env spec's prompt, context policy and generation
budget, temperature 1), as the trainer plays them. Each setting then times one SPO++ update on that batch
(old log-probs recomputed, forward + backward in micro-batches of at most ``micro_batch_tokens`` padded
tokens sorted by length, one AdamW step) with a fresh learner from the same weights, after one untimed
warm-up update of that learner on a few episodes; best of ``--repeats``. ``--ranks R``: the learner is
``DistributedLearner`` with R gloo ranks (this process and R - 1 spawned ones, one torch thread each, the
batch dealt by ``shard_batch``); the time is rank 0's wall time of ``update`` (shipping the shards
included). tokens/s counts the tokens of the batch's rows (not the padding), as the trainer's
``learner/learner_tokens_per_s`` does; the padded tokens and micro-batches per update (of one rank holding
the whole batch) are recorded beside it. Advantages alternate +1 / -1 by episode, so every setting does the
same work whatever the rewards. CPU, 1 torch thread per rank (docs/platform.md §3), the load average
recorded: the machine may be shared, and R ranks need R idle cores to show their speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamrl.agents.base import GenerationBackend
from streamrl.agents.env_specs import env_spec, make_env, task_ids_of
from streamrl.agents.models import load_model, resolve_model
from streamrl.algorithms.base import Algorithm, Episode, make_algorithm
from streamrl.algorithms.distributed import DistributedLearner, LearnerSpec
from streamrl.algorithms.learner import Learner, LearnerConfig, shard_batch, training_rows
from streamrl.algorithms.runtime import Job, Rollouts, collect
from streamrl.algorithms.tracker import Ticket
from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

HERE = Path(__file__).resolve().parent


def play_batch(
    backend: GenerationBackend, episodes: int, *, env: str = "math_tir", seed: int = 0, num_envs: int = 16
) -> list[Episode]:
    """``episodes`` training episodes of ``env`` played by ``backend`` through the runtime, one per task (in
    the split's order), as ``Episode`` s with version-0 tickets (baseline 0.5) ready for ``Learner.update``."""
    spec = env_spec(env)
    probe = make_env(env, spec.train_split)
    task_ids = task_ids_of(probe, env)[:episodes]
    probe.close()
    venv = StreamingVectorEnv.from_env(
        spec.gym_id,
        min(num_envs, episodes),
        config=VectorEnvConfig(backend="inprocess"),
        split=spec.train_split,
        **dict(spec.env_kwargs),
    )
    agent = spec.llm_agent(backend)  # temperature 1, the spec's budget; seeded by the backend's generator
    jobs = [Job(t, i, Ticket(t, 0, 0.5, i, 0.0)) for i, t in enumerate(task_ids)]
    try:
        done = collect(Rollouts(venv, agent, seed=seed), jobs)
    finally:
        venv.close()
    return [Episode(item.trajectory, item.job.ticket) for item in done]


def alternating_advantages(episodes: list[Episode]) -> list[float | torch.Tensor]:
    """+1, -1, +1, ...: a gradient on every token whatever the rewards (a throughput or numerics check)."""
    return [1.0 if i % 2 == 0 else -1.0 for i in range(len(episodes))]


def batch_shape(episodes: list[Episode]) -> dict[str, Any]:
    rows = [len(s) for e in episodes for s in e.trajectory.sequences if s.num_action_tokens]
    return {
        "episodes": len(episodes),
        "rows": len(rows),
        "tokens": sum(rows),
        "action_tokens": sum(e.num_action_tokens for e in episodes),
        "row_length_min_mean_max": [min(rows), round(sum(rows) / len(rows), 1), max(rows)],
        "turns_mean": round(sum(len(e.trajectory.turns) for e in episodes) / len(episodes), 2),
        "success": sum(e.trajectory.won for e in episodes) / len(episodes),
    }


def time_update(
    model_dir: Path,
    pad_token_id: int,
    episodes: list[Episode],
    algorithm: Algorithm,
    config: LearnerConfig,
    repeats: int,
    ranks: int = 1,
) -> dict[str, Any]:
    """Best-of-``repeats`` wall seconds of one update on ``ranks`` ranks, each with a fresh learner from the
    same weights (warmed up by one update on a few episodes)."""
    advantages = alternating_advantages(episodes)
    warm = max(2, ranks)
    runs = []
    for _ in range(repeats):
        torch.manual_seed(0)
        if ranks == 1:
            learner = Learner(load_model(model_dir), config, pad_token_id=pad_token_id, total_steps=10)
        else:
            spec = LearnerSpec(str(model_dir), config, pad_token_id, total_steps=10, algorithm=algorithm.name)
            learner = DistributedLearner(load_model(model_dir), spec, ranks)
        try:
            learner.update(episodes[:warm], advantages[:warm], algorithm)
            started = time.perf_counter()
            metrics = learner.update(episodes, advantages, algorithm)
            runs.append({**metrics, "wall_seconds": time.perf_counter() - started})
        finally:
            learner.close()
    best = min(runs, key=lambda m: m["wall_seconds"])
    # the grouping one rank holding the whole batch runs (the learner's own helpers), for the padding it costs
    rows = training_rows([e.trajectory for e in episodes])
    chunks = learner._micro_batches(rows)
    padded = sum(len(c) * max(len(rows[i].sequence) for i in c) for c in chunks)
    tokens = sum(len(r.sequence) for r in rows)
    shards = shard_batch(episodes, advantages, ranks, config.mini_batches)
    return {
        "finetune": learner.finetune,
        "trainable_params": sum(p.numel() for p in learner.params),
        "ranks": ranks,
        "shard_action_tokens": [sum(e.num_action_tokens for e in s.episodes) for s in shards],
        "micro_batch_tokens": config.micro_batch_tokens,
        "micro_batches": len(chunks),
        "padded_tokens": padded,
        "padding_fraction": round(1 - tokens / padded, 4),
        "seconds": round(best["wall_seconds"], 3),
        "tokens_per_s": round(tokens * config.epochs / best["wall_seconds"], 1),
        "seconds_all": [round(m["wall_seconds"], 3) for m in runs],
        "loss_finite": all(torch.isfinite(torch.tensor(m["loss"])).item() for m in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="registry name or local HF directory")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--micro", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--finetune", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1], help="learner ranks (gloo) to time")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "learner.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig

    load_before = os.getloadavg()[0]
    model_dir = resolve_model(args.model)
    backend = HFBackend(model_dir, config=HFBackendConfig(device="cpu", seed=0))
    started = time.perf_counter()
    episodes = play_batch(backend, args.episodes)
    generation_s = time.perf_counter() - started
    pad = int(backend.tokenizer.pad_token_id)
    backend.close()
    shape = batch_shape(episodes)
    print(f"batch: {json.dumps(shape)} (played in {generation_s:.1f} s)", flush=True)
    algorithm = make_algorithm("spo++")
    results = []
    for finetune in args.finetune:
        for micro in args.micro:
            for ranks in args.ranks:
                config = LearnerConfig(finetune=finetune, micro_batch_tokens=micro, device="cpu")
                row = time_update(model_dir, pad, episodes, algorithm, config, args.repeats, ranks)
                print(json.dumps(row), flush=True)
                results.append(row)
    report = {
        "benchmark": "Learner.update tokens/s against micro_batch_tokens and learner ranks (SPO++ loss, one AdamW step)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": args.model,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
        "batch": {**shape, "env": "math_tir", "generation_s": round(generation_s, 1)},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
