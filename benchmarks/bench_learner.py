"""Learner throughput: tokens/s of ``Learner.update`` against the micro-batch size, full fine-tuning and LoRA,
and data-parallel learner ranks.

    python benchmarks/bench_learner.py [--model tiny] [--episodes 64] [--micro 1024 4096 16384 65536]
                                       [--ranks 1 2] [--repeats 1] [--out benchmarks/results/learner/learner.json]

The batch is real: ``--episodes`` Math-TIR training episodes played once by the model through the runtime
(a ``RolloutSession``: ``Rollouts`` / ``collect`` on a streaming vector env, the env spec's prompt, context policy and generation
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

``--versus REV`` instead times today's learner against the learner of git revision ``REV`` side by side, on
the demo's batches (``streamrl demo``: SPO++ on Math-TIR from the demo's cold-start checkpoint of ``tiny``,
``--episodes`` per update, 4 mini-batches, lr 1e-4, full fine-tuning; the batch played with ``--seed``)::

    python benchmarks/bench_learner.py --versus 5f14592 [--episodes 64] [--repeats 8] [--seed 0]
                                       [--out benchmarks/results/learner/learner_versus.json]

``--env alfworld --episodes 16`` times them on ALFWorld's preset's batches instead (``TRAIN_PRESETS["alfworld"]``:
its SFT start, 16 episodes played among the admissible commands with a windowed context, lr 3e-3, 2
mini-batches), written to ``learner_versus_alfworld.json``.

``REV``'s ``algorithms/learner.py`` and ``agents/logprobs.py`` are loaded from git as modules of their own, so
both learners run in this process on the same batch and weights. Updates alternate between the two learners
(``--repeats`` each, after a warm-up), each timed in CPU seconds of this process (what a busy neighbour on
a shared machine does not inflate, unlike wall seconds, also recorded): tokens/s are the batch's row tokens
per second, and the ratio is that of the medians. Then the gradients: both learners start from the same
weights, and at every optimizer step of one update the learner under test takes the reference's weights after
the reference's step, so each step's gradient is compared at the same weights (max absolute difference over
all parameters), with the losses and metrics of the update.
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
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamrl.agents.base import GenerationBackend
from streamrl.agents.env_specs import env_spec
from streamrl.agents.models import load_model, resolve_model
from streamrl.algorithms.base import Algorithm, Episode, make_algorithm
from streamrl.algorithms.distributed import DistributedLearner, LearnerSpec
from streamrl.algorithms.learner import Learner, LearnerConfig, shard_batch, training_rows
from streamrl.algorithms.runtime import Job
from streamrl.algorithms.session import RolloutSession
from streamrl.algorithms.tracker import Ticket
from streamrl.envs.vector import VectorEnvConfig

HERE = Path(__file__).resolve().parent


def play_batch(
    backend: GenerationBackend,
    episodes: int,
    *,
    env: str = "math_tir",
    seed: int = 0,
    num_envs: int = 16,
    constrained: bool = False,
) -> list[Episode]:
    """``episodes`` training episodes of ``env`` played by ``backend`` through the runtime, one per task (in
    the split's order), as ``Episode`` s with version-0 tickets (baseline 0.5) ready for ``Learner.update``;
    ``constrained``: among the env's actions, none twice from one state (ALFWorld's preset)."""
    spec = env_spec(env)
    with RolloutSession(
        env, spec.train_split, num_envs=min(num_envs, episodes), workers=VectorEnvConfig(backend="inprocess")
    ) as session:
        task_ids = session.task_ids[:episodes]
        # temperature 1, the spec's budget; seeded by the backend's generator
        agent = session.llm_agent(backend, constrain_actions=constrained, avoid_repeats=constrained)
        jobs = [Job(t, i, Ticket(t, 0, 0.5, i, 0.0)) for i, t in enumerate(task_ids)]
        done = session.play(agent, jobs, seed=seed, lockstep=False)
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


def learner_at(rev: str) -> type[Learner]:
    """The ``Learner`` class of git revision ``rev``: its ``algorithms/learner.py`` and ``agents/logprobs.py``
    executed as modules of their own (the rest of the package is today's)."""

    def module(path: str, name: str) -> types.ModuleType:
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=HERE.parent, capture_output=True, text=True, check=True
        ).stdout
        mod = types.ModuleType(name)
        mod.__file__ = f"{rev}:{path}"
        sys.modules[name] = mod  # dataclasses look their module up
        exec(compile(source, mod.__file__, "exec"), mod.__dict__)
        return mod

    logprobs = module("agents/logprobs.py", "reference_logprobs")
    learner = module("algorithms/learner.py", "reference_learner")
    learner.selected_token_logprobs = logprobs.selected_token_logprobs  # (imported by name)
    return learner.Learner  # type: ignore[no-any-return]


