"""Streaming vector env: results against direct runs, first-ready order, autoreset modes, the Gymnasium
facade against gymnasium's own SyncVectorEnv, group seeding, error messages, and process reaping.

Chaos (killed, hung, raising, leaking workers in long runs) lives in test_vector_chaos.py.
"""

from __future__ import annotations

import functools
import os
import pickle
import random
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import psutil
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st
from streamrl.envs.vector import (
    EnvFactory,
    EnvResult,
    LockstepVectorEnv,
    ResetNeededError,
    StreamingVectorEnv,
    SubEnvError,
    SubEnvState,
    VectorEnvConfig,
    WorkerStartError,
)
from streamrl.envs.vector_workers import _Channel
from vector_testenvs import ScriptedTextEnv

BACKENDS = ["subprocess", "inprocess"]


def _scripted(**kwargs: Any) -> functools.partial[ScriptedTextEnv]:
    return functools.partial(ScriptedTextEnv, **kwargs)


def _wait_gone(pids: list[int], limit: float = 20.0) -> list[int]:
    """Pids still running (not zombies) after waiting up to ``limit`` s for them to go."""
    deadline = time.monotonic() + limit
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------------------------------------------
# Results are exactly what the env returns, tagged right, whatever the interleaving
# ------------------------------------------------------------------------------------------------------


HOSTS = {
    "spawn": VectorEnvConfig(envs_per_worker=2),
    "forkserver": VectorEnvConfig(start_method="forkserver", envs_per_worker=2),
    "inprocess": VectorEnvConfig(backend="inprocess", envs_per_worker=2),
}


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_streamed_episodes_equal_direct_runs(host: str) -> None:
    """Random interleaving of send/recv over 5 envs on 3 workers (2 envs per worker): every episode's
    results equal a direct run of the same env with the same seed and actions, tagged with the right
    env id, episode id and step, and every episode id appears exactly once."""
    rng = random.Random(0)
    lengths = [2, 3, 4, 5, 3]
    venv = StreamingVectorEnv([_scripted(episode_len=n) for n in lengths], HOSTS[host])
    transcripts: dict[int, list[EnvResult]] = {}
    seeds: dict[int, int] = {}
    actions: dict[int, list[str]] = {}
    try:
        for env_id in range(5):
            seeds[venv.reset_async([env_id], seeds=100 + env_id)[0]] = 100 + env_id
        finished = 0
        next_seed = 200
        while finished < 20:
            results = venv.recv(timeout=30)
            assert results, "recv timed out with calls pending"
            for r in results:
                transcripts.setdefault(r.episode_id, []).append(r)
                if r.done:
                    finished += 1
                    seeds[venv.reset_async([r.env_id], seeds=next_seed)[0]] = next_seed
                    next_seed += 1
                else:
                    action = rng.choice(["go", "win", "look"])
                    actions.setdefault(r.episode_id, []).append(action)
                    venv.send([r.env_id], [action])
    finally:
        venv.close()

    complete = {eid: t for eid, t in transcripts.items() if t[-1].done}
    assert len(complete) >= 20
    for eid, got in complete.items():
        env_id = got[0].env_id
        env = ScriptedTextEnv(episode_len=lengths[env_id])
        obs, info = env.reset(seed=seeds[eid])
        expected = [(obs, 0.0, False, False, info, 0)]
        for t, action in enumerate(actions[eid], start=1):
            expected.append((*env.step(action), t))
        assert [(r.obs, r.reward, r.terminated, r.truncated, r.info, r.step) for r in got] == expected
        assert {r.env_id for r in got} == {env_id} and {r.episode_id for r in got} == {eid}
    assert len(set(transcripts)) == len(transcripts)


def test_recv_returns_fast_envs_first_while_a_slow_one_is_held(tmp_path: Path) -> None:
    """Env 0 cannot finish its first step until the test opens its gate; meanwhile the three other envs
    complete whole episodes through recv. No timing involved: lock-step would deadlock here."""
    gate = tmp_path / "gate"
    factories = [_scripted(episode_len=2, fault="gate", gate_path=str(gate))] + [_scripted(episode_len=2)] * 3
    with StreamingVectorEnv(factories) as venv:
        venv.reset()
        venv.send(range(4), ["a"] * 4)
        seen: list[EnvResult] = []
        while sum(r.done for r in seen) < 3:
            for r in venv.recv():
                seen.append(r)
                if not r.done:
                    venv.send([r.env_id], ["b"])
        assert {r.env_id for r in seen} == {1, 2, 3}
        assert venv.state(0) is SubEnvState.STEPPING and venv.num_pending == 1
        assert venv.recv(timeout=0.05) == []  # still held: an empty list, not an error
        gate.touch()
        (late,) = venv.recv()
        assert (late.env_id, late.step, late.obs) == (0, 1, late.info["task_id"] + " t=1 a=a")


