"""``RolloutSession``: a kept session plays a job as a fresh one does, and the runtime plays any ``Agent``.

Real components: the real Math-TIR env and its tool sandbox in worker processes, the base ``tiny`` model, the
env's scripted expert (an ``Agent`` with ``act`` and ``end_episode`` only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import QUIET, assert_ledger_closes, run_config, update_rows
from streamrl.agents.base import SamplingParams, derive_seed
from streamrl.agents.env_specs import make_env
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.models import resolve_model
from streamrl.agents.rollout import play_episode
from streamrl.algorithms.runtime import Job, Rollouts, collect
from streamrl.algorithms.session import RolloutSession, env_hosting
from streamrl.algorithms.train import Trainer
from streamrl.algorithms.train_config import ConfigError
from streamrl.envs.vector import VectorEnvConfig
from streamrl.evaluation.harness import EvalConfig


def _played(trajectory: Any) -> dict[str, Any]:
    """A trajectory's content without its wall-clock timings."""
    data = trajectory.to_dict()
    data.pop("timings")
    for turn in data["turns"]:
        turn.pop("generation_seconds")
    return data


def test_a_kept_session_plays_every_evaluation_as_a_fresh_session_does() -> None:
    # Two evaluations through one session (its worker processes and sandboxes kept, one sub-env per worker) and
    # one through a fresh session hosted as Math-TIR's default (its three sub-envs in one worker, sharing its
    # sandboxes): the same jobs, agent seeds and env seeds give the same trajectories, token for token.
    backend = HFBackend(resolve_model("tiny"))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)
    workers = VectorEnvConfig(backend="subprocess")
    try:
        with RolloutSession("math_tir", "test", num_envs=3, workers=workers) as kept:
            jobs = [Job(t, i) for i, t in enumerate(kept.first_tasks(2) * 3)]
            first = kept.play(kept.llm_agent(backend, sampling), jobs, seed=11)
            pids = kept.venv.worker_pids()
            second = kept.play(kept.llm_agent(backend, sampling), jobs, seed=11)
            assert kept.venv.worker_pids() == pids  # the same live workers played again
        assert len(pids) == 3
        with RolloutSession("math_tir", "test", num_envs=3) as fresh:
            third = fresh.play(fresh.llm_agent(backend, sampling), jobs, seed=11)
            assert len(fresh.venv.worker_pids()) == 1
    finally:
        backend.close()
    assert [f.job for f in first] == jobs
    assert sum(f.trajectory.num_action_tokens for f in first) > 0
    assert [_played(f.trajectory) for f in second] == [_played(f.trajectory) for f in first]
    assert [_played(f.trajectory) for f in third] == [_played(f.trajectory) for f in first]


def test_env_hosting_takes_the_envs_default_unless_a_run_names_one(tmp_path: Path) -> None:
    assert env_hosting("math_tir").envs_per_worker == 8  # EnvSpec.envs_per_worker
    assert env_hosting("alfworld").envs_per_worker == 1
    assert env_hosting("math_tir", "inprocess", 2) == VectorEnvConfig(backend="inprocess", envs_per_worker=2)
    with pytest.raises(
        ValueError, match=r"envs_per_worker must be >= 1 \(or None: the env's default\), got 0"
    ):
        EvalConfig(agent="expert", envs_per_worker=0)
    bad = {"-1": r"envs_per_worker must be >= 1 .*, got -1", "2": "envs_per_worker=2 is for cluster='local'"}
    for per, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            hosting = {"cluster": "ray", "env_workers": "subprocess"} if per == "2" else {}
            config = run_config(tmp_path / "run", envs_per_worker=int(per), **hosting)
            Trainer(config, progress=False, log=QUIET)
        assert not (tmp_path / "run").exists()


def test_first_tasks_names_the_valid_range() -> None:
    session = RolloutSession("math_tir", "test", num_envs=1)
    n = len(session.task_ids)
    assert session.first_tasks(2) == session.task_ids[:2]
    with pytest.raises(ValueError, match=rf"tasks={n + 1} must be in \[1, {n}\]"):
        session.first_tasks(n + 1)
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.venv  # noqa: B018


def test_a_scripted_agent_plays_through_the_runtime_as_it_plays_alone() -> None:
    # The expert keeps no record; the runtime records its turns. Each episode equals the one play_episode plays
    # with the same env seed: the same actions, observations, verdicts and outcome.
    with RolloutSession(
        "math_tir", "train", num_envs=2, workers=VectorEnvConfig(backend="inprocess")
    ) as session:
        tasks = session.first_tasks(3)
        jobs = [Job(t, 10 + i) for i, t in enumerate(tasks)]
        done = collect(Rollouts(session.venv, session.expert(), seed=5, lockstep=True), jobs)
        env = make_env("math_tir", "train")
        try:
            expert = session.expert()
            alone = [
                play_episode(
                    env, expert, seed=derive_seed(5, "env", job.key), options={"task_id": job.task_id}
                )
                for job in jobs
            ]
        finally:
            env.close()
    assert [d.trajectory.won for d in done] == [a.won for a in alone]
    assert any(a.won for a in alone)
    for item, result in zip(done, alone, strict=True):
        trajectory = item.trajectory
        assert trajectory.task_id == item.job.task_id
        assert trajectory.reward == result.reward
        assert [t.action for t in trajectory.turns] == [t.action for t in result.turns]
        assert [t.observation for t in trajectory.turns] == [t.observation for t in result.turns]
        assert [t.action_valid for t in trajectory.turns] == [t.action_valid for t in result.turns]
        assert trajectory.num_action_tokens == 0


def test_a_held_out_evaluation_of_the_training_split_plays_on_workers_of_its_own(tmp_path: Path) -> None:
    # Evaluating on the training split while training episodes are in flight (max_staleness=1): the evaluation's
    # session has env workers of its own, so the training episodes in flight are neither disturbed nor lost.
    config = run_config(
        tmp_path / "run",
        eval_split="train",
        eval_every=1,
        eval_episodes=4,
        max_staleness=1,
        updates=3,
        tasks=8,
        num_envs=6,
        overlap=True,  # generation goes on while the learner updates: episodes are in flight at evaluations
    )
    trainer = Trainer(config, progress=False, log=QUIET)
    assert trainer.side.session("eval").split == trainer.side.session("train").split == "train"
    assert trainer.side.session("eval") is not trainer.side.session("train")
    trainer.run()
    rows = update_rows(tmp_path / "run")
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert any(r["ledger/in_flight"] > 0 for r in rows), (
        "precondition: training episodes in flight at evaluations"
    )
    assert_ledger_closes(rows)
    assert all(r["eval/episodes"] == 4 for r in rows)
