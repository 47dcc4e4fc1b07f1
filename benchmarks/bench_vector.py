"""Throughput of the streaming vector env against Gymnasium's AsyncVectorEnv, and its per-step overhead.

For each env (``streamrl/ALFWorld-v0``, ``streamrl/MathTIR-v0``) and each number of sub-envs N in 1, 2, 4,
8 this runs the same scripted policy for about ``--seconds`` of wall time through

* ``streaming``: :class:`streamrl.envs.vector.StreamingVectorEnv`, first-ready ``send``/``recv``, one
  worker process per sub-env, a new episode started (``reset_async``) as soon as one ends;
* ``lockstep``: :class:`streamrl.envs.vector.LockstepVectorEnv` (Gymnasium API, NEXT_STEP autoreset);
* ``gym_async``: ``gymnasium.vector.AsyncVectorEnv(shared_memory=False)``, NEXT_STEP autoreset;

and counts env steps per second (autoreset "steps" of the lock-step modes, which only reset, are not
counted). Overhead: with one sub-env, the time per env step through the wrapper against calling the same
env directly in this process (``direct``); the in-process backend is reported too.

Policies: ALFWorld takes a uniformly random admissible command (seeded); Math-TIR uses the scripted
:class:`streamrl.agents.math_solver.MathSolverAgent` (a sandboxed tool call, then the boxed answer).
The machine is shared (2 cores); the JSON records the load average before and after each measurement.

Usage::

    python benchmarks/bench_vector.py                      # both envs, writes benchmarks/results/vector.json
    python benchmarks/bench_vector.py --envs math --seconds 5 --sizes 1 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import streamrl.envs  # noqa: F401 - registers the env ids
from streamrl.envs.vector import EnvFactory, LockstepVectorEnv, StreamingVectorEnv, VectorEnvConfig

Policy = Callable[[Any, dict[str, Any], Any], str]


# --------------------------------------------------------------------------------------------------------
# Env setups: factory and scripted policy
# --------------------------------------------------------------------------------------------------------


def alfworld_setup() -> tuple[EnvFactory, Callable[[], Policy]]:
    factory = EnvFactory("streamrl/ALFWorld-v0", {"split": "train"})

    def make_policy() -> Policy:
        rng = random.Random(0)

        def act(obs: Any, info: dict[str, Any], episode: Any) -> str:
            commands = list(info.get("admissible_commands") or ["look"])
            return rng.choice(commands)

        return act

    return factory, make_policy


def math_setup() -> tuple[EnvFactory, Callable[[], Policy]]:
    from streamrl.agents.math_solver import MathSolverAgent
    from streamrl.envs.math_tasks import task_set

    size = 64
    factory = EnvFactory("streamrl/MathTIR-v0", {"split": "test", "size": size})
    tasks = task_set("mixed", "test", size)

    def make_policy() -> Policy:
        agent = MathSolverAgent(tasks)

        def act(obs: Any, info: dict[str, Any], episode: Any) -> str:
            return agent.act([obs], [info], [episode])[0]

        return act

    return factory, make_policy


SETUPS = {"alfworld": alfworld_setup, "math": math_setup}


# --------------------------------------------------------------------------------------------------------
# Drivers: each returns (env steps, seconds)
# --------------------------------------------------------------------------------------------------------


class _Clock:
    """Counts env steps for ``seconds`` of wall time, starting once every sub-env has finished one
    episode (worker start-up, the sandbox pool and game loading are then warm and not timed)."""

    def __init__(self, n: int, seconds: float) -> None:
        self.seconds, self.warm = seconds, [False] * n
        self.start: float | None = None
        self.steps = 0

    def step(self, count: int = 1) -> None:
        if self.start is not None:
            self.steps += count

    def episode_done(self, i: int) -> None:
        self.warm[i] = True
        if self.start is None and all(self.warm):
            self.start = time.perf_counter()

    @property
    def running(self) -> bool:
        return self.start is None or time.perf_counter() - self.start < self.seconds

    def result(self) -> tuple[int, float]:
        assert self.start is not None
        return self.steps, time.perf_counter() - self.start


def run_direct(factory: EnvFactory, policy: Policy, seconds: float) -> tuple[int, float]:
    env = factory()
    clock = _Clock(1, seconds)
    try:
        episode = 0
        obs, info = env.reset(seed=0)
        while clock.running:
            obs, _, terminated, truncated, info = env.step(policy(obs, info, episode))
            clock.step()
            if terminated or truncated:
                clock.episode_done(0)
                episode += 1
                obs, info = env.reset(seed=episode)
        return clock.result()
    finally:
        env.close()


def run_streaming(
    factory: EnvFactory, policy: Policy, n: int, seconds: float, backend: str = "subprocess"
) -> tuple[int, float]:
    with StreamingVectorEnv([factory] * n, VectorEnvConfig(backend=backend)) as venv:  # type: ignore[arg-type]
        clock = _Clock(n, seconds)
        pending = venv.reset(seeds=list(range(n)))
        while True:
            feeding = clock.running
            for r in pending:
                if not r.is_reset:
                    clock.step()
                if r.done:
                    clock.episode_done(r.env_id)
                if not feeding:
                    continue  # time is up: only drain what is in flight
                if r.done:
                    venv.reset_async([r.env_id], seeds=r.episode_id + n)
                else:
                    venv.send([r.env_id], [policy(r.obs, r.info, r.episode_id)])
            if venv.num_pending == 0:
                return clock.result()
            pending = venv.recv()


def _unbatch(infos: dict[str, Any], i: int) -> dict[str, Any]:
    """Sub-env ``i``'s info out of Gymnasium's dict-of-arrays layout."""
    return {k: v[i] for k, v in infos.items() if not k.startswith("_") and infos[f"_{k}"][i]}


def _run_lockstep(venv: gym.vector.VectorEnv, policy: Policy, n: int, seconds: float) -> tuple[int, float]:
    try:
        clock = _Clock(n, seconds)
        obs, infos = venv.reset(seed=0)
        episode = list(range(n))
        resetting = np.zeros(n, dtype=bool)
        while clock.running:
            # NEXT_STEP: the step after an episode's end only resets that sub-env; its action is ignored.
            actions = tuple(
                "" if resetting[i] else policy(obs[i], _unbatch(infos, i), episode[i]) for i in range(n)
            )
            obs, _, terminated, truncated, infos = venv.step(actions)
            clock.step(int((~resetting).sum()))
            ended = np.logical_and(np.logical_or(terminated, truncated), ~resetting)
            for i in np.flatnonzero(ended):
                episode[i] += n
                clock.episode_done(int(i))
            resetting = ended
        return clock.result()
    finally:
        venv.close()


def run_lockstep(factory: EnvFactory, policy: Policy, n: int, seconds: float) -> tuple[int, float]:
    return _run_lockstep(LockstepVectorEnv([factory] * n), policy, n, seconds)


def run_gym_async(factory: EnvFactory, policy: Policy, n: int, seconds: float) -> tuple[int, float]:
    venv = gym.vector.AsyncVectorEnv([factory] * n, shared_memory=False, context="spawn")
    return _run_lockstep(venv, policy, n, seconds)


# --------------------------------------------------------------------------------------------------------


def measure(
    name: str,
    driver: Callable[..., tuple[int, float]],
    *args: Any,
    factory: EnvFactory,
    make_policy: Callable[[], Policy],
    repeats: int,
) -> dict[str, Any]:
    """Median env steps/s of ``driver(factory, make_policy(), *args)`` over ``repeats`` runs."""
    rates, loads = [], []
    for _ in range(repeats):
        load0 = os.getloadavg()[0]
        steps, secs = driver(factory, make_policy(), *args)
        rates.append(steps / secs)
        loads.append([load0, os.getloadavg()[0]])
    out = {"steps_per_s": statistics.median(rates), "runs": rates, "loadavg_1min": loads}
    print(f"  {name:<32} {out['steps_per_s']:9.1f} steps/s  (runs {', '.join(f'{r:.1f}' for r in rates)})")
    sys.stdout.flush()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--envs", nargs="+", choices=sorted(SETUPS), default=["alfworld", "math"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=10.0, help="wall time per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per point (median reported)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vector.json")
    args = parser.parse_args()

    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "settings": {"seconds": args.seconds, "repeats": args.repeats, "sizes": args.sizes},
        "envs": {},
    }
    for env_name in args.envs:
        factory, make_policy = SETUPS[env_name]()
        print(f"{env_name}: {factory.name}")
        env_report: dict[str, Any] = {"env_id": factory.name, "throughput": {}}
        m = functools.partial(measure, factory=factory, make_policy=make_policy, repeats=args.repeats)
        direct = m("direct (1 env, no wrapper)", run_direct, args.seconds)
        inproc = m("streaming in-process (1)", run_streaming, 1, args.seconds, "inprocess")
        for n in args.sizes:
            env_report["throughput"][str(n)] = {
                "streaming": m(f"streaming ({n})", run_streaming, n, args.seconds),
                "lockstep": m(f"lockstep facade ({n})", run_lockstep, n, args.seconds),
                "gym_async": m(f"gymnasium AsyncVectorEnv ({n})", run_gym_async, n, args.seconds),
            }
        env_report["direct"] = direct
        env_report["streaming_inprocess_1"] = inproc
        one = env_report["throughput"].get("1")
        if one is not None:
            per_step = {k: 1e3 / v["steps_per_s"] for k, v in one.items()}
            per_step["direct"] = 1e3 / direct["steps_per_s"]
            per_step["streaming_inprocess"] = 1e3 / inproc["steps_per_s"]
            env_report["ms_per_step_1env"] = per_step
            env_report["overhead_vs_direct"] = {
                k: per_step[k] / per_step["direct"] - 1
                for k in ("streaming", "streaming_inprocess", "lockstep", "gym_async")
            }
            print(f"  overhead vs direct: {env_report['overhead_vs_direct']}")
        report["envs"][env_name] = env_report

    args.out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing.update({k: v for k, v in report.items() if k != "envs"})
    existing.setdefault("envs", {}).update(report["envs"])
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