# ------------------------------------------------------------------------------------------------------
# Autoreset and the Gymnasium facade
# ------------------------------------------------------------------------------------------------------


def _assert_same_batch(ours: Any, theirs: Any) -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs)
        for key in theirs:
            _assert_same_batch(ours[key], theirs[key])
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype and ours.shape == theirs.shape
        if theirs.dtype == object:
            for a, b in zip(ours, theirs, strict=True):
                _assert_same_batch(a, b)
        else:
            np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _assert_same_batch(a, b)
    else:
        assert type(ours) is type(theirs) and ours == theirs


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_lockstep_facade_matches_gymnasium_sync_vector_env(mode: AutoresetMode) -> None:
    """Same envs, seeds and actions: our facade returns exactly what gymnasium.vector.SyncVectorEnv
    returns (observation tuples, float64/bool arrays, infos with masks, final_obs/final_info)."""
    fns = [_scripted(episode_len=n) for n in (2, 3, 4)]
    ours = LockstepVectorEnv(fns, VectorEnvConfig(autoreset_mode=mode))
    theirs = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert ours.metadata["autoreset_mode"] == theirs.metadata["autoreset_mode"] == mode
        assert ours.observation_space == theirs.observation_space
        assert ours.action_space == theirs.action_space
        _assert_same_batch(ours.reset(seed=7), theirs.reset(seed=7))
        rng = random.Random(1)
        for _ in range(9):
            actions = tuple(rng.choice(["win", "go"]) for _ in range(3))
            ours_out, theirs_out = ours.step(actions), theirs.step(actions)
            _assert_same_batch(ours_out, theirs_out)
            if mode == AutoresetMode.DISABLED:
                done = np.logical_or(theirs_out[2], theirs_out[3])
                if done.any():
                    opts = {"reset_mask": done, "task_id": "again"}
                    _assert_same_batch(
                        ours.reset(seed=3, options=dict(opts)), theirs.reset(seed=3, options=dict(opts))
                    )
    finally:
        ours.close()
        theirs.close()


def test_streaming_autoreset_modes_tag_the_next_episode() -> None:
    with StreamingVectorEnv([_scripted(episode_len=1)], VectorEnvConfig(autoreset_mode="NextStep")) as venv:
        (first,) = venv.reset()
        (final,) = venv.step([0], ["win"])
        assert final.terminated and final.reward == 1.0 and venv.state(0) is SubEnvState.NEEDS_RESET
        (again,) = venv.step([0], ["ignored"])  # NEXT_STEP: this send resets
        assert again.is_reset and again.episode_id == first.episode_id + 1 and again.reward == 0.0
    with StreamingVectorEnv([_scripted(episode_len=1)], VectorEnvConfig(autoreset_mode="SameStep")) as venv:
        (first,) = venv.reset(seeds=5)
        (final,) = venv.step([0], ["win"])
        assert final.terminated and final.episode_id == first.episode_id and final.step == 1
        assert final.next_episode_id == first.episode_id + 1 and venv.state(0) is SubEnvState.READY
        assert final.info["final_obs"].endswith("t=1 a=win") and final.obs.endswith(" start")
        (nxt,) = venv.step([0], ["go"])
        assert nxt.episode_id == final.next_episode_id and nxt.step == 1


def test_group_reset_broadcasts_task_and_seed() -> None:
    """GRPO groups: one options mapping (or one int seed) is given to every listed env."""
    with StreamingVectorEnv([_scripted()] * 4, VectorEnvConfig(backend="inprocess")) as venv:
        group = venv.reset([0, 1, 2], options={"task_id": "problem-17"})
        assert {r.obs for r in group} == {"problem-17 start"} and len({r.episode_id for r in group}) == 3
        same_seed = venv.reset([0, 1, 2, 3], seeds=42)
        assert len({r.info["task_id"] for r in same_seed}) == 1
        per_env = venv.reset([2, 3], seeds=[1, 2], options=[{"task_id": "x"}, None])
        assert per_env[0].obs == "x start" and per_env[1].info["task_id"].startswith("task")


