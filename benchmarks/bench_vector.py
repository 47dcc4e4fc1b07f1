"""Throughput of the streaming vector env against Gymnasium's AsyncVectorEnv, and its per-step overhead.

For each env (``streamrl/ALFWorld-v0``, ``streamrl/MathTIR-v0``) and each number of sub-envs N in 1, 2, 4,
8 this runs the same scripted policy for about ``--seconds`` of wall time through

* ``streaming``: :class:`streamrl.envs.vector.StreamingVectorEnv`, first-ready ``send``/``recv``, one
  worker process per sub-env, a new episode started (``reset_async``) as soon as one ends;
* ``lockstep``: :class:`streamrl.envs.vector.LockstepVectorEnv` (Gymnasium API, NEXT_STEP autoreset);
* ``gym_async``: ``gymnasium.vector.AsyncVectorEnv(shared_memory=False)``, NEXT_STEP autoreset;

and counts env steps per second (autoreset "steps" of the lock-step modes, which only reset, are not
counted). Overhead (:func:`paired_overhead`): the time per env step through each wrapper, one sub-env,
against calling the same env directly in this process, on identical trajectories timed step by step in
rotating order (robust to the load of a shared machine, unlike the throughput table).

Policies: ALFWorld takes a uniformly random admissible command (seeded); Math-TIR uses the scripted
:class:`streamrl.agents.math_solver.MathSolverAgent` (a sandboxed tool call, then the boxed answer).
The machine is shared (2 cores); the JSON records the load average before and after each measurement.

Usage::

    python benchmarks/bench_vector.py                      # both envs, writes benchmarks/results/runtime/vector.json
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
import psutil
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


def paired_overhead(factory: EnvFactory, make_policy: Callable[[], Policy], steps: int) -> dict[str, Any]:
    """Per-step cost of each wrapper against the bare env, measured on *identical* trajectories.

    One direct env and one single-env instance of each wrapper play the same episodes (same seeds, the
    policy's action sent to all) step by step, in rotating order, so every step is timed under the same
    machine load. Autoreset is off everywhere (episodes are reset explicitly with the same seed).

    Two measures: wall time per step (what a caller waits, including the OS waking the worker and then
    the caller: on an oversubscribed machine that scheduling delay dominates for every multi-process
    design), and CPU time per step, caller plus worker processes, resets included (the work the wrapper
    adds, independent of load).
    """
    policy = make_policy()
    direct = factory()
    disabled = VectorEnvConfig(autoreset_mode="Disabled")
    streaming = StreamingVectorEnv([factory], disabled)
    lockstep = LockstepVectorEnv([factory], disabled)
    gym_async = gym.vector.AsyncVectorEnv(
        [factory], shared_memory=False, context="spawn", autoreset_mode="Disabled"
    )
    wrapped: dict[str, Any] = {
        "streaming": streaming,
        "streaming_inprocess": StreamingVectorEnv([factory], VectorEnvConfig(backend="inprocess")),
        "lockstep": lockstep,
        "gym_async": gym_async,
    }
    worker_pid = {
        "streaming": streaming.worker_pids()[0],
        "lockstep": lockstep.streaming.worker_pids()[0],
        "gym_async": gym_async.processes[0].pid,
    }

    def worker_cpu(name: str) -> float:
        pid = worker_pid.get(name)
        if pid is None:
            return 0.0
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)

    wall: dict[str, float] = dict.fromkeys(["direct", *wrapped], 0.0)
    cpu: dict[str, float] = dict.fromkeys(["direct", *wrapped], 0.0)
    env_seconds = 0.0  # time the streaming worker's env spent in its steps (EnvResult.env_seconds)

    def timed(name: str, call: Callable[[], Any], count_wall: bool) -> Any:
        c0, w0 = time.process_time(), time.perf_counter()
        out = call()
        if count_wall:
            wall[name] += time.perf_counter() - w0
        cpu[name] += time.process_time() - c0
        return out

    def first_obs(name: str, out: Any) -> Any:
        if isinstance(wrapped.get(name), StreamingVectorEnv):
            return out[0].obs
        return out[0][0]

    def reset_all(seed: int) -> tuple[Any, dict[str, Any]]:
        obs, info = timed("direct", lambda: direct.reset(seed=seed), False)
        for name, w in wrapped.items():
            if isinstance(w, StreamingVectorEnv):
                out = timed(name, functools.partial(w.reset, seeds=seed), False)
            else:
                out = timed(name, functools.partial(w.reset, seed=seed), False)
            assert first_obs(name, out) == obs, f"{name} diverged from the direct env at reset"
        return obs, info

    def step_call(name: str, action: str) -> Callable[[], Any]:
        w = wrapped[name]
        if isinstance(w, StreamingVectorEnv):
            return lambda: w.step([0], [action])
        return lambda: w.step((action,))

    try:
        episode = 0
        obs, info = reset_all(episode)
        cpu = dict.fromkeys(cpu, 0.0)
        cpu0 = {name: worker_cpu(name) for name in wrapped}
        for k in range(steps):
            action = policy(obs, info, episode)
            order = ["direct", *wrapped]
            order = order[k % len(order) :] + order[: k % len(order)]
            seen: dict[str, Any] = {}
            for name in order:
                if name == "direct":
                    obs, _, terminated, truncated, info = timed(
                        name, functools.partial(direct.step, action), True
                    )
                else:
                    out = timed(name, step_call(name, action), True)
                    seen[name] = first_obs(name, out)
                    if name == "streaming":
                        env_seconds += out[0].env_seconds
            for name, wobs in seen.items():
                assert wobs == obs, f"{name} diverged from the direct env"
            if terminated or truncated:
                episode += 1
                obs, info = reset_all(episode)
        for name in wrapped:
            cpu[name] += worker_cpu(name) - cpu0[name]
    finally:
        direct.close()
        for w in wrapped.values():
            w.close()
    out: dict[str, Any] = {
        "steps": steps,
        "episodes": episode,
        "wall_ms_per_step": {name: 1e3 * t / steps for name, t in wall.items()},
        "wall_overhead_vs_direct": {name: wall[name] / wall["direct"] - 1 for name in wrapped},
        "cpu_ms_per_step": {name: 1e3 * t / steps for name, t in cpu.items()},
        "cpu_overhead_vs_direct": {name: cpu[name] / cpu["direct"] - 1 for name in wrapped},
        # What the wrapper itself adds: the caller's wait minus the time the env spent inside step, as a
        # fraction of a direct step. Unlike the wall ratio it does not move with how fast the env happens
        # to run in the worker vs this process (+-5 % between runs on a shared VM).
        "streaming_wrapper_ms_per_step": 1e3 * (wall["streaming"] - env_seconds) / steps,
        "streaming_wrapper_overhead_vs_direct": (wall["streaming"] - env_seconds) / wall["direct"],
        "streaming_env_ms_per_step": 1e3 * env_seconds / steps,
        "loadavg_1min": os.getloadavg()[0],
    }
    print(f"  paired, {steps} identical steps: wall ms/step {_fmt(out['wall_ms_per_step'])}")
    print(f"  wall overhead vs direct: {_fmt(out['wall_overhead_vs_direct'], pct=True)}")
    print(
        f"  streaming wrapper cost {out['streaming_wrapper_ms_per_step']:.3f} ms/step "
        f"({100 * out['streaming_wrapper_overhead_vs_direct']:.1f}% of a direct step; env inside the worker "
        f"{out['streaming_env_ms_per_step']:.3f} ms)"
    )
    print(f"  cpu ms/step (caller + worker) {_fmt(out['cpu_ms_per_step'])}")
    print(f"  cpu overhead vs direct: {_fmt(out['cpu_overhead_vs_direct'], pct=True)}")
    return out


class EchoTextEnv(gym.Env[str, str]):
    """The cheapest Text env: ``step`` returns an observation and info the size of an ALFWorld step's
    (~0.8 kB pickled). Through it a wrapper's per-step cost is all that is measured."""

    observation_space = gym.spaces.Text(4096)
    action_space = gym.spaces.Text(4096)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return "start", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        info = {"admissible_commands": [f"go to cabinet {i}" for i in range(20)], "won": False}
        return f"You arrive at {action}. " + "On it, you see nothing. " * 16, 0.0, False, False, info


def _ping_pong_floor(steps: int) -> float:
    """Seconds per round trip of a pickled ~0.8 kB message between two bare processes over a socketpair:
    the floor any process-per-worker design pays on this machine."""
    import multiprocessing

    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=_echo_loop, args=(child,))
    proc.start()
    payload = EchoTextEnv().step("x")
    for _ in range(50):
        parent.send(payload)
        parent.recv()
    start = time.perf_counter()
    for _ in range(steps):
        parent.send(payload)
        parent.recv()
    seconds = (time.perf_counter() - start) / steps
    parent.send(None)
    proc.join()
    return seconds


