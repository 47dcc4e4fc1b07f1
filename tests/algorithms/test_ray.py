"""Scale-out on Ray (issue 16): env workers and rollout engines as Ray actors, placement as configuration.

One local Ray cluster of 2 CPUs serves the whole module; actors ask for fractions of a CPU so that two
engines and a few env actors fit on it. The trainer runs are those of ``test_train.py`` (the ``primed`` tiny
model, whose rewards vary, Math-TIR, 16 new tokens a turn, 4 episodes an update):

- the Ray env backend keeps the vector env's contract: every episode comes back exactly once through crashes
  (SIGKILL), ``ray.kill``, hangs past ``step_timeout`` and env exceptions;
- a rollout engine's vLLM backend (CPU) in a Ray actor serves the published adapter: the probe check passes and
  its greedy tokens are the adapted model's;
- a synchronous run (``max_staleness=0``) with Ray env actors and two rollout engines trains what the local
  run trains: the same tickets in the same updates, the same sampled tokens and rewards; its log-probs,
  losses and weights agree to 1e-4, not bit for bit, because two engines compute each prompt in a smaller
  batch than one local engine does, and a row's float results depend on the batch it is computed in (padding
  width, kernel choice: measured ~1e-6 on a log-prob);
- killing an env actor and a rollout engine mid-run loses no episode: both failures come back marked
  (``error_kind`` ``crash`` and ``engine``), the ledger closes in every row, every dispatched ticket is
  trained, failed, buffered or in flight exactly once, and the replacement engine serves the current policy;
- a learner rank in a Ray actor (``RayRanks``) makes the single-rank update on the same batch, as a rank in a
  spawned process does (``test_learner_ddp.py``); a trainer run with ``learner_ranks=2`` on Ray trains, and
  killing its rank actor stops the run with the rank's death (never a hang, never a silently dropped rank),
  after which ``resume`` continues from the last checkpoint with a new rank;
- bad placement config fails before any work with a message naming the value.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from helpers import (
    EPISODE_LEN,
    QUIET,
    assert_exactly_once,
    assert_ledger_closes,
    assert_same_update,
    drive_episodes,
    max_abs_diff,
    run_config,
    scripted_env,
    spec_for,
    start,
    train_both,
)
from streamrl.agents.base import SamplingParams
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.probe import AdapterMismatchError, read_adapter_probe, write_adapter_probe
from streamrl.agents.ray_engines import RayEngines
from streamrl.algorithms.base import Episode, make_algorithm
from streamrl.algorithms.distributed import DistributedLearner
from streamrl.algorithms.learner import LearnerConfig
from streamrl.algorithms.ray_ranks import RayRank, RayRanks
from streamrl.algorithms.runtime import Finished
from streamrl.algorithms.train import ConfigError, TrainConfig, Trainer
from streamrl.envs.vector import StreamingVectorEnv, SubEnvState, VectorEnvConfig
from streamrl.utils.ray import local_ray_options, node_address

pytestmark = pytest.mark.timeout(300)

SMALL = {"num_cpus": 0.25}
"""Ray resources of one env actor here (the cluster has 2 CPUs)."""


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", **local_ray_options())
    yield
    ray.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Ray env workers: the vector env's contract
# ---------------------------------------------------------------------------------------------------------


def test_ray_env_workers_return_every_episode_once_through_crashes_hangs_and_raises() -> None:
    """6 envs on 3 actors, each failing env next to a healthy one: env 1 raises at step 2, env 3 hangs at step
    2 against a 1 s step timeout, env 4 SIGKILLs its own actor process at step 3 (a crash Ray reports as the
    actor's death)."""
    factories = [
        scripted_env(),
        scripted_env(fault="raise", fault_step=2),
        scripted_env(),
        scripted_env(fault="hang", fault_step=2),
        scripted_env(fault="die", fault_step=3),
        scripted_env(),
    ]
    config = VectorEnvConfig(
        backend="ray", envs_per_worker=2, step_timeout=1.0, ray_actor_options=SMALL, max_start_failures=20
    )
    venv = StreamingVectorEnv(factories, config)
    try:
        run = drive_episodes(venv, episodes=30, kill_every=0, rng=random.Random(7))
        assert_exactly_once(run)
        assert len(run["started"]) == 30
        assert set(run["kinds"]) == {"exception", "crash", "timeout"}, run["kinds"]
        assert all(venv.state(i) is SubEnvState.NEEDS_RESET for i in range(venv.num_envs))
    finally:
        venv.close()


def test_ray_kill_of_an_env_actor_ends_its_episodes_once(tmp_path: Path) -> None:
    """The contract behind the chaos test, with ``ray.kill``: the killed actor's in-flight episode comes back
    at recv, its episode that awaited an action comes back at that env's next send; both exactly once."""
    held = scripted_env(fault="gate", fault_step=2, gate_path=str(tmp_path / "never"))
    factories = [held, scripted_env(), scripted_env()]
    config = VectorEnvConfig(backend="ray", envs_per_worker=2, ray_actor_options=SMALL)
    with StreamingVectorEnv(factories, config) as venv:
        first = venv.reset()
        venv.step([0, 1, 2], ["a", "a", "a"])
        venv.send([0], ["b"])  # held at its gate: in flight when the actor dies
        pid = venv.worker_pids()[0]
        ray.kill(venv._books[0].worker.actor)
        (r0,) = venv.recv(timeout=30)
        assert (r0.env_id, r0.truncated, r0.info["error_kind"], r0.step) == (0, True, "crash", 2)
        assert "ray.kill" in r0.error and r0.episode_id == first[0].episode_id
        venv.send([1, 2], ["b", "b"])  # env 1 lived in the killed actor, env 2 did not
        by_env = {r.env_id: r for r in venv.recv(timeout=30, min_ready=2)}
        assert by_env[1].info["error_kind"] == "crash" and by_env[1].step == 2
        assert by_env[1].episode_id == first[1].episode_id
        assert by_env[2].error is None and by_env[2].step == 2
        assert venv.restarts == 1
        fresh = venv.reset([0, 1], timeout=60)
        assert all(r.error is None for r in fresh) and venv.worker_pids()[0] not in (None, pid)
        assert len(fresh[0].obs) > 0 and EPISODE_LEN == 3
        assert _threads(venv._books[0].worker.actor) == ("1", 1)


def _threads(actor: Any) -> tuple[str | None, int]:
    """An actor's OMP_NUM_THREADS and torch's thread count, asked inside it with ``__ray_call__`` (a local
    function travels by value: actors cannot import this test module). Asserts it runs at the trainer's
    priority: Ray's default niceness 15 starves actors next to a busy trainer (``WORKER_NICENESS``)."""

    def ask(_: Any) -> tuple[str | None, int, int]:
        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), os.nice(0)

    omp, threads, niceness = ray.get(actor.__ray_call__.remote(ask))
    assert niceness == os.nice(0)
    return omp, threads