def stepwise_gradients(
    make: Callable[[type[Learner]], Learner],
    reference: type[Learner],
    episodes: list[Episode],
    algorithm: Algorithm,
) -> dict[str, Any]:
    """One update by each learner from the same weights; at each optimizer step the learner under test takes
    the reference's weights after its step, so every step's gradients are at the same weights."""
    advantages = alternating_advantages(episodes)
    ref, new = make(reference), make(Learner)
    grads: list[list[torch.Tensor]] = []
    after: list[list[torch.Tensor]] = []
    ref_step = ref._step

    def recording_step() -> float:
        grads.append([p.grad.detach().clone() for p in ref.params])  # type: ignore[union-attr]
        norm = ref_step()
        after.append([p.detach().clone() for p in ref.params])
        return norm

    diffs: list[float] = []

    def following_step() -> float:
        step = len(diffs)
        diffs.append(
            max(
                float((p.grad - g).abs().max())  # type: ignore[operator]
                for p, g in zip(new.params, grads[step], strict=True)
            )
        )
        with torch.no_grad():
            for p, w in zip(new.params, after[step], strict=True):
                p.copy_(w)
        new.optimizer.zero_grad(set_to_none=True)
        new.steps += 1
        return 0.0

    ref._step = recording_step  # type: ignore[method-assign]
    new._step = following_step  # type: ignore[method-assign]
    ref_metrics = ref.update(episodes, advantages, algorithm)
    new_metrics = new.update(episodes, advantages, algorithm)
    skip = {"learner_seconds", "learner_tokens_per_s", "grad_norm", "lr"}  # timing; the stubbed step
    return {
        "max_abs_grad_diff_per_step": diffs,
        "max_abs_grad_diff": max(diffs),
        "max_abs_grad": max(float(g.abs().max()) for step in grads for g in step),
        "metrics_reference": {k: v for k, v in ref_metrics.items() if k not in skip},
        "metrics_current": {k: v for k, v in new_metrics.items() if k not in skip},
        "max_abs_metric_diff": max(
            abs(ref_metrics[k] - new_metrics[k]) for k in ref_metrics if k not in skip
        ),
    }


