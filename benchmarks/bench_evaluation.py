"""Held-out evaluation during training: a fresh vector env per evaluation against a ``RolloutSession`` kept for
the run, side by side, on the demo's evaluation.

    python benchmarks/bench_evaluation.py [--evaluations 3] [--episodes 300] [--num-envs 32]
                                          [--wide 0] [--threads 1] [--out benchmarks/results/runtime/evaluation.json]

The evaluation is the demo's (``streamrl demo``): ``tiny`` from the demo's cold-start checkpoint (shipped),
Math-TIR's test split, ``--episodes`` held-out episodes (every task equally often, the rest drawn as the trainer
draws them), temperature 1, the trainer's evaluation seeds, ``--num-envs`` episodes in flight, lock-step.
Two wirings play it, interleaved (reference, session, reference, session, ...), ``--evaluations`` times each:

* ``fresh``: today's wiring before the session, kept here as the reference (``fresh_evaluation``): every
  evaluation starts its own streaming vector env of ``--num-envs`` worker processes (each with its tool
  sandbox), plays, and closes it;
* ``session``: ``streamrl.algorithms.session.RolloutSession``, built once and kept: its workers start at the
  first evaluation and are reused by the later ones (what the trainer does now);
* ``wide`` (with ``--wide N``): a kept session of N sub-envs hosted ``N / --num-envs`` per worker process, so
  the backend generates for up to N episodes at once (an option measured, not the trainer's setting).

For each evaluation: wall seconds, seconds to the first finished episode, seconds in generation calls, and
whether its records (per episode:
the key, task, won, reward, steps, action tokens and a hash of every generated token id) equal the first
reference evaluation's. The steady state is the second and later evaluations (a run evaluates 7 times). The
load average is recorded: the machine may be shared, which is why the two wirings alternate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamrl.agents.base import SamplingParams, derive_seed
from streamrl.agents.env_specs import env_spec, make_env, task_ids_of
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
from streamrl.agents.models import load_tokenizer
from streamrl.algorithms.runtime import Finished, Job, Rollouts, collect
from streamrl.algorithms.session import RolloutSession
from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

HERE = Path(__file__).resolve().parent
ENV = "math_tir"
GENERATION: dict[str, float] = {}
"""Seconds the last evaluation of each wiring spent in generation calls (the rest: env workers and bookkeeping)."""


def eval_tasks(seed: int, episodes: int) -> list[str]:
    """The trainer's fixed held-out tasks: every test task ``episodes // tasks`` times, the rest drawn uniformly."""
    env = make_env(ENV, env_spec(ENV).eval_splits[0])
    ids = task_ids_of(env, ENV)
    env.close()
    rng = random.Random(derive_seed(seed, "eval-tasks"))
    return ids * (episodes // len(ids)) + rng.sample(ids, episodes % len(ids))


def demo_evaluation(seed: int, episodes: int) -> tuple[HFBackend, Any, list[str], str]:
    """What the demo's held-out evaluation plays with: a backend of ``tiny`` from the demo's cold start, its
    tokenizer, the trainer's ``episodes`` held-out tasks for ``seed``, and the split."""
    from streamrl.algorithms.train import initial_model_dir
    from streamrl.cli.demo import DEMO_COLD_START

    model_dir = initial_model_dir("tiny", "sft", ENV, sft=DEMO_COLD_START)
    tokenizer = load_tokenizer(model_dir)
    backend = HFBackend(model_dir, tokenizer=tokenizer, config=HFBackendConfig(device="cpu", seed=seed))
    return backend, tokenizer, eval_tasks(seed, episodes), env_spec(ENV).eval_splits[0]


def fresh_evaluation(
    backend: HFBackend,
    tokenizer: Any,
    tasks: Sequence[str],
    seed: int,
    num_envs: int,
    tick: Callable[[Any], None],
) -> list[Finished]:
    """The reference: the trainer's held-out evaluation as it was wired before ``RolloutSession`` (a vector env
    started for this evaluation, the spec's agent, lock-step ``Rollouts``, ``collect``, the env closed)."""
    spec = env_spec(ENV)
    venv = StreamingVectorEnv.from_env(
        spec.gym_id,
        num_envs,
        config=VectorEnvConfig(backend="subprocess"),
        split=spec.eval_splits[0],
        **dict(spec.env_kwargs),
    )
    eval_seed = derive_seed(seed, "eval")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=spec.max_new_tokens, seed=eval_seed)
    agent = spec.llm_agent(backend, sampling, tokenizer=tokenizer)
    rollouts = Rollouts(venv, agent, seed=eval_seed, lockstep=True)
    try:
        return collect(rollouts, [Job(t, i) for i, t in enumerate(tasks)], tick)
    finally:
        GENERATION["fresh"] = rollouts.generation_seconds
        venv.close()