def test_a_ray_instance_streamrl_starts_runs_workers_at_normal_priority() -> None:
    assert local_ray_options(None) == {"_system_config": {"worker_niceness": 0}}
    assert local_ray_options("auto") == {}  # an existing cluster's settings are its own (docs/scaling.md)


# ---------------------------------------------------------------------------------------------------------
# Rollout engines: publication checked on every engine
# ---------------------------------------------------------------------------------------------------------


def test_every_engine_must_serve_the_published_version(tmp_path: Path) -> None:
    """Full weights published with the probe file the trainer writes: served by both engines. The same
    weights with a wrong probe file: the engine that sees the mismatch is named and the version is not
    confirmed."""
    weights = tmp_path / "v1"
    shutil.copytree(resolve_model("tiny"), weights)
    local = HFBackend(weights, config=HFBackendConfig(device="cpu"))
    probe = local.tokenizer.encode("What is 6 times 7? The answer is 42.")
    expected = local.score([probe], [1])[0]
    write_adapter_probe(weights, probe, expected)
    with RayEngines(
        "tiny", HFBackendConfig(device="cpu"), engines=2, actor_options={"num_cpus": 0.5}
    ) as engines:
        assert [_threads(actor) for actor in engines.actors] == [("1", 1)] * 2
        engines.set_weights(weights, 1)
        assert engines.adapter_version == 1
        served = [ray.get(actor.score.remote([probe], [1]))[0] for actor in engines.actors]
        assert all(max_abs_diff(s, expected) < 1e-5 for s in served)

        write_adapter_probe(weights, probe, [x - 0.5 for x in expected])
        with pytest.raises(
            AdapterMismatchError, match=r"rollout engine 0 .* does not serve the published policy v2"
        ):
            engines.set_weights(weights, 2)
        assert engines.adapter_version == 1

        prompts = [probe[:5], probe[:7], probe[:3]]
        params = SamplingParams(max_new_tokens=6)
        routed = engines.generate(prompts, params, seeds=[1, 2, 3])
        alone = local.generate(prompts, params, seeds=[1, 2, 3])
        assert [g.token_ids for g in routed] == [g.token_ids for g in alone]
    local.close()


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the `vllm` extra)"
)
def test_a_vllm_engine_in_a_ray_actor_serves_the_published_adapter(tmp_path: Path) -> None:
    """A rollout engine's other backend: vLLM (CPU) in a Ray actor loads the adapter the learner publishes,
    passes the probe check, and generates what the adapted model generates greedily."""
    import psutil
    from helpers import adapter_logprobs, make_adapter
    from streamrl.agents.vllm_backend import VLLMBackendConfig

    adapter = tmp_path / "v1"
    model = make_adapter(adapter, seed=1)
    tokenizer = load_tokenizer(resolve_model("tiny"))
    probe = tokenizer.encode("What is 6 times 7? The answer is 42.")
    write_adapter_probe(adapter, probe, adapter_logprobs(model, probe))
    prompts = [probe[:5], probe[:9]]
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    with RayEngines("tiny", VLLMBackendConfig(), engines=1, actor_options={"num_cpus": 1}) as engines:
        info = ray.get(engines.actors[0].describe.remote())
        assert any(p.name().startswith("VLLM") for p in psutil.Process(info["pid"]).children(recursive=True))
        engines.set_adapter(
            str(adapter), 1
        )  # raises unless the engine's probe log-probs are the published ones
        assert engines.adapter_version == 1
        served = engines.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0), seeds=[1, 2])
        assert [g.token_ids for g in served] == expected and all(g.adapter_version == 1 for g in served)