def _echo_loop(conn: Any) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def transport_cost(steps: int) -> dict[str, Any]:
    """Microseconds per step of each wrapper around :class:`EchoTextEnv` (one sub-env, autoreset off),
    against the bare env and a bare two-process ping-pong. Rounds of 200 steps rotate between wrappers;
    the median round is reported."""
    factory = EnvFactory(fn=EchoTextEnv)
    disabled = VectorEnvConfig(autoreset_mode="Disabled")
    direct = EchoTextEnv()
    streaming = StreamingVectorEnv([factory], disabled)
    inprocess = StreamingVectorEnv([factory], VectorEnvConfig(backend="inprocess", autoreset_mode="Disabled"))
    gym_async = gym.vector.AsyncVectorEnv(
        [factory], shared_memory=False, context="spawn", autoreset_mode="Disabled"
    )
    calls: dict[str, Callable[[], Any]] = {
        "direct": functools.partial(direct.step, "a"),
        "streaming": functools.partial(streaming.step, [0], ["a"]),
        "streaming_inprocess": functools.partial(inprocess.step, [0], ["a"]),
        "gym_async": functools.partial(gym_async.step, ("a",)),
    }
    try:
        direct.reset(seed=0)
        streaming.reset(seeds=0)
        inprocess.reset(seeds=0)
        gym_async.reset(seed=0)
        rounds: dict[str, list[float]] = {name: [] for name in calls}
        for k in range(max(1, steps // 200)):
            for name in list(calls)[k % len(calls) :] + list(calls)[: k % len(calls)]:
                call = calls[name]
                start = time.perf_counter()
                for _ in range(200):
                    call()
                rounds[name].append((time.perf_counter() - start) / 200)
    finally:
        streaming.close()
        inprocess.close()
        gym_async.close()
    out: dict[str, Any] = {
        "us_per_step": {name: 1e6 * statistics.median(r) for name, r in rounds.items()},
        "ping_pong_floor_us": 1e6 * _ping_pong_floor(steps),
        "steps": steps,
        "loadavg_1min": os.getloadavg()[0],
    }
    print(f"  transport, median of {len(rounds['direct'])} rounds: us/step {_fmt(out['us_per_step'])}")
    print(f"  bare two-process ping-pong (the floor): {out['ping_pong_floor_us']:.1f} us")
    return out


def _fmt(values: dict[str, float], pct: bool = False) -> str:
    return ", ".join(f"{k} {100 * v:+.1f}%" if pct else f"{k} {v:.3f}" for k, v in values.items())


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
    parser.add_argument(
        "--paired-steps", type=int, default=400, help="steps of the paired overhead measurement"
    )
    parser.add_argument(
        "--paired-only", action="store_true", help="only redo the paired overhead measurement"
    )
    parser.add_argument(
        "--transport-steps", type=int, default=4000, help="steps of the echo-env transport measurement"
    )
    parser.add_argument(
        "--transport", action="store_true", help="only redo the echo-env transport measurement"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "runtime" / "vector.json"
    )
    args = parser.parse_args()
    if args.transport:
        args.envs = []

    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "settings": {"seconds": args.seconds, "repeats": args.repeats, "sizes": args.sizes},
        "envs": {},
    }
    for env_name in args.envs:
        factory, make_policy = SETUPS[env_name]()
        print(f"{env_name}: {factory.name}")
        env_report: dict[str, Any] = {"env_id": factory.name}
        if not args.paired_only:
            m = functools.partial(measure, factory=factory, make_policy=make_policy, repeats=args.repeats)
            env_report["direct"] = m("direct (1 env, no wrapper)", run_direct, args.seconds)
            env_report["streaming_inprocess_1"] = m(
                "streaming in-process (1)", run_streaming, 1, args.seconds, "inprocess"
            )
            env_report["throughput"] = {
                str(n): {
                    "streaming": m(f"streaming ({n})", run_streaming, n, args.seconds),
                    "lockstep": m(f"lockstep facade ({n})", run_lockstep, n, args.seconds),
                    "gym_async": m(f"gymnasium AsyncVectorEnv ({n})", run_gym_async, n, args.seconds),
                }
                for n in args.sizes
            }
        env_report["paired_overhead_1env"] = paired_overhead(factory, make_policy, args.paired_steps)
        report["envs"][env_name] = env_report

    if args.transport or not args.paired_only:
        print("echo env (a wrapper's own cost per step)")
        report["transport"] = transport_cost(args.transport_steps)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "transport" in report:
        existing["transport"] = report["transport"]
    if not (args.paired_only or args.transport):
        existing.update({k: v for k, v in report.items() if k not in ("envs", "transport")})
    for env_name, env_report in report["envs"].items():  # --paired-only keeps the throughput table
        existing.setdefault("envs", {}).setdefault(env_name, {}).update(env_report)
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