# ------------------------------------------------------------------------------------------------------
# Env exceptions: truncated with the traceback, or raised in strict mode
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_env_exception_comes_back_once_with_traceback(backend: str) -> None:
    with StreamingVectorEnv(
        [_scripted(fault="raise", fault_step=2)], VectorEnvConfig(backend=backend)
    ) as venv:
        (start,) = venv.reset()
        (ok,) = venv.step([0], ["a"])
        (failed,) = venv.step([0], ["b"])
        assert failed.truncated and not failed.terminated and failed.reward == 0.0
        assert (failed.episode_id, failed.step, failed.obs) == (start.episode_id, 2, ok.obs)
        assert failed.info["error_kind"] == "exception"
        assert failed.error == f"ValueError: scripted failure at step 2 of {start.info['task_id']}"
        assert "in step" in failed.info["traceback"] and "vector_testenvs.py" in failed.info["traceback"]
        assert venv.state(0) is SubEnvState.NEEDS_RESET and venv.restarts == 0
        (again,) = venv.reset()  # the same worker keeps serving
        assert again.episode_id == start.episode_id + 1


def test_strict_mode_reraises_with_worker_traceback() -> None:
    config = VectorEnvConfig(strict=True)
    with StreamingVectorEnv([_scripted(fault="raise", fault_step=1), _scripted()], config) as venv:
        venv.reset()
        venv.send([0, 1], ["a", "b"])
        with pytest.raises(SubEnvError, match="scripted failure") as caught:
            while True:
                venv.recv(min_ready=venv.num_pending)
        assert caught.value.env_id == 0 and isinstance(caught.value.__cause__, ValueError)
        assert "Worker traceback" in str(caught.value) and "vector_testenvs.py" in str(caught.value)
        assert venv.state(0) is SubEnvState.NEEDS_RESET
        if venv.num_pending:  # env 1's result, if it was in the same batch, is kept for the next recv
            (other,) = venv.recv()
            assert other.env_id == 1 and other.error is None


# ------------------------------------------------------------------------------------------------------
# Clear errors
# ------------------------------------------------------------------------------------------------------


def test_misuse_raises_clear_errors() -> None:
    with StreamingVectorEnv([_scripted()] * 2, VectorEnvConfig(backend="inprocess")) as venv:
        with pytest.raises(NoAsyncCallError, match="no call pending"):
            venv.recv()
        with pytest.raises(ResetNeededError, match=r"reset_async\(\[1\]\)"):
            venv.send([1], ["a"])
        with pytest.raises(ValueError, match=r"env id 2 is not valid; valid ids are the ints 0\.\.1"):
            venv.reset_async([2])
        with pytest.raises(ValueError, match="env id -1 is not valid"):
            venv.reset_async([-1])
        with pytest.raises(TypeError, match=r"single int 0; use \[0\]"):
            venv.reset_async(0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="repeat an id"):
            venv.reset_async([0, 0])
        with pytest.raises(ValueError, match="seeds has 1 entries for 2 env ids"):
            venv.reset_async([0, 1], seeds=[1])
        with pytest.raises(TypeError, match="options="):
            venv.reset_async([0], options="task")  # type: ignore[arg-type]
        venv.reset_async([0, 1])
        with pytest.raises(AlreadyPendingCallError, match="sub-env 0 is busy"):
            venv.send([0], ["a"])
        with pytest.raises(ValueError, match="min_ready must be between 1 and the 2 pending"):
            venv.recv(min_ready=3)
        venv.recv(min_ready=2)
        with pytest.raises(ValueError, match="got 1 actions for 2 env ids"):
            venv.send([0, 1], ["a"])
    with pytest.raises(ClosedEnvironmentError):
        venv.send([0], ["a"])
    assert venv.state(0) is SubEnvState.CLOSED