# ---------------------------------------------------------------------------------------------------------
# The trainer on Ray
# ---------------------------------------------------------------------------------------------------------


def ray_config(config: TrainConfig, out: Path, **overrides: Any) -> TrainConfig:
    """``config`` placed on the module's Ray cluster: two env actors and two rollout engines."""
    placement = dict(
        out=str(out),
        cluster="ray",
        env_workers="subprocess",
        env_actors=2,
        env_actor_cpus=SMALL["num_cpus"],
        rollout_engines=2,
        engine_cpus=0.5,
    )
    return replace(config, **{**placement, **overrides})


def test_synchronous_run_on_ray_trains_what_the_local_run_trains(primed: Path, tmp_path: Path) -> None:
    config = run_config(tmp_path / "local", primed, algo="spo", max_staleness=0, tasks=8, updates=3)
    local = start(config)
    local.trainer.run()
    on_ray = start(ray_config(config, tmp_path / "ray"))
    assert isinstance(on_ray.trainer.backend, RayEngines) and on_ray.trainer.overlap
    on_ray.trainer.run()

    rows, ref = on_ray.rows, local.rows
    assert_ledger_closes(rows)
    assert len(rows) == len(ref) == config.updates
    for key in ("batch/dispatch_indices", "batch/task_ids", "batch/success", "batch/reward", "batch/turns"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    assert [r["batch/action_tokens"] for r in rows] == [r["batch/action_tokens"] for r in ref]
    assert any(r["batch/reward"] > 0 for r in ref), "precondition: some reward, so the weights move"
    for ours, theirs in zip(on_ray.updates, local.updates, strict=True):
        for a, b in zip(ours.episodes, theirs.episodes, strict=True):
            assert a.ticket.dispatch_index == b.ticket.dispatch_index
            for s, t in zip(a.trajectory.sequences, b.trajectory.sequences, strict=True):
                assert s.token_ids == t.token_ids and s.action_mask == t.action_mask
                assert s.token_versions == t.token_versions
                diffs = [
                    abs(x - y)
                    for x, y, m in zip(s.rollout_logprobs, t.rollout_logprobs, s.action_mask, strict=True)
                    if m
                ]
                assert max(diffs, default=0.0) < 1e-4
    for key in ("learner/loss", "learner/grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6), key
    for name, value in on_ray.weights.items():
        torch.testing.assert_close(value, local.weights[name], rtol=0, atol=1e-4)
    assert any(not torch.equal(local.initial[k], v) for k, v in local.weights.items())


def test_killing_an_env_actor_and_a_rollout_engine_mid_run_loses_no_episode(
    primed: Path,
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path / "local", primed, algo="spo", max_staleness=1, tasks=8, updates=4)
    run = start(ray_config(config, tmp_path / "ray"))
    trainer = run.trainer
    engines = trainer.backend
    assert isinstance(engines, RayEngines)
    failures: list[Finished] = []
    killed: dict[str, Any] = {}
    checked: list[int] = []

    def kill_at_second_update(version: int, batch: Any) -> None:
        if killed or trainer.updates < 1:
            return
        # Work is still to be dispatched (update 2 of 4). Env actor 0 hosts sub-envs 0 and 1, which new jobs
        # take first (the lowest free ids), and engine 0 is in every generate call (each prompt goes to the
        # least loaded engine, ties to the lower index): both deaths are met, whatever is in flight now.
        assert trainer.venv.worker_of(0) == 0 and trainer.venv.worker_of(1) == 0
        killed["env"], killed["engine"] = trainer.venv._books[0].worker.actor, engines.actors[0]
        ray.kill(killed["env"])
        ray.kill(killed["engine"])

    poll = trainer.rollouts.poll

    def watched_poll(timeout: float | None = None, on_finished: Any = None) -> list[Finished]:
        finished = poll(timeout=timeout, on_finished=on_finished)
        failures.extend(f for f in finished if f.trajectory.info.get("error") is not None)
        if engines.restarts > len(checked):  # a replacement is up: it serves the current policy
            published = read_adapter_probe(trainer.run_dir / "policy" / f"v{engines.adapter_version}")
            assert published is not None and engines.adapter_version >= 1
            probe, expected = published
            for actor in engines.actors:
                assert max_abs_diff(ray.get(actor.score.remote([probe], [1]))[0], expected) < 1e-4
            checked.append(engines.adapter_version)
        return finished

    trainer.on_update = kill_at_second_update
    trainer.rollouts.poll = watched_poll  # type: ignore[method-assign]
    trainer.run()

    rows = run.rows
    assert_ledger_closes(rows)
    assert [r["update"] for r in rows] == list(range(1, config.updates + 1))
    kinds = Counter(f.trajectory.info["error_kind"] for f in failures)
    assert kinds["engine"] >= 1 and kinds["crash"] >= 1, kinds
    assert engines.restarts == 1 and checked and trainer.venv.restarts >= 1
    for f in failures:
        if f.trajectory.info["error_kind"] == "engine":
            assert (
                "rollout engine 0" in f.trajectory.info["error"] and "ray.kill" in f.trajectory.info["error"]
            )
    assert rows[-1]["ledger/failed"] == len(failures) and rows[-1]["ledger/dropped_stale"] == 0
    # every dispatched ticket: trained, failed, buffered or in flight at the end, exactly once
    trained = [i for r in rows for i in r["batch/dispatch_indices"]]
    failed = [f.job.ticket.dispatch_index for f in failures]
    buffered = [e.ticket.dispatch_index for e in trainer.buffer]
    in_flight = [job.ticket.dispatch_index for job in trainer.rollouts.running + trainer.queued]
    everything = trained + failed + buffered + in_flight
    assert sorted(everything) == list(range(rows[-1]["ledger/dispatched"]))


# ---------------------------------------------------------------------------------------------------------
# Learner ranks as Ray actors
# ---------------------------------------------------------------------------------------------------------


def kill_and_wait(actor: Any) -> None:
    """``ray.kill`` an actor and wait until Ray reports it dead (``ray.kill`` returns before)."""
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(600):
            ray.get(actor.ping.remote(), timeout=30)
            time.sleep(0.1)


def placement_groups() -> list[str]:
    """The states of the cluster's placement groups."""
    return [group["state"] for group in ray.util.placement_group_table().values()]


def test_a_learner_rank_in_a_ray_actor_makes_the_single_rank_update(episodes: list[Episode]) -> None:
    """Rank 1 in a Ray actor, the rendezvous at this node's Ray address: the gradients, weights and metrics
    of the single-rank update (``test_learner_ddp.assert_same_update``), equal replicas, and a rank killed
    between updates fails the next update with its death."""
    algorithm = make_algorithm("spo++")
    advantages = [float(a) for a in algorithm.advantages(episodes)]
    ranks = RayRanks(num_cpus=0.5)
    init_method = ranks.init_method()
    assert init_method.startswith(f"tcp://{node_address()}:")  # reachable from other nodes, not 127.0.0.1
    one, two, learner = train_both(
        spec_for("spo++"), episodes, advantages, algorithm, start_rank=ranks, init_method=init_method
    )
    try:
        assert_same_update(one, two)
        (handle,) = learner._ranks
        assert isinstance(handle, RayRank) and handle.info["node"] == node_address()
        assert handle.info["pid"] != os.getpid() and handle.info["niceness"] == os.nice(0)
        digests = learner.digests()
        assert digests[0] == digests[1]
        assert ranks.placement_group is not None and "CREATED" in placement_groups()
        kill_and_wait(handle.actor)
        with pytest.raises(RuntimeError, match=r"learner rank 1 \(Ray actor, node .*\) died: .*ray\.kill"):
            learner.update(episodes, advantages, algorithm)
    finally:
        learner.close()
    assert ranks.placement_group is None and "CREATED" not in placement_groups()  # the reservation is freed


def test_learner_ranks_the_cluster_cannot_hold_do_not_start(tmp_path: Path) -> None:
    """All ranks are placed up front, or the start fails with what was asked (nothing is left reserved)."""
    from streamrl.agents.models import load_model

    spec = spec_for("spo++")
    with pytest.raises(RuntimeError, match=r"could not place 2 learner rank\(s\) of \{'CPU': 1\.5\}"):
        ranks = RayRanks(num_cpus=1.5, start_timeout_s=2.0)  # two ranks of 1.5 CPUs: the cluster has 2
        DistributedLearner(
            load_model(spec.model_dir), spec, 3, init_method=ranks.init_method(), start_rank=ranks
        )
    assert "CREATED" not in placement_groups() and "PENDING" not in placement_groups()
    with pytest.raises(ValueError, match=r"num_gpus must be 0 \(CPU ranks\) or 1 .*, got 2"):
        RayRanks(num_gpus=2)


def test_killing_a_learner_rank_actor_stops_the_run_and_resume_continues(tmp_path: Path) -> None:
    """``learner_ranks=2`` on Ray, a checkpoint after every update: the rank's actor is killed before update
    2; the run stops with the rank's death (its ledger closed up to update 1), and resuming it trains updates 2
    and 3 with a new rank actor."""
    config = ray_config(
        run_config(tmp_path / "local", model="tiny", updates=3, checkpoint_every=1),
        tmp_path / "ray",
        rollout_engines=1,
        learner_ranks=2,
        learner_cpus=0.5,
    )
    run = start(config)
    trainer = run.trainer
    assert isinstance(trainer.learner, DistributedLearner)
    (handle,) = trainer.learner._ranks
    assert isinstance(handle, RayRank)
    killed = handle.actor

    def kill_before_second_update(version: int, batch: Any) -> None:
        if trainer.updates == 1:
            kill_and_wait(killed)

    trainer.on_update = kill_before_second_update
    with pytest.raises(RuntimeError, match=r"learner rank 1 \(Ray actor.*died"):
        trainer.run()
    assert [r["update"] for r in run.rows] == [1]
    assert_ledger_closes(run.rows)

    resumed = start(config, resume=True)
    assert resumed.trainer.updates == 1
    (fresh,) = resumed.trainer.learner._ranks  # type: ignore[attr-defined]
    assert isinstance(fresh, RayRank) and fresh.actor != killed
    resumed.trainer.run()
    assert [r["update"] for r in resumed.rows] == [1, 2, 3]
    assert_ledger_closes(resumed.rows)
    assert "CREATED" not in placement_groups()


# ---------------------------------------------------------------------------------------------------------
# Placement config: bad values fail before any work
# ---------------------------------------------------------------------------------------------------------

BAD = [
    pytest.param({"cluster": "slurm"}, "cluster must be 'local' or 'ray', got 'slurm'", id="unknown-cluster"),
    pytest.param(
        {"cluster": "ray", "rollout_engines": 0}, "rollout_engines must be >= 1, got 0", id="no-engines"
    ),
    pytest.param(
        {"rollout_engines": 2, "address": "auto"},
        "address='auto', rollout_engines=2 apply to cluster='ray' only",
        id="ray-knobs-on-local",
    ),
    pytest.param(
        {"cluster": "ray", "env_actors": 3},
        "env_actors=3 must divide num_envs=4",
        id="env-actors-not-divisor",
    ),
    pytest.param(
        {"cluster": "ray", "env_workers": "inprocess"},
        "env_workers='inprocess' is for cluster='local'",
        id="inprocess",
    ),
    pytest.param(
        {"cluster": "ray", "engine_gpus": -1.0}, "engine_gpus must be >= 0, got -1.0", id="negative-gpus"
    ),
    pytest.param(
        {"learner_ranks": 2, "learner_cpus": 2.0},
        "learner_cpus=2.0 apply to cluster='ray' only",
        id="learner-cpus-on-local",
    ),
    pytest.param(
        {"cluster": "ray", "learner_ranks": 2, "learner_gpus": 2},
        r"learner_gpus must be 0 \(CPU ranks\) or 1 .*got 2",
        id="two-gpus-per-rank",
    ),
    pytest.param(
        {"cluster": "ray", "learner_ranks": 2, "learner_cpus": 0.0},
        "learner_cpus must be > 0",
        id="rank-without-cpus",
    ),
    pytest.param(
        {"cluster": "ray", "learner_gpus": 1},
        r"learner_gpus=1 are the resources of learner ranks 1..R-1 .*learner_ranks=1",
        id="rank-resources-without-ranks",
    ),
    pytest.param(
        {"cluster": "ray", "learner_ranks": 2, "learner_gpus": 1, "learner": LearnerConfig(device="cpu")},
        r"learner_gpus\) gives each learner rank a GPU, but rank 0 \(this process\) runs on the CPU",
        id="gpu-ranks-cpu-rank-0",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_placement_fails_before_any_work(overrides: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        workers = "subprocess" if overrides.get("cluster") == "ray" else "inprocess"
        config = run_config(tmp_path / "run", **{"model": "tiny", "env_workers": workers, **overrides})
        Trainer(config, progress=False, log=QUIET)
    assert not (tmp_path / "run").exists()


def test_placement_flags_come_from_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.cli.main import main, parse_train_args

    flags = ["--out", str(tmp_path / "run"), "--cluster", "ray", "--address", "10.0.0.1:6379"]
    ranks = ["--learner-ranks", "2", "--learner-cpus", "8", "--learner-gpus", "1"]
    _, config = parse_train_args(
        [*flags, "--rollout-engines", "6", "--env-actors", "4", "--engine-gpus", "1", *ranks]
    )
    assert (
        config.cluster,
        config.address,
        config.rollout_engines,
        config.env_actors,
        config.engine_gpus,
        config.learner_ranks,
        config.learner_cpus,
        config.learner_gpus,
    ) == ("ray", "10.0.0.1:6379", 6, 4, 1.0, 2, 8.0, 1)
    with pytest.raises(SystemExit):
        main(["train", "--out", str(tmp_path / "run"), "--cluster", "slurm"])
    assert "invalid choice: 'slurm'" in capsys.readouterr().err
