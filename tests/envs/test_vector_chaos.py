"""Chaos tests: no episode is lost or returned twice while workers are SIGKILLed at random, hang, raise,
leak memory or kill themselves. Run repeatedly (5x in a row in CI checks); about 30 s per run.

The invariant checked everywhere: every episode id handed out by ``reset_async`` (or by autoreset) comes
back with exactly one final result (``terminated or truncated``), its steps numbered 1, 2, ... without
gaps, and every failure is ``truncated`` with an ``error_kind``.
"""

from __future__ import annotations

import os
import random

import pytest
from helpers import assert_exactly_once, drive_episodes, scripted_env
from streamrl.envs.vector import EnvResult, StreamingVectorEnv, SubEnvState, VectorEnvConfig

pytestmark = pytest.mark.timeout(240)


def test_hundreds_of_episodes_survive_kills_hangs_raises_leaks_and_suicides() -> None:
    """8 envs on 4 workers, each failing env sharing its worker with a healthy bystander: env 1 raises at
    step 2, env 3 SIGKILLs its own worker at step 3, env 4 leaks 48 MiB a step against a 200 MiB limit,
    env 6 hangs at step 2 against a 1 s step timeout; on top, a random worker is SIGKILLed every 15 recv
    calls."""
    factories = [
        scripted_env(),
        scripted_env(fault="raise", fault_step=2),
        scripted_env(),
        scripted_env(fault="die", fault_step=3),
        scripted_env(fault="leak", fault_step=1, leak_mb=48),
        scripted_env(),
        scripted_env(fault="hang", fault_step=2),
        scripted_env(),
    ]
    config = VectorEnvConfig(
        envs_per_worker=2, step_timeout=1.0, max_rss_mb=200, memory_check_interval=0.02, max_start_failures=20
    )
    venv = StreamingVectorEnv(factories, config)
    try:
        run = drive_episodes(venv, episodes=300, kill_every=15, rng=random.Random(1234))
        assert_exactly_once(run)
        assert len(run["started"]) == 300
        # Raises and suicides happen every episode of their env; a random kill can beat the hang to its
        # timeout or the leak to its limit (the tests below check those two on their own).
        assert {"exception", "crash"} <= set(run["kinds"]), run["kinds"]
        assert set(run["kinds"]) <= {"exception", "crash", "memory", "timeout"}
        assert run["kills"] > 0 and venv.restarts >= run["kinds"]["crash"] / 2  # <= 2 episodes per worker
        assert all(venv.state(i) is SubEnvState.NEEDS_RESET for i in range(venv.num_envs))
    finally:
        pids = [p for p in venv.worker_pids() if p is not None]
        venv.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_hung_env_times_out_and_its_worker_mates_come_back_once() -> None:
    """Env 0 hangs in its 2nd step; env 1 shares its worker and is queued behind it; env 2 lives elsewhere."""
    factories = [scripted_env(fault="hang", fault_step=2), scripted_env(), scripted_env()]
    with StreamingVectorEnv(factories, VectorEnvConfig(envs_per_worker=2, step_timeout=1.0)) as venv:
        first = venv.reset()
        venv.step(range(3), ["a"] * 3)
        venv.send(range(3), ["b"] * 3)
        results = {r.env_id: r for r in venv.recv(min_ready=3)}
        assert results[0].info["error_kind"] == "timeout" and "step_timeout=1.0" in results[0].error
        assert results[1].info["error_kind"] == "timeout" and results[1].truncated  # collateral
        assert results[2].error is None and results[2].step == 2
        assert [results[i].episode_id for i in range(3)] == [r.episode_id for r in first]
        assert venv.restarts == 1
        again = venv.reset([0, 1])
        assert all(r.error is None for r in again)


def test_memory_limit_replaces_a_leaking_worker_and_autoreset_carries_on() -> None:
    """The leaking env's episode ends once, truncated with the limit in the error; with autoreset
    NEXT_STEP the next send starts a new episode on the fresh worker."""
    config = VectorEnvConfig(autoreset_mode="NextStep", max_rss_mb=200, memory_check_interval=0.02)
    with StreamingVectorEnv(
        [scripted_env(fault="leak", fault_step=1, leak_mb=64), scripted_env()], config
    ) as venv:
        venv.reset()
        seen: list[EnvResult] = []
        while not any(r.info.get("error_kind") == "memory" for r in seen):
            venv.send([0, 1], ["go", "go"])
            seen += venv.recv(min_ready=2)
        lost = [r for r in seen if r.error is not None]
        assert len(lost) == 1 and lost[0].env_id == 0 and lost[0].truncated
        assert "max_rss_mb=200" in lost[0].error
        (restart,) = venv.step([0], ["go"])  # autoreset after the truncation
        assert restart.is_reset and restart.episode_id > lost[0].episode_id and restart.error is None