def test_bad_factories_and_configs_fail_at_construction() -> None:
    with pytest.raises(gym.error.NameNotFound, match="NoSuchEnv"):
        StreamingVectorEnv.from_env("streamrl/NoSuchEnv-v0", 2)
    with pytest.raises(TypeError, match="cannot build an env from 3"):
        StreamingVectorEnv([3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'forkserver', got 'fork'"):
        VectorEnvConfig(start_method="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="autoreset_mode must be one of"):
        VectorEnvConfig(autoreset_mode="sometimes")
    with pytest.raises(ValueError, match="step_timeout must be > 0 or None, got 0"):
        VectorEnvConfig(step_timeout=0)
    with pytest.raises(WorkerStartError, match=r"could not build its envs: TypeError(.|\n)*Worker traceback"):
        StreamingVectorEnv([_scripted(no_such_argument=1)])
    with pytest.raises(ValueError, match="all sub-envs must share observation and action spaces"):
        StreamingVectorEnv(["CartPole-v1", _scripted()], VectorEnvConfig(backend="inprocess"))


def test_registered_gym_ids_and_kwargs_work() -> None:
    """Any registered gym.Env runs, from an id plus gym.make kwargs (here a built-in, non-Text one)."""
    factory = EnvFactory("CartPole-v1", {"max_episode_steps": 2})
    with StreamingVectorEnv([factory] * 2, VectorEnvConfig(envs_per_worker=2)) as venv:
        venv.reset(seeds=0)
        results = venv.step([0, 1], [0, 1])
        assert [r.step for r in results] == [1, 1]
        results = venv.step([0, 1], [0, 1])
        assert all(r.truncated for r in results)  # the TimeLimit of gym.make(max_episode_steps=2)


def test_first_use_data_is_prepared_once_in_the_parent_before_the_workers_start(tmp_path: Path) -> None:
    """A registered env class's ``prepare_data`` (ALFWorld's: generate the split's games) runs once, in this process,
    before any worker starts: building the data is not counted against a worker's start timeout, and several
    workers do not wait on one another's generation. Sub-envs of a callable factory are not prepared."""
    marker = tmp_path / "prepared"
    gym.register(id="streamrl-test/Prepared-v0", entry_point="vector_testenvs:PreparedTextEnv")
    try:
        config = VectorEnvConfig(envs_per_worker=1)
        with StreamingVectorEnv.from_env("streamrl-test/Prepared-v0", 3, config, marker=str(marker)) as venv:
            assert len(venv.reset(seeds=0)) == 3  # every worker built its env: the data was there
        assert marker.read_text().split() == [str(os.getpid())]
    finally:
        gym.registry.pop("streamrl-test/Prepared-v0", None)
    from vector_testenvs import PreparedTextEnv

    other = tmp_path / "never"
    with pytest.raises(WorkerStartError, match="prepare_data\\(\\) has not run"):
        StreamingVectorEnv([functools.partial(PreparedTextEnv, str(other))] * 2, config)
    assert not other.exists()


# ------------------------------------------------------------------------------------------------------
# Reaping
# ------------------------------------------------------------------------------------------------------


def test_close_reaps_every_worker() -> None:
    venv = StreamingVectorEnv([_scripted()] * 3, VectorEnvConfig(close_timeout=2))
    pids = [p for p in venv.worker_pids() if p is not None]
    venv.reset()
    venv.send([0], ["a"])  # close with a call in flight
    venv.close()
    venv.close()
    assert len(pids) == 3 and _wait_gone(pids, limit=0.0) == []


_EXIT_SCRIPT = """
import functools, os, signal, sys
sys.path.insert(0, {tests!r})
from vector_testenvs import ScriptedTextEnv
from streamrl.envs.vector import StreamingVectorEnv
venv = StreamingVectorEnv([functools.partial(ScriptedTextEnv)] * 2)
venv.reset()
print(" ".join(str(p) for p in venv.worker_pids()), flush=True)
how = {how!r}
if how == "drop":
    del venv  # garbage collection reaps
elif how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup code runs at all: workers see EOF and exit
# "exit": the interpreter exits with the env still open
"""


@pytest.mark.parametrize("how", ["exit", "drop", "sigkill"])
def test_workers_do_not_outlive_their_parent(how: str) -> None:
    """No __main__ guard in the script either: spawned workers never re-import the caller's main."""
    script = _EXIT_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), how=how)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2, proc.stderr
    assert _wait_gone(pids) == []


def test_killing_a_worker_ends_its_episodes_once(tmp_path: Path) -> None:
    """The basic contract behind the chaos tests: a SIGKILLed worker's in-flight episode comes back at
    recv, an episode that was waiting for an action comes back at its next send; both exactly once.
    (Env 0's second step waits on a gate that never opens, so the kill surely finds it in flight.)"""
    held = _scripted(episode_len=5, fault="gate", fault_step=2, gate_path=str(tmp_path / "never"))
    factories = [held, _scripted(episode_len=5), _scripted(episode_len=5)]
    with StreamingVectorEnv(factories, VectorEnvConfig(envs_per_worker=2)) as venv:
        start = venv.reset()
        venv.step([0, 1, 2], ["a", "a", "a"])
        venv.send([0], ["b"])
        pid = venv.worker_pids()[0]
        assert pid is not None
        os.kill(pid, 9)
        (r0,) = venv.recv()  # env 0's step was in flight on the killed worker
        assert (r0.env_id, r0.truncated, r0.info["error_kind"], r0.step) == (0, True, "crash", 2)
        assert "SIGKILL" in r0.error and r0.episode_id == start[0].episode_id
        assert venv.restarts == 1 and venv.worker_pids()[0] != pid
        venv.send([1, 2], ["b", "b"])  # env 1 lived in the killed worker, env 2 did not
        by_env = {r.env_id: r for r in venv.recv(min_ready=2)}
        assert by_env[1].truncated and by_env[1].info["error_kind"] == "crash" and by_env[1].step == 2
        assert by_env[2].error is None and by_env[2].step == 2
        assert venv.state(1) is SubEnvState.NEEDS_RESET
        fresh = venv.reset([0, 1])
        assert all(r.error is None for r in fresh)


# ------------------------------------------------------------------------------------------------------
# The real envs: Math-TIR and ALFWorld
# ------------------------------------------------------------------------------------------------------


def _play(venv: StreamingVectorEnv, agent: Any, first: list[EnvResult]) -> list[EnvResult]:
    """Let ``agent`` play the episodes started by ``first`` to the end, first-ready; the final results."""
    finals: list[EnvResult] = []
    ready = [r for r in first if not r.done]
    while True:
        for r in ready:
            if r.done:
                finals.append(r)
                agent.end_episode(r.episode_id)
            else:
                venv.send([r.env_id], agent.act([r.obs], [r.info], [r.episode_id]))
        if not venv.num_pending:
            return finals
        ready = venv.recv(timeout=120)
        assert ready, "no result within 120 s"


@pytest.mark.slow
def test_math_tir_group_solves_one_task_through_the_sandbox() -> None:
    """A GRPO-style group of 2 Math-TIR envs (one worker) on one task, played by the scripted solver:
    a real sandboxed tool call, then the boxed answer, rewarded by the real answer checker."""
    from streamrl.agents.math_solver import MathSolverAgent
    from streamrl.envs.math_tasks import task_set

    tasks = task_set("mixed", "test", 4)
    config = VectorEnvConfig(envs_per_worker=2, step_timeout=60)
    with StreamingVectorEnv.from_env("streamrl/MathTIR-v0", 2, config, split="test", size=4) as venv:
        first = venv.reset(options={"task_id": tasks[3].task_id})
        assert first[0].obs == first[1].obs and venv.single_observation_space.contains(first[0].obs)
        assert first[0].info["question"] == tasks[3].question
        finals = _play(venv, MathSolverAgent(tasks), first)
    assert sorted(r.env_id for r in finals) == [0, 1]
    for r in finals:
        assert (
            r.terminated and r.reward == 1.0 and r.info["won"] and r.info["tool_calls"] == 1 and r.step == 2
        )


@pytest.mark.slow
@pytest.mark.alfworld
def test_alfworld_group_is_won_by_the_expert_and_survives_a_killed_worker() -> None:
    """Two ALFWorld workers (the engine is not thread-safe: processes only) reset to one task by options;
    the walkthrough expert wins both. Then one worker is SIGKILLed mid-episode: that episode comes back
    truncated, the fresh worker plays the task again and wins."""
    from streamrl.agents.alfworld_agents import ALFWorldExpertAgent

    with StreamingVectorEnv.from_env("streamrl/ALFWorld-v0", 2, split="eval_unseen") as venv:
        (probe,) = venv.reset([0], seeds=0)
        task = probe.info["task_id"]
        first = venv.reset(options={"task_id": task})
        assert first[0].obs == first[1].obs and first[0].info["walkthrough"] == first[1].info["walkthrough"]
        finals = _play(venv, ALFWorldExpertAgent(), first)
        assert [r.info["won"] for r in finals] == [True, True]
        assert all(r.reward == 1.0 and r.step == len(first[0].info["walkthrough"]) for r in finals)

        (start,) = venv.reset([0], options={"task_id": task})
        venv.step([0], [start.info["walkthrough"][0]])
        pid = venv.worker_pids()[0]
        assert pid is not None
        os.kill(pid, 9)
        (lost,) = venv.step([0], [start.info["walkthrough"][1]])
        assert lost.truncated and lost.info["error_kind"] == "crash" and lost.episode_id == start.episode_id
        again = venv.reset([0], options={"task_id": task})
        (final,) = _play(venv, ALFWorldExpertAgent(), again)
        assert final.info["won"] and venv.restarts == 1


# ------------------------------------------------------------------------------------------------------
# The worker channel: framing survives any chunking; large payloads cross intact
# ------------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200_000), min_size=1, max_size=12),
    blocking=st.lists(st.booleans(), min_size=1),
)
def test_channel_delivers_every_frame_in_order_then_eof(sizes: list[int], blocking: list[bool]) -> None:
    """Frames of any size (around and across the 64 KiB read chunk) arrive whole, in order, whether read
    with the blocking ``recv`` (the worker) or the non-blocking ``recv_ready`` (the caller), then EOF."""
    left, right = socket.socketpair()
    sender, receiver = _Channel(left), _Channel(right)
    sent = [bytes([i % 251]) * n for i, n in enumerate(sizes)]

    def send_all() -> None:
        for payload in sent:
            sender.send(payload)
        sender.close()

    thread = threading.Thread(target=send_all)
    thread.start()
    got: list[Any] = []
    k = 0
    while len(got) < len(sent):
        if blocking[k % len(blocking)]:
            got.append(receiver.recv())
        else:
            select.select([receiver], [], [], 5.0)
            got.extend(receiver.recv_ready())
        k += 1
    thread.join()
    assert got == sent
    with pytest.raises(EOFError):
        receiver.recv_ready()
    with pytest.raises(EOFError):
        receiver.recv()
    receiver.close()


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_megabyte_actions_and_observations_cross_the_process_boundary(envs_per_worker: int) -> None:
    action = "go " * 400_000  # 1.2 MB each way: many read chunks, and the worker's send blocks meanwhile
    config = VectorEnvConfig(autoreset_mode="Disabled", envs_per_worker=envs_per_worker)
    with StreamingVectorEnv([_scripted(episode_len=2)] * 2, config) as venv:
        venv.reset(seeds=[0, 1])
        results = venv.step([0, 1], [action, action + "x"])
        direct = ScriptedTextEnv(episode_len=2)
        direct.reset(seed=1)
        assert results[1].obs == direct.step(action + "x")[0]
        assert len(results[0].obs) > len(action)


@pytest.mark.parametrize("backend", BACKENDS)
def test_env_seconds_is_the_time_spent_inside_the_env(backend: str) -> None:
    latency = 0.03
    config = VectorEnvConfig(backend=backend, autoreset_mode="Disabled")
    with StreamingVectorEnv([_scripted(latency=latency)], config) as venv:
        venv.reset(seeds=0)
        start = time.perf_counter()
        (result,) = venv.step([0], ["a"])
        waited = time.perf_counter() - start
    assert latency <= result.env_seconds <= waited


def test_channel_drops_a_frame_cut_off_by_the_peers_death() -> None:
    """A worker killed while sending leaves half a frame: no message comes out of it, then EOF."""
    left, right = socket.socketpair()
    receiver = _Channel(right)
    _Channel(left).send("whole")
    frame = pickle.dumps("cut off" * 1000)
    left.sendall(struct.pack("!Q", len(frame)) + frame[: len(frame) // 2])
    left.close()
    select.select([receiver], [], [], 5.0)
    assert receiver.recv_ready() == ["whole"]
    with pytest.raises(EOFError):
        receiver.recv_ready()
    receiver.close()