def versus(args: argparse.Namespace) -> None:
    """Today's learner against revision ``args.versus`` on the demo's batches, or ALFWorld's preset's (module
    doc)."""
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.algorithms.train import TrainConfig, initial_model_dir
    from streamrl.cli.demo import DEMO_COLD_START, DemoConfig

    rev = subprocess.run(
        ["git", "rev-parse", args.versus], cwd=HERE.parent, capture_output=True, text=True, check=True
    ).stdout.strip()
    reference = learner_at(rev)
    load_before = os.getloadavg()[0]
    if args.env == "alfworld":  # the preset's run: its start, constrained play, lr and mini-batches
        run = TrainConfig.for_env("alfworld")
        model_dir = initial_model_dir("tiny", "sft", "alfworld")
        setting = {"lr": run.learner.lr, "mini_batches": run.learner.mini_batches, "updates": run.updates}
        described = "tiny, ALFWorld's shipped SFT checkpoint (TRAIN_PRESETS['alfworld'])"
    else:
        demo = DemoConfig()
        model_dir = initial_model_dir("tiny", "sft", "math_tir", sft=dict(DEMO_COLD_START))
        setting = {"lr": demo.lr, "mini_batches": demo.mini_batches, "updates": demo.updates}
        described = "tiny, the demo's cold-start checkpoint (DEMO_COLD_START)"
    backend = HFBackend(model_dir, config=HFBackendConfig(device="cpu", seed=args.seed))
    episodes = play_batch(
        backend, args.episodes, env=args.env, seed=args.seed, constrained=args.env == "alfworld"
    )
    pad = int(backend.tokenizer.pad_token_id)
    backend.close()
    shape = batch_shape(episodes)
    print(f"batch: {json.dumps(shape)}", flush=True)
    algorithm = make_algorithm("spo++")
    config = LearnerConfig(
        finetune="full", lr=setting["lr"], mini_batches=setting["mini_batches"], device="cpu"
    )

    def make(cls: type[Learner]) -> Learner:
        torch.manual_seed(0)
        return cls(load_model(model_dir), config, pad_token_id=pad, total_steps=setting["updates"])

    gradients = stepwise_gradients(make, reference, episodes, algorithm)
    print(f"max |grad diff| per step: {gradients['max_abs_grad_diff_per_step']}", flush=True)
    advantages = alternating_advantages(episodes)
    learners = {"reference": make(reference), "current": make(Learner)}
    for learner in learners.values():
        learner.update(episodes[:4], advantages[:4], algorithm)  # warm-up
    cpu: dict[str, list[float]] = {name: [] for name in learners}
    wall: dict[str, list[float]] = {name: [] for name in learners}
    for _ in range(args.repeats):
        for name, learner in learners.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            learner.update(episodes, advantages, algorithm)
            cpu[name].append(time.process_time() - cpu_started)
            wall[name].append(time.perf_counter() - started)
        print({name: round(cpu[name][-1], 3) for name in learners}, flush=True)
    tokens = shape["tokens"]
    timing = {
        name: {
            "cpu_seconds": [round(x, 4) for x in cpu[name]],
            "wall_seconds": [round(x, 4) for x in wall[name]],
            "tokens_per_cpu_s_median": round(tokens / statistics.median(cpu[name]), 1),
            "tokens_per_wall_s_median": round(tokens / statistics.median(wall[name]), 1),
            "action_tokens_per_cpu_s_median": round(shape["action_tokens"] / statistics.median(cpu[name]), 1),
        }
        for name in learners
    }
    report = {
        "benchmark": f"Learner.update on {args.env}'s batches: today's learner against a git revision's, side by side",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "reference_revision": rev,
        "model": described,
        "learner": {
            "algorithm": "spo++",
            "mini_batches": setting["mini_batches"],
            "lr": setting["lr"],
            "finetune": "full",
        },
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_avg_1m_before_after": [load_before, os.getloadavg()[0]],
        "batch": {**shape, "env": args.env, "seed": args.seed},
        "micro_batches": {
            name: len(learner._micro_batches(training_rows([e.trajectory for e in episodes])))
            for name, learner in learners.items()
        },
        "timing": timing,
        "speedup_cpu_median": round(
            statistics.median(cpu["reference"]) / statistics.median(cpu["current"]), 3
        ),
        "speedup_cpu_per_repeat": [
            round(r / c, 3) for r, c in zip(cpu["reference"], cpu["current"], strict=True)
        ],
        "speedup_wall_median": round(
            statistics.median(wall["reference"]) / statistics.median(wall["current"]), 3
        ),
        "gradients": gradients,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"speed-up (CPU s, median): {report['speedup_cpu_median']}; wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="registry name or local HF directory")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--micro", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--finetune", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1], help="learner ranks (gloo) to time")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--versus", default=None, help="git revision: time its learner against today's")
    parser.add_argument("--seed", type=int, default=0, help="--versus: the seed the batch is played with")
    parser.add_argument(
        "--env",
        default="math_tir",
        choices=["math_tir", "alfworld"],
        help="--versus: the demo's batches (math_tir) or ALFWorld's preset's (alfworld; use --episodes 16)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.versus is not None:
        suffix = "" if args.env == "math_tir" else f"_{args.env}"
        args.out = args.out or HERE / "results" / "learner" / f"learner_versus{suffix}.json"
        versus(args)
        return
    args.out = args.out or HERE / "results" / "learner" / "learner.json"
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