def session_evaluation(
    session: RolloutSession,
    backend: HFBackend,
    tokenizer: Any,
    tasks: Sequence[str],
    seed: int,
    tick: Callable[[Any], None],
) -> list[Finished]:
    """The trainer's held-out evaluation now: the same agent and jobs played by a kept session."""
    eval_seed = derive_seed(seed, "eval")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=session.spec.max_new_tokens, seed=eval_seed)
    agent = session.llm_agent(backend, sampling, tokenizer=tokenizer)
    before = session.generation_seconds
    done = session.play(agent, [Job(t, i) for i, t in enumerate(tasks)], seed=eval_seed, progress=tick)
    GENERATION["session"] = session.generation_seconds - before
    return done


def records(done: Sequence[Finished]) -> list[dict[str, Any]]:
    """What an evaluation writes per episode (``evals/update-*.jsonl``), with a hash of its generated tokens."""
    out = []
    for item in sorted(done, key=lambda item: item.job.key):
        t = item.trajectory
        tokens = [tok for s in t.sequences for tok, m in zip(s.token_ids, s.action_mask, strict=True) if m]
        out.append(
            {
                "key": item.job.key,
                "task_id": item.job.task_id,
                "won": bool(t.won),
                "reward": float(t.reward),
                "steps": len(t.turns),
                "action_tokens": t.num_action_tokens,
                "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            }
        )
    return out


def timed(
    play: Callable[[Callable[[Any], None]], list[Finished]],
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    started = time.perf_counter()
    first: list[float] = []

    def tick(_: Any) -> None:
        if not first:
            first.append(time.perf_counter() - started)

    done = play(tick)
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 2), "first_result_s": round(first[0], 2)}, records(done)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--evaluations", type=int, default=3, help="evaluations per wiring (a run makes 7)")
    parser.add_argument(
        "--episodes", type=int, default=300, help="held-out episodes per evaluation (the demo's)"
    )
    parser.add_argument("--num-envs", type=int, default=32, help="episodes in flight (the demo's)")
    parser.add_argument(
        "--wide", type=int, default=0, help="also a kept session of this many sub-envs (0: none)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "runtime" / "evaluation.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from streamrl.cli.demo import DEMO_COLD_START

    backend, tokenizer, tasks, split = demo_evaluation(args.seed, args.episodes)
    sessions = {"session": RolloutSession(ENV, split, num_envs=args.num_envs, workers=VectorEnvConfig())}
    if args.wide:
        per_worker = max(1, args.wide // args.num_envs)
        sessions["wide"] = RolloutSession(
            ENV, split, num_envs=args.wide, workers=VectorEnvConfig(envs_per_worker=per_worker)
        )
    runs: dict[str, list[dict[str, Any]]] = {"fresh": [], **{name: [] for name in sessions}}
    reference: list[dict[str, Any]] | None = None
    load_before = os.getloadavg()
    try:
        for i in range(args.evaluations):
            plays: dict[str, Callable[[Callable[[Any], None]], list[Finished]]] = {
                "fresh": lambda tick: fresh_evaluation(
                    backend, tokenizer, tasks, args.seed, args.num_envs, tick
                )
            }
            for name, session in sessions.items():
                plays[name] = lambda tick, s=session: session_evaluation(
                    s, backend, tokenizer, tasks, args.seed, tick
                )
            for name, play in plays.items():
                timing, recs = timed(play)
                timing["generation_s"] = round(GENERATION.pop("fresh" if name == "fresh" else "session"), 2)
                if reference is None:
                    reference = recs
                timing["identical_records"] = recs == reference
                timing["won"] = sum(r["won"] for r in recs)
                runs[name].append(timing)
                print(f"evaluation {i + 1} {name}: {json.dumps(timing)}", file=sys.stderr, flush=True)
    finally:
        for session in sessions.values():
            session.close()
        backend.close()
    summary: dict[str, Any] = {}
    for name, timings in runs.items():
        steady = timings[1:] or timings
        summary[name] = {
            "first_evaluation_s": timings[0]["seconds"],
            "steady_median_s": statistics.median(t["seconds"] for t in steady),
            "steady_first_result_median_s": statistics.median(t["first_result_s"] for t in steady),
            "steady_generation_median_s": statistics.median(t["generation_s"] for t in steady),
            "all_records_identical": all(t["identical_records"] for t in timings),
        }
    for name in sessions:
        summary[name]["steady_speedup_vs_fresh"] = round(
            summary["fresh"]["steady_median_s"] / summary[name]["steady_median_s"], 2
        )
    result = {
        "benchmark": "bench_evaluation",
        "command": "python benchmarks/bench_evaluation.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "setting": {
            "model": "tiny",
            "start": f"demo cold start {dict(DEMO_COLD_START)}",
            "env": ENV,
            "split": split,
            "episodes": args.episodes,
            "tasks": len(set(tasks)),
            "num_envs": args.num_envs,
            "wide": args.wide,
            "temperature": 1.0,
            "threads": args.threads,
            "seed": args.seed,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        },
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
