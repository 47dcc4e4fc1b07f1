"""The trainer (``streamrl train``) end to end on ``tiny``: every algorithm, the synchronous mode's
reproducibility, kill -9 / SIGTERM and resume, staleness, the drain policy, the ledger, publication, the
learner's micro-batching and importance ratio, and bad input (issue 13's "Done when" and "Pitfalls").

Reward variance. An untrained ``tiny`` never solves a task, so every advantage would be 0 and no update could
move the weights, and every episode runs to the turn limit. The ``primed`` model (conftest.py) is ``tiny``
behaviour-cloned on the first eight Math-TIR training tasks, each followed half the time by its right
``\\boxed{}`` answer and half the time by "Let me think.": on each of those tasks it answers at once, and
right, about half the time, and otherwise rambles, mostly to the turn limit (four turns). So rewards vary
within a batch and within a GRPO group, and the episodes of one dispatch end at different times: batches fill
while longer episodes are mid-way, which finish under a newer policy version. The rewards are the env's own
judgments.

Every run checks that the ledger closes in every metrics row. Runs use in-process env workers, 16 new tokens a
turn, 4-8 episodes an update and no evaluation unless the test is about it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import QUIET, Run, assert_ledger_closes, max_abs_diff, run_config, start, update_rows
from streamrl.agents.base import SamplingParams
from streamrl.agents.batch import TokenBatch, collate
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
from streamrl.agents.llm_agent import LLMAgent
from streamrl.agents.logprobs import (
    position_ids_from_mask,
    selected_token_logprobs,
    shared_prefix_length,
    token_logprobs,
)
from streamrl.agents.models import load_model, load_tokenizer, resolve_model, weights_fingerprint
from streamrl.agents.trajectory import TokenSequence, Trajectory
from streamrl.algorithms.base import Episode, PolicyInputs, make_algorithm
from streamrl.algorithms.learner import (
    PASS_TOKENS,
    Learner,
    LearnerConfig,
    TrainingRow,
    length_sorted_chunks,
    prefix_grouped_chunks,
    shard_batch,
    training_rows,
)
from streamrl.algorithms.losses import aggregate_loss, kl_penalty
from streamrl.algorithms.runtime import Job, Rollouts, collect
from streamrl.algorithms.side_rollouts import extend_evenly
from streamrl.algorithms.tracker import EventTracker, Ticket
from streamrl.algorithms.train import ConfigError, PublishError, TrainConfig, Trainer
from streamrl.utils.stats import clustered_t_interval, t_interval

# ---------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------


def updates_written(run_dir: Path) -> list[int]:
    """The updates in metrics.jsonl so far, read while a run may be appending to it."""
    path = run_dir / "metrics.jsonl"
    done = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            done.append(int(json.loads(line)["update"]))
        except (ValueError, KeyError):
            continue
    return done


def train(config: TrainConfig, **kwargs: Any) -> Run:
    run = start(config, **kwargs)
    run.trainer.run()
    assert_ledger_closes(run.rows)
    return run


def action_versions(episode: Episode) -> list[int]:
    """The generating policy version of every action token of ``episode``."""
    return [
        v
        for seq in episode.trajectory.sequences
        for v, m in zip(seq.token_versions, seq.action_mask, strict=True)
        if m
    ]


def probe_logprobs(trainer: Trainer, backend: HFBackend) -> list[float]:
    return backend.score([trainer.probe], [1])[0]


def served_backend(trainer: Trainer, version: int) -> HFBackend:
    """A fresh backend serving the published policy ``version`` from disk, as a resumed run or vLLM would."""
    path = trainer.run_dir / "policy" / f"v{version}"
    cpu = HFBackendConfig(device="cpu")
    if trainer.learner.finetune == "lora":
        backend = HFBackend(trainer.model_dir, tokenizer=trainer.tokenizer, config=cpu)
        backend.set_adapter(path, version)
        return backend
    return HFBackend(path, tokenizer=trainer.tokenizer, config=cpu)


def learner_probe(trainer: Trainer) -> list[float]:
    ids = torch.tensor([trainer.probe])
    with torch.no_grad():
        return token_logprobs(trainer.learner.model, ids, torch.ones_like(ids))[0].tolist()


# ---------------------------------------------------------------------------------------------------------
# 1. Each algorithm end to end
# ---------------------------------------------------------------------------------------------------------

END_TO_END = [
    pytest.param("spo", "math_tir", {}, id="spo-math_tir"),
    pytest.param("spo++", "math_tir", {}, id="spo++-math_tir"),
    pytest.param(
        "spo++", "math_tir", {"learner": LearnerConfig(finetune="lora", lr=1e-3)}, id="spo++-lora-math_tir"
    ),
    pytest.param(
        "grpo",
        "math_tir",
        {"algorithm": {"group_size": 4}, "tasks": 1, "batch": 8, "num_envs": 8},
        id="grpo-math_tir",
    ),
    pytest.param("sao", "math_tir", {"algorithm": {"warmup_updates": 1}, "updates": 3}, id="sao-math_tir"),
    # ALFWorld: the untrained tiny (it never wins); SPO++'s advantages vary with the tasks' baselines once the
    # tracker has filed the first batch. Three steps an episode keep the learner's ~700-token turns CI-sized.
    pytest.param(
        "spo++",
        "alfworld",
        {"model": "tiny", "tasks": 8, "env_kwargs": {"max_steps": 3}},
        id="spo++-alfworld",
    ),
    pytest.param(
        "spo", "alfworld", {"model": "tiny", "tasks": 8, "env_kwargs": {"max_steps": 3}}, id="spo-alfworld"
    ),
    # Actions constrained to the admissible commands, none twice from one state: the learner scores the
    # renormalized policy over the reduced choices the rollouts sampled (the first update's importance ratio is
    # 1 only then)
    pytest.param(
        "spo++",
        "alfworld",
        {
            "model": "tiny",
            "tasks": 8,
            "env_kwargs": {"max_steps": 3},
            "constrain_actions": True,
            "avoid_repeats": True,
        },
        id="spo++-alfworld-constrained",
    ),
    # SAO's advantages come from its critic's values, non-zero before any win
    pytest.param(
        "sao",
        "alfworld",
        {
            "model": "tiny",
            "tasks": 8,
            "env_kwargs": {"max_steps": 3},
            "algorithm": {"warmup_updates": 1},
            "updates": 3,
        },
        id="sao-alfworld",
    ),
]


@pytest.mark.parametrize(("algo", "env", "overrides"), END_TO_END)
def test_each_algorithm_trains_end_to_end(
    algo: str, env: str, overrides: dict[str, Any], primed: Path, tmp_path: Path
) -> None:
    config = run_config(tmp_path / "run", **{"model": primed, "algo": algo, "env": env, **overrides})
    run = train(config)
    trainer, rows = run.trainer, run.rows
    publish_every = trainer.algorithm.config.publish_every

    assert [r["update"] for r in rows] == list(range(1, config.updates + 1))
    for row in rows:
        losses = {
            k: v for k, v in row.items() if k.startswith("learner/") and k.endswith(("loss", "grad_norm"))
        }
        assert all(math.isfinite(v) for v in losses.values()), losses
        assert row["published"] == (row["version"] if row["update"] % publish_every == 0 else None)
    policy_rows = [r for r in rows if r["learner/policy_trained"]]  # SAO: after its critic-only warm-up
    assert len(policy_rows) == len(run.updates) >= 1
    # versions advance with publication; the tracker filed every trained outcome
    assert trainer.tracker.version == config.updates // publish_every >= 1
    assert [r["version"] for r in rows] == [u // publish_every for u in range(1, config.updates + 1)]
    assert sum(trainer.tracker.task_stats(t).recorded for t in trainer.task_ids) >= rows[-1]["ledger/trained"]
    # rollouts and the side rollouts (offline values, evaluation) play the configured policy
    for agent in (trainer.agent, trainer.side.agent(1.0, 0)):
        assert (agent.constrain_actions, agent.avoid_repeats) == (
            config.constrain_actions,
            config.avoid_repeats,
        )
    # no policy step in between: the first update's importance ratio pi_old / pi_rollout is 1 on every token
    assert policy_rows[0]["learner/is_log_weight_abs"] < 1e-5
    # the HF backend's prefix cache counts every prompt it ran, cumulatively
    lookups = [r["generation/prefix_hits"] + r["generation/prefix_misses"] for r in rows]
    assert lookups == sorted(lookups) and lookups[0] > 0

    # the policy moved -- which needs a non-zero advantage, so that is asserted first
    assert any(a != 0 for u in run.updates for a in u.advantages), "precondition: some advantage is non-zero"
    assert any(not torch.equal(run.initial[k], v) for k, v in run.weights.items())

    # the last update published: a fresh backend serving it from disk gives the learner's log-probs on the probe,
    # and they are not the initial model's
    served = probe_logprobs(trainer, served_backend(trainer, trainer.tracker.version))
    mine = learner_probe(trainer)
    initial = probe_logprobs(trainer, HFBackend(trainer.model_dir, tokenizer=trainer.tokenizer))
    assert max_abs_diff(served, mine) < 1e-4
    assert max_abs_diff(initial, mine) > 1e-4


def test_grpo_runs_on_alfworld(tmp_path: Path) -> None:
    # The untrained tiny never wins an ALFWorld game, so every GRPO group has equal rewards and zero advantages
    # (there is no update to see); what is checked is that complete groups form batches, publish and close the
    # books on the real engine.
    config = run_config(
        tmp_path / "run",
        algo="grpo",
        env="alfworld",
        tasks=8,
        batch=8,
        num_envs=8,
        env_kwargs={"max_steps": 3},
        algorithm={"group_size": 4},
    )
    run = train(config)
    rows = run.rows
    assert [r["version"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["learner/loss"]) for r in rows)
    for update in run.updates:  # whole groups: each task appears G times
        assert sorted(Counter(e.task_id for e in update.episodes).values()) == [4, 4]
    assert_ledger_closes(rows)


# ---------------------------------------------------------------------------------------------------------
# 2-3. The synchronous mode: reproducible bit for bit, also across kill -9 and SIGTERM + resume
# ---------------------------------------------------------------------------------------------------------


def sync_config(out: Path, model: Path) -> TrainConfig:
    """S = 0, publication every update; a checkpoint every 2 updates and only the newest version kept on disk,
    so a kill after update 3 resumes from update 2 while v3 was published and v2 is past retention."""
    return run_config(
        out,
        model,
        algo="spo",
        max_staleness=0,
        tasks=8,
        updates=5,
        checkpoint_every=2,
        keep_versions=1,
    )


@pytest.fixture(scope="module")
def sync_reference(primed: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(sync_config(tmp_path_factory.mktemp("sync") / "run", primed))


def assert_same_training(run_dir: Path, weights: Mapping[str, torch.Tensor], reference: Run) -> None:
    """Same weights bit for bit, the same tickets trained in the same updates, each row written once."""
    rows = update_rows(run_dir)
    assert_ledger_closes(rows)
    ref_rows = reference.rows
    assert [r["update"] for r in rows] == [r["update"] for r in ref_rows]
    assert [r["batch/dispatch_indices"] for r in rows] == [r["batch/dispatch_indices"] for r in ref_rows]
    assert Counter(t for r in rows for t in r["batch/task_ids"]) == Counter(
        t for r in ref_rows for t in r["batch/task_ids"]
    )
    assert [r["learner/loss"] for r in rows] == [r["learner/loss"] for r in ref_rows]
    ref_weights = reference.weights
    assert weights.keys() == ref_weights.keys()
    different = [k for k in weights if not torch.equal(weights[k], ref_weights[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"


def test_synchronous_trainer_is_bitwise_reproducible(
    primed: Path, tmp_path: Path, sync_reference: Run
) -> None:
    assert any(not torch.equal(sync_reference.initial[k], v) for k, v in sync_reference.weights.items())
    again = train(sync_config(tmp_path / "again", primed))
    assert_same_training(again.trainer.run_dir, again.weights, sync_reference)
    trained = [i for r in sync_reference.rows for i in r["batch/dispatch_indices"]]
    assert len(trained) == len(set(trained))


def _cli_flags(config: TrainConfig) -> list[str]:
    """``streamrl train`` flags that give ``config`` (the fields the synchronous runs set)."""
    names = (
        "out",
        "env",
        "model",
        "init",
        "algo",
        "max_staleness",
        "tasks",
        "updates",
        "batch",
        "num_envs",
        "checkpoint_every",
        "keep_versions",
        "offline_rollouts",
        "eval_every",
        "max_new_tokens",
        "env_workers",
    )
    return [f"--{name.replace('_', '-')}={getattr(config, name)}" for name in names]


def test_kill_9_and_resume_continues_bit_for_bit(primed: Path, tmp_path: Path, sync_reference: Run) -> None:
    out = tmp_path / "run"
    config = sync_config(out, primed)
    cli = [sys.executable, "-m", "streamrl.cli", "train"]
    flags = _cli_flags(config)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [*cli, *flags, "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    state = out / "checkpoint" / "state.json"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if state.is_file() and max(updates_written(out), default=0) >= 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read().decode()}"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # killed after update 3 (published v3; retention keeps one version) with the checkpoint at update 2
    assert json.loads(state.read_text())["updates"] == 2
    assert 3 in updates_written(out)

    resumed = subprocess.run(
        [*cli, f"--resume={out}", "--no-progress"], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = torch.load(out / "checkpoint" / "learner.pt", weights_only=False)["learner"]["weights"]
    assert_same_training(out, final, sync_reference)


def test_sigterm_mid_rollout_requeues_in_flight_work_and_keeps_finished_work(
    primed: Path, tmp_path: Path, sync_reference: Run
) -> None:
    # A requeued episode is played again from its first turn, in generation calls without the episodes that
    # had finished. Each (episode, turn) samples with its own seed, so it plays the same tokens as in the
    # uninterrupted run; the log-probs of a smaller batch differ in the last float bits, so the weights are
    # compared to a tolerance (bit for bit when no episode was in flight: the kill -9 test).
    config = sync_config(tmp_path / "run", primed)
    first = start(config)
    trainer = first.trainer
    poll = trainer.rollouts.poll

    def poll_then_signal(timeout: float | None = None, on_finished: Any = None) -> Any:
        finished = poll(timeout=timeout, on_finished=on_finished)
        if trainer.updates >= 1 and finished and trainer.rollouts.running:  # some finished, some mid-way
            os.kill(os.getpid(), signal.SIGTERM)
        return finished

    trainer.rollouts.poll = poll_then_signal  # type: ignore[method-assign]
    handler = signal.getsignal(signal.SIGTERM)
    summary = trainer.run()
    assert summary["interrupted"] and 1 <= summary["updates"] < config.updates
    assert signal.getsignal(signal.SIGTERM) is handler  # the finished run gave the signal back
    state = json.loads((trainer.run_dir / "checkpoint" / "state.json").read_text())
    assert state["updates"] == summary["updates"], state
    requeued = {job["key"] for job in state["in_flight"]}
    kept = {item["ticket"]["dispatch_index"]: item["trajectory"] for item in state["buffer"]}
    assert requeued and kept, "precondition: episodes in flight and finished-but-untrained at the checkpoint"
    assert_ledger_closes(update_rows(trainer.run_dir))

    resumed = train(config, resume=True)
    assert resumed.trainer.updates == config.updates
    rows = update_rows(trainer.run_dir)
    assert [r["update"] for r in rows] == list(range(1, config.updates + 1))
    # every ticket dispatched was trained exactly once: none lost, none counted twice
    trained = [i for r in rows for i in r["batch/dispatch_indices"]]
    assert sorted(trained) == list(range(rows[-1]["ledger/dispatched"]))
    after = {e.ticket.dispatch_index: e for u in resumed.updates for e in u.episodes}
    assert requeued | set(kept) <= set(after)
    for index, trajectory in kept.items():  # trained as it was generated, not played again
        assert json.loads(json.dumps(after[index].trajectory.to_dict())) == trajectory

    assert [r["batch/dispatch_indices"] for r in rows] == [
        r["batch/dispatch_indices"] for r in sync_reference.rows
    ]
    played = {e.ticket.dispatch_index: e for u in first.updates + resumed.updates for e in u.episodes}
    for update in sync_reference.updates:
        for episode in update.episodes:
            again = played[episode.ticket.dispatch_index].trajectory
            assert [s.token_ids for s in again.sequences] == [
                s.token_ids for s in episode.trajectory.sequences
            ]
    for key, value in resumed.weights.items():
        torch.testing.assert_close(value, sync_reference.weights[key], rtol=0, atol=1e-4)


KILL_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from streamrl.cli.main import main

replace = os.replace


def replace_then_die(src, dst):
    replace(src, dst)
    if Path(src).name == "checkpoint":  # the last checkpoint moved aside, the new one not yet in its place
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace_then_die
sys.exit(main())
"""


def test_a_kill_between_the_checkpoint_renames_resumes_from_the_last_checkpoint(
    primed: Path, tmp_path: Path, sync_reference: Run
) -> None:
    # The checkpoint at update 4 replaces the one at update 2; the process is killed by SIGKILL right after
    # checkpoint/ was moved aside, before the new one takes its place
    out = tmp_path / "run"
    config = sync_config(out, primed)
    flags = _cli_flags(config)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_BETWEEN_RENAMES, "train", *flags, "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert updates_written(out) == [1, 2, 3, 4]
    assert not (out / "checkpoint").exists(), "precondition: killed between the renames"
    before = (out / "metrics.jsonl").read_text().splitlines()

    resumed = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "train", f"--resume={out}", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed {out} at update 2" in resumed.stdout, resumed.stdout + resumed.stderr
    # the rows up to update 2 are kept as they were written (their timings would differ if run again)
    kept = [line for line in before if json.loads(line)["update"] <= 2]
    assert [json.loads(line)["update"] for line in kept][-1] == 2
    assert (out / "metrics.jsonl").read_text().splitlines()[: len(kept)] == kept
    final = torch.load(out / "checkpoint" / "learner.pt", weights_only=False)["learner"]["weights"]
    assert_same_training(out, final, sync_reference)


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path: Path) -> None:
    config = run_config(tmp_path / "run", updates=1, offline_rollouts=0)
    train(config)
    shutil.rmtree(tmp_path / "run" / "checkpoint")  # as if killed after writing update 1's row
    again = train(config, resume=True)
    assert [r["update"] for r in again.rows] == [1]


# ---------------------------------------------------------------------------------------------------------
# 5-6. Staleness and the drain policy
# ---------------------------------------------------------------------------------------------------------


def staleness_config(out: Path, model: Path, **overrides: Any) -> TrainConfig:
    """Up to four times as many episodes in flight as a batch takes, of different lengths (one turn or four):
    batches fill while longer episodes are mid-way, which then finish under a newer policy version."""
    return run_config(out, model, tasks=8, num_envs=8, batch=2, updates=6, **overrides)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_trained_tokens_are_at_most_max_staleness_old(
    max_staleness: int, primed: Path, tmp_path: Path
) -> None:
    config = staleness_config(tmp_path / "run", primed, algo="spo", max_staleness=max_staleness)
    runs = [train(config)]
    runs.append(train(replace(config, updates=8), resume=True))
    seen: Counter[int] = Counter()
    for run in runs:
        by_update = {r["update"]: r for r in run.rows}
        for k, update in enumerate(run.updates):
            lags = [update.version - v for e in update.episodes for v in action_versions(e)]
            assert max(lags) <= max_staleness
            seen.update(lags)
            row = by_update[run.first_update + k]
            expected = Counter(update.version - min(action_versions(e)) for e in update.episodes)
            assert row["staleness"] == {str(s): n for s, n in sorted(expected.items())}
    assert runs[1].trainer.updates == 8
    if max_staleness > 0:
        assert max(seen) == max_staleness, f"precondition: the bound is reached ({seen})"


def test_current_version_rule_files_old_work_but_never_trains_it(primed: Path, tmp_path: Path) -> None:
    config = staleness_config(
        tmp_path / "run", primed, algo="spo++", max_staleness=2, algorithm={"publish_every": 1}
    )
    run = train(config)
    trained = {e.ticket.dispatch_index for u in run.updates for e in u.episodes}
    for update in run.updates:
        for episode in update.episodes:  # first completed requests of the current version only
            assert episode.ticket.version == update.version
            assert set(action_versions(episode)) == {update.version}
    # Superseded: dispatched under a version that was published over before a batch took them -- finished
    # after the publication (the receipt's staleness >= 1) or before it and left in the buffer (staleness 0).
    # Each was filed in the tracker once, at its own version (the receipt's ticket), and ledgered as dropped.
    filed = [r.ticket.dispatch_index for _, r in run.receipts]
    assert len(filed) == len(set(filed))
    superseded = [
        r
        for _, r in run.receipts
        if r.ticket.dispatch_index not in trained and r.ticket.version < run.trainer.tracker.version
    ]
    late = [r for r in superseded if r.staleness >= 1]
    assert late and len(late) < len(superseded), "precondition: both kinds of superseded episodes occur"
    assert run.rows[-1]["ledger/dropped_stale"] == len(superseded)


def test_trainable_dispatch_starts_no_episode_the_current_version_rule_would_drop(
    primed: Path, tmp_path: Path
) -> None:
    """SPO++ as published (``dispatch="fill"``) drops the episodes in flight at each publication; with
    ``dispatch="trainable"`` every episode started is trained (or still buffered / in flight at the end), also
    across a resume and with generation overlapping the learner, and each batch is current-version work only."""
    published = staleness_config(
        tmp_path / "fill", primed, algo="spo++", max_staleness=2, algorithm={"publish_every": 1}
    )
    assert train(published).rows[-1]["ledger/dropped_stale"] > 0, "precondition: the published rule drops"
    config = replace(published, out=str(tmp_path / "run"), dispatch="trainable")
    runs = [train(config), train(replace(config, updates=8), resume=True)]
    assert runs[1].trainer.updates == 8
    for run in runs:
        for row in run.rows:
            assert row["ledger/dropped_stale"] == 0
            # publishing every update, a publication leaves nothing behind: all that was started was trained
            assert row["ledger/dispatched"] == row["ledger/trained"] + row["ledger/failed"]
        for update in run.updates:
            assert all(e.ticket.version == update.version for e in update.episodes)
    # generating while the learner updates, two updates per version: nothing is started for the version during
    # the update that publishes over it (the batch under training counts as still to train)
    overlapped = train(
        replace(config, out=str(tmp_path / "overlap"), overlap=True, algorithm={"publish_every": 2})
    )
    for row in overlapped.rows:
        assert row["ledger/dropped_stale"] == 0
        if row["published"] is not None:
            assert row["ledger/dispatched"] == row["ledger/trained"] + row["ledger/failed"]


def test_any_rule_trains_old_work_within_max_staleness(primed: Path, tmp_path: Path) -> None:
    run = train(staleness_config(tmp_path / "run", primed, algo="spo", max_staleness=1))
    assert run.rows[-1]["ledger/dropped_stale"] == 0
    old = [e for u in run.updates for e in u.episodes if e.ticket.version < u.version]
    assert any(len(set(action_versions(e))) > 1 for e in old)  # some finished after a publication


def read_evals(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    return {
        int(f.stem.removeprefix("update-")): [json.loads(line) for line in f.read_text().splitlines()]
        for f in sorted((run_dir / "evals").glob("update-*.jsonl"))
    }


@pytest.mark.parametrize("lr", [0.0, 1e-2])
def test_held_out_evaluation_is_paired_across_versions(lr: float, primed: Path, tmp_path: Path) -> None:
    """Every evaluation plays the same tasks under the same episode keys, so a frozen policy (lr 0) scores
    the same episodes identically and its paired difference to the start is exactly 0; a learning one is
    compared episode by episode."""
    config = run_config(
        tmp_path / "run", primed, algo="spo", updates=2, eval_every=1, eval_episodes=6,
        learner=LearnerConfig(lr=lr),
    )  # fmt: skip
    run = train(config)
    evals = read_evals(run.trainer.run_dir)
    assert sorted(evals) == [0, 1, 2]
    episodes = [[(r["key"], r["task_id"]) for r in records] for records in evals.values()]
    assert episodes[0] == episodes[1] == episodes[2] and len(episodes[0]) == 6
    rows = {r["update"]: r for r in run.rows}
    for update in (1, 2):
        wins = [float(r["won"]) for r in evals[update]]
        start = [float(r["won"]) for r in evals[0]]
        assert rows[update]["eval/success"] == pytest.approx(sum(wins) / 6)
        assert rows[update]["eval/delta"] == pytest.approx((sum(wins) - sum(start)) / 6)
        diffs, tasks = [w - s for w, s in zip(wins, start, strict=True)], [r["task_id"] for r in evals[0]]
        assert rows[update]["eval/tasks"] == len(set(tasks))
        assert rows[update]["eval/delta_ci95"] == pytest.approx(clustered_t_interval(diffs, tasks).half_width)
        assert rows[update]["eval/delta_ci95_episode"] == pytest.approx(t_interval(diffs).half_width)
        if lr == 0.0:
            assert evals[update] == evals[0]
            assert rows[update]["eval/delta"] == 0.0 and rows[update]["eval/delta_ci95"] == 0.0


def test_the_ends_play_more_episodes_than_the_curve(primed: Path, tmp_path: Path) -> None:
    """``final_eval_episodes``: the start and the end play all of them, the evaluation between the first
    ``eval_episodes`` (so its paired difference is to the start's same episodes); ``eval/*`` are over those,
    ``eval_full/*`` over all, and the run's gain and the demo report compare the ends on all of them."""
    from streamrl.cli.demo import write_report
    from streamrl.evaluation.compare import held_out_gain
    from streamrl.evaluation.curves import read_metrics

    config = run_config(
        tmp_path / "run", primed, algo="spo", updates=2, eval_every=1, eval_episodes=3, final_eval_episodes=8,
        learner=LearnerConfig(lr=1e-2),
    )  # fmt: skip
    run = train(config)
    evals = read_evals(run.trainer.run_dir)
    episodes = {u: [(r["key"], r["task_id"]) for r in records] for u, records in evals.items()}
    assert sorted(episodes) == [0, 1, 2] and len(episodes[0]) == 8
    assert episodes[2] == episodes[0] and episodes[1] == episodes[0][:3]
    split = run.trainer.side.session("eval").task_ids
    counts = Counter(t for _, t in episodes[0])
    assert max(counts.values()) - min(counts[t] for t in split) <= 1  # as even over the tasks as 8 allows
    rows = {r["update"]: r for r in read_metrics(run.trainer.run_dir) if "eval/success" in r}
    won = {u: {r["key"]: float(r["won"]) for r in records} for u, records in evals.items()}
    assert all(rows[u]["eval/episodes"] == 3 for u in (0, 1, 2))
    assert rows[1]["eval/delta"] == pytest.approx(sum(won[1][k] - won[0][k] for k in range(3)) / 3)
    assert rows[2]["eval/success"] == pytest.approx(sum(won[2][k] for k in range(3)) / 3)
    assert "eval_full/success" not in rows[1]
    assert rows[0]["eval_full/episodes"] == rows[2]["eval_full/episodes"] == 8
    full_delta = sum(won[2][k] - won[0][k] for k in range(8)) / 8
    assert rows[2]["eval_full/delta"] == pytest.approx(full_delta)
    gain = held_out_gain(run.trainer.run_dir)
    assert gain is not None and gain["n"] == 8 and gain["mean"] == pytest.approx(full_delta)
    report = write_report(run.trainer.run_dir)
    assert report["curve_episodes"] == 3 and report["end"]["episodes"] == 8
    assert [v for _, v, _ in report["held_out_curve"]] == pytest.approx(
        [rows[u]["eval/success"] for u in (0, 1, 2)]
    )
    assert report["paired_gain"]["mean"] == pytest.approx(full_delta)
    # stopped before its final evaluation: the last curve evaluation against the start's same episodes
    (run.trainer.run_dir / "evals" / "update-00002.jsonl").unlink()
    curve_delta = sum(won[1][k] - won[0][k] for k in range(3)) / 3
    gain = held_out_gain(run.trainer.run_dir)
    assert gain is not None and gain["n"] == 3 and gain["mean"] == pytest.approx(curve_delta)
    report = write_report(run.trainer.run_dir)
    assert report["start"]["episodes"] == report["paired_gain"]["n"] == 3
    assert report["paired_gain"]["mean"] == pytest.approx(curve_delta)


def test_extend_evenly_keeps_the_prefix_and_evens_the_counts() -> None:
    order = ["c", "a", "b", "d"]
    assert extend_evenly(["a", "a"], order, 2) == ["a", "a"]
    assert extend_evenly(["a", "a"], order, 5) == ["a", "a", "c", "b", "d"]
    out = extend_evenly(["b"], order, 10)
    assert out[:1] == ["b"] and sorted(Counter(out).values()) == [2, 2, 3, 3]
    assert out[1:4] == ["c", "a", "d"]  # the tasks played least first, in the seeded order


# ---------------------------------------------------------------------------------------------------------
# 8. Publication pitfalls
# ---------------------------------------------------------------------------------------------------------


class FirstAdapterOnly(HFBackend):
    """Fault injection: a reload that is a no-op (vLLM's same-name reload) -- it reports the new version and
    keeps serving the first adapter it loaded."""

    def set_adapter(self, path: Any, version: int) -> None:
        if self._adapter_name is None and path is not None:
            super().set_adapter(path, version)
        else:
            self._version = version


class NoReloadTrainer(Trainer):
    def _make_backend(self) -> Any:
        return FirstAdapterOnly(
            self.model_dir, tokenizer=self.tokenizer, config=HFBackendConfig(device="cpu")
        )


def test_a_publish_the_backend_does_not_serve_raises(primed: Path, tmp_path: Path) -> None:
    config = run_config(
        tmp_path / "run", primed, algo="spo", learner=LearnerConfig(finetune="lora", lr=1e-2), updates=3
    )
    run = start(config, cls=NoReloadTrainer)
    with pytest.raises(PublishError, match="after publishing v2 the backend serves"):
        run.trainer.run()
    assert run.trainer.tracker.version == 1  # v1 was loaded and verified; the clock did not advance past it


def test_a_corrupted_policy_and_a_missing_version_raise(
    primed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file, save_file

    run = start(run_config(tmp_path / "run", primed, algo="spo", updates=1))
    trainer = run.trainer
    save_policy = trainer.learner.save_policy

    def save_then_corrupt(directory: Any) -> Path:
        path = save_policy(directory)
        for file in Path(path).glob("*.safetensors"):
            weights = load_file(str(file))
            save_file({k: v + 0.05 if v.is_floating_point() else v for k, v in weights.items()}, str(file))
        return path

    monkeypatch.setattr(trainer.learner, "save_policy", save_then_corrupt)
    with pytest.raises(PublishError, match="v1"):
        trainer.run()
    assert trainer.tracker.version == 0
    with pytest.raises(PublishError, match="v7 is missing"):
        trainer.publisher.serve(7)


# ---------------------------------------------------------------------------------------------------------
# 4, 8. The learner: micro-batches and the importance ratio
# ---------------------------------------------------------------------------------------------------------


def rollouts_of(model: Path | str, jobs: Sequence[Job], temperature: float = 1.0) -> list[Episode]:
    from streamrl.agents.env_specs import env_spec
    from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

    spec = env_spec("math_tir")
    backend = HFBackend(model, config=HFBackendConfig(device="cpu"))
    venv = StreamingVectorEnv.from_env(
        spec.gym_id,
        len(jobs),
        config=VectorEnvConfig(backend="inprocess"),
        split=spec.train_split,
        **spec.env_kwargs,
    )
    agent = LLMAgent(
        backend,
        prompt_format=spec.prompt(),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=16, seed=1),
        context=spec.context,
    )
    try:
        done = collect(Rollouts(venv, agent, seed=2, lockstep=True), jobs)
    finally:
        venv.close()
    return [Episode(f.trajectory, f.job.ticket, f.job.group) for f in done]


def learner_for(model: Path | str, temperature: float = 1.0, **config: Any) -> Learner:
    tokenizer = load_tokenizer(resolve_model(model))
    return Learner(
        load_model(resolve_model(model)),
        LearnerConfig(finetune="full", device="cpu", **config),
        pad_token_id=int(tokenizer.pad_token_id),
        total_steps=1,
        temperature=temperature,
    )


@pytest.mark.parametrize("algo", ["spo++", "grpo"])
def test_micro_batches_give_the_full_batch_gradient(algo: str, primed: Path, math_tasks: list[str]) -> None:
    algorithm = make_algorithm(algo, **({"group_size": 4} if algo == "grpo" else {}))
    tracker = EventTracker(math_tasks[:8], replace(algorithm.tracker_config(0), one_in_flight=False))
    if algo == "spo++":  # baselines that differ between tasks: advantages vary whatever the rewards
        tracker.init_offline(
            {t: [1.0, float(i % 2)] if i < 2 else [0.0, 0.0] for i, t in enumerate(math_tasks[:8])}
        )
    tickets: list[tuple[Ticket, int | None]]
    if algo == "grpo":  # a group of 8 of the first task (mixed rewards) and one of 4 of the second
        tickets = [(tracker.dispatch(t), g) for g, n in ((0, 8), (1, 4)) for t in [math_tasks[g]] * n]
    else:  # the first task 4 times, 4 others once
        tickets = [(tracker.dispatch(t), None) for t in [math_tasks[0]] * 4 + math_tasks[1:5]]
    jobs = [Job(t.task_id, t.dispatch_index, t, g) for t, g in tickets]
    episodes = rollouts_of(primed, jobs)
    advantages = algorithm.advantages(episodes)
    assert len({round(float(a), 6) for a in advantages}) > 1, "precondition: the advantages vary"
    if algo == "spo++":  # Eq. 6: zero mean under the action-token measure of the whole batch
        tokens = torch.tensor([e.num_action_tokens for e in episodes], dtype=torch.float64)
        assert abs(float((torch.tensor(advantages, dtype=torch.float64) * tokens).sum())) < 1e-9

    grads: list[list[torch.Tensor]] = []
    for micro_batch_tokens in (1, 1 << 20):  # one row per micro-batch, then the whole batch in one
        learner = learner_for(primed, micro_batch_tokens=micro_batch_tokens)
        rows = training_rows([e.trajectory for e in episodes])
        assert len(length_sorted_chunks(rows, micro_batch_tokens)) == (
            len(rows) if micro_batch_tokens == 1 else 1
        )
        step = learner._step

        def recording_step(learner: Learner = learner, step: Callable[[], float] = step) -> float:
            grads.append([p.grad.detach().clone() for p in learner.params])  # type: ignore[union-attr]
            return step()

        learner._step = recording_step  # type: ignore[method-assign]
        learner.update(episodes, advantages, algorithm)
    # the gradients agree to float32 rounding (Adam's first step, ~lr * sign(g), would amplify rounding where
    # g ~ 0, so the weights after the step are not compared)
    scale = max(float(g.abs().max()) for g in grads[1])
    assert scale > 0
    for split, whole in zip(grads[0], grads[1], strict=True):
        assert float((split - whole).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_importance_ratio_is_one_without_an_update(temperature: float, math_tasks: list[str]) -> None:
    jobs = [Job(t, i) for i, t in enumerate(math_tasks[:4])]
    episodes = rollouts_of("tiny", jobs, temperature=temperature)
    rollout = [
        torch.tensor(
            [
                lp
                for seq in e.trajectory.sequences
                for lp, m in zip(seq.rollout_logprobs, seq.action_mask, strict=True)
                if m
            ]
        )
        for e in episodes
    ]
    other = 1.0 if temperature != 1.0 else 0.7  # raw vs processed log-probs: the pitfall this guards against
    for scoring_temperature, agrees in ((temperature, True), (other, False)):
        learner = learner_for("tiny", temperature=scoring_temperature)
        old = learner.episode_logprobs([e.trajectory for e in episodes])
        worst = max(float((o - r).abs().max()) for o, r in zip(old, rollout, strict=True))
        # log(pi_old / pi_rollout) on every action token; scoring at another temperature is far off
        assert (worst < 1e-4) == agrees, (scoring_temperature, worst)


def oracle_logprobs(model: Any, batch: TokenBatch, temperature: float) -> torch.Tensor:
    """``[B, T-1]`` log-probs of every action token, the plain way: the model's own masked forward, logits at
    every position, the constrained tokens' distribution renormalized over their allowed ids; 0 elsewhere."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids_from_mask(batch.attention_mask),
    )
    logits = out.logits[:, :-1].float() / temperature
    if batch.choice_index is not None and batch.choice_sets is not None:
        allowed = batch.choice_sets[batch.choice_index]  # [B, T-1, W], -1-padded; row 0 is empty
        inside = torch.zeros_like(logits, dtype=torch.bool)
        inside.scatter_(-1, allowed.clamp(min=0), allowed >= 0)
        constrained = (allowed >= 0).any(-1, keepdim=True)
        logits = logits.masked_fill(constrained & ~inside, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return logp.masked_fill(~batch.action_mask, 0.0)


def oracle_episodes(vocab: int) -> list[Episode]:
    """Nine episodes of made-up tokens: all open with one 30-token prompt (so micro-batches share a prefix),
    their lengths vary (one is three times as long as the rest, so it pads the others unless split off), some
    act under a constraint (allowed ids), and two hold several sequences (a windowed context): episode 2 two
    that share the prompt only, episode 5 six that share a 70-token opening (so it is a micro-batch of its own,
    ``prefix_grouped_chunks``)."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(4, vocab, (n,), generator=gen).tolist()

    prompt = ids(30)
    episodes = []
    for e in range(9):
        sequences = []
        opening = prompt + ids(40 if e == 5 else 0)
        for turn in range({2: 2, 5: 6}.get(e, 1)):
            seq = TokenSequence()
            seq.extend_context(opening + ids(3 + 2 * e + 5 * turn))
            for _ in range(16 if e == 4 else 1 + e % 3):
                action = ids(4 + e % 4)
                allowed = None
                if e % 3 == 1:  # a constrained action: each token among itself and 3-8 others
                    allowed = [[t, *ids(3 + (t + k) % 6)] for k, t in enumerate(action)]
                seq.extend_action(action, [-1.0] * len(action), 0, allowed)
                seq.extend_context(ids(2 + e % 5))
            sequences.append(seq)
        trajectory = Trajectory(f"t{e}", context_policy="window" if len(sequences) > 1 else "full")
        trajectory.sequences = sequences
        episodes.append(Episode(trajectory, Ticket(f"t{e}", 0, 0.5, e, 0.0)))
    return episodes


@pytest.mark.parametrize(
    ("algo", "overrides"),
    [
        pytest.param("spo++", {"mini_batches": 3}, id="spo++-3-mini-batches"),
        pytest.param("spo++", {"mini_batches": 2, "epochs": 2, "temperature": 0.7}, id="spo++-2-epochs-T0.7"),
        pytest.param("grpo", {"mini_batches": 2}, id="grpo"),
        pytest.param("spo", {}, id="spo"),
        pytest.param("sao", {"mini_batches": 2}, id="sao"),
        pytest.param("spo++", {"mini_batches": 2, "finetune": "lora"}, id="spo++-lora"),
        pytest.param("grpo", {"mini_batches": 2, "epochs": 2, "kl_coef": 0.5}, id="grpo-kl-k3"),
        pytest.param(
            "spo++",
            {"mini_batches": 2, "kl_coef": 0.5, "kl_estimator": "k2", "finetune": "lora"},
            id="spo++-lora-kl",
        ),
    ],
)
def test_the_learner_s_gradients_are_the_plain_loss_gradients(algo: str, overrides: dict[str, Any]) -> None:
    """Every optimizer step's gradient, accumulated over the learner's micro-batches (shared prefixes, logits
    at action tokens only, the last layer's MLP skipped elsewhere, long rows split off, the first step's old
    log-probs taken from its own forward), equals the gradient of the plain loss of the step's whole
    mini-batch at the same weights -- full logits from the model's masked forward, old log-probs from a copy of
    the weights before the update, and with ``kl_coef`` beta x the aggregated KL estimate against the start (after
    an earlier update, so neither the current weights nor those before the update are the start; LoRA's reference
    is its base under disabled adapters, the start while B = 0) -- to 1e-6, and so do the losses."""
    temperature = overrides.pop("temperature", 1.0)
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny"))
    pad = int(load_tokenizer(resolve_model("tiny")).pad_token_id)
    config = LearnerConfig(device="cpu", lr=3e-3, **{"finetune": "full", **overrides})
    learner = Learner(model, config, pad_token_id=pad, total_steps=4, temperature=temperature)
    initial = copy.deepcopy(learner.model)
    algorithm = make_algorithm(algo, **({"group_size": 3} if algo == "grpo" else {}))
    episodes = oracle_episodes(int(model.config.vocab_size))
    with (
        torch.no_grad()
    ):  # rollout log-probs: the starting policy's, off by a little (trainer/inference mismatch)
        for seq in (s for e in episodes for s in e.trajectory.sequences):
            logp = oracle_logprobs(initial, collate([seq], pad), temperature)[0]
            seq.rollout_logprobs = [0.0] + [
                float(x) + 0.05 * math.sin(t) if m else 0.0
                for t, (x, m) in enumerate(zip(logp, seq.action_mask[1:], strict=True))
            ]
    advantages: list[float | torch.Tensor] = [(-1.0) ** e * (0.5 + e / 8) for e in range(len(episodes))]
    if algo == "sao":  # per-token advantages, as a critic gives them
        advantages = [torch.linspace(-1.0, 1.0, e.num_action_tokens) for e in episodes]
    (shard,) = shard_batch(episodes, advantages, 1, config.mini_batches)
    rows = training_rows([e.trajectory for e in episodes])
    assert (
        len(length_sorted_chunks(rows, config.micro_batch_tokens, PASS_TOKENS)) > 1
    )  # the long row split off
    assert len(length_sorted_chunks(rows, config.micro_batch_tokens)) == 1
    assert any({rows[i].episode for i in chunk} == {5} for chunk in learner._micro_batches(rows))
    per_row_adv = Learner._spread(episodes, advantages, rows)
    before = initial
    if config.kl_coef:  # an update first, so that the weights before the checked one are not the start
        learner.update(episodes, advantages, algorithm)
        before = copy.deepcopy(learner.model)

    def oracle(step: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The plain loss of mini-batch ``step`` at the learner's current weights, and its gradient."""
        idx = [i for i, r in enumerate(rows) if shard.mini_batch[r.episode] == step % shard.mini_batches]
        batch = collate([rows[i].sequence for i in idx], pad)
        lengths = batch.lengths
        agg = algorithm.aggregation(torch.arange(int(lengths.max()))[None, :] < lengths[:, None])
        with torch.no_grad():
            old = oracle_logprobs(before, batch, temperature)
            start = oracle_logprobs(initial, batch, temperature)
        logp = oracle_logprobs(learner.model, batch, temperature)
        mask = batch.action_mask.float()
        loss = algorithm.policy_loss(
            PolicyInputs(
                logp=logp,
                old_logp=old,
                rollout_logp=batch.rollout_logprobs,
                advantages=batch.scatter(torch.cat([per_row_adv[i] for i in idx])),
                mask=mask,
                agg=agg,
            )
        ).loss
        if config.kl_coef:  # the reference is the start, whatever the weights are now
            kl = kl_penalty(logp, start, config.kl_estimator)
            loss = loss + config.kl_coef * aggregate_loss(kl * mask, mask, agg)
        grads = torch.autograd.grad(loss, learner.params, allow_unused=True)
        return loss.detach(), list(grads)

    step = learner._step
    worst: list[float] = []
    scale: list[float] = []
    losses: list[float] = []

    def checking_step() -> float:
        loss, expected = oracle(len(worst))
        losses.append(float(loss))
        scale.append(max(float(g.abs().max()) for g in expected if g is not None))
        worst.append(
            max(
                float((p.grad if p.grad is not None else torch.zeros_like(p)).sub(g).abs().max())
                for p, g in zip(learner.params, expected, strict=True)
                if g is not None or p.grad is not None
            )
        )
        return step()

    learner._step = checking_step  # type: ignore[method-assign]
    metrics = learner.update(episodes, advantages, algorithm)
    assert len(worst) == config.epochs * config.mini_batches
    assert min(scale) > 1e-3  # gradients of a size that 1e-6 measures
    assert max(worst) <= 1e-6, worst
    assert abs(metrics["loss"] - sum(losses) / len(losses)) <= 1e-6
    assert all(math.isfinite(v) for v in metrics.values()), metrics  # the entropy of constrained rows too
    assert (metrics.get("ref_kl", 0.0) > 1e-4) == bool(config.kl_coef), metrics


def test_the_kl_reference_is_the_start_also_after_a_learner_loads_a_checkpoint() -> None:
    """A learner built from the start that loads a trained learner's state (a resumed run) keeps the start as
    its KL reference: its next update is the trained learner's, bit for bit, KL included; a reference taken
    from the loaded weights would make the KL 0. Bad KL settings are refused by name."""
    pad = int(load_tokenizer(resolve_model("tiny")).pad_token_id)
    config = LearnerConfig(device="cpu", lr=3e-3, finetune="full", kl_coef=0.5)
    algorithm = make_algorithm("spo++")
    episodes = oracle_episodes(int(load_model(resolve_model("tiny")).config.vocab_size))
    advantages: list[float | torch.Tensor] = [(-1.0) ** e * (0.5 + e / 8) for e in range(len(episodes))]
    trained = Learner(load_model(resolve_model("tiny")), config, pad_token_id=pad, total_steps=4)
    for _ in range(2):
        trained.update(episodes, advantages, algorithm)
    resumed = Learner(load_model(resolve_model("tiny")), config, pad_token_id=pad, total_steps=4)
    resumed.load_state_dict(copy.deepcopy(trained.state_dict()))  # as from a checkpoint: no shared moments
    one, two = (learner.update(episodes, advantages, algorithm) for learner in (trained, resumed))
    assert one["ref_kl"] > 1e-3
    assert {k: v for k, v in one.items() if "seconds" not in k and "per_s" not in k} == {
        k: v for k, v in two.items() if "seconds" not in k and "per_s" not in k
    }
    for a, b in zip(trained.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    for bad, named in (
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_coef": math.nan}, "kl_coef"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"kl_coef": 0.1, "sharding": "fsdp"}, "fsdp"),
    ):
        with pytest.raises(ValueError, match=named):
            LearnerConfig(**bad)  # type: ignore[arg-type]


def test_prefix_grouped_chunks_keep_an_episode_s_rows_apart_where_they_share_a_long_opening() -> None:
    """Every row lands in exactly one micro-batch. An episode whose rows save at least ``PASS_TOKENS`` by sharing
    their opening (4 rows x 100 tokens: 300) is chunked on its own, within the token bound; an episode that saves
    less (3 rows x 30: 60) and the one-row episodes are chunked together exactly as ``length_sorted_chunks``
    chunks them."""

    def row(episode: int, ids: list[int]) -> TrainingRow:
        seq = TokenSequence()
        seq.extend_context(ids)
        seq.extend_action([8, 9], [-1.0, -1.0], 0)
        return TrainingRow(episode, seq)

    rows = [row(0, list(range(4, 104)) + [7] * k) for k in range(1, 5)]
    rows += [row(1, list(range(500, 530)) + [1] * k) for k in range(3)]
    rows += [row(e, list(range(600, 640)) + [e] * e) for e in range(2, 6)]
    rest = list(range(4, len(rows)))
    pooled = length_sorted_chunks([rows[i] for i in rest], 10_000, PASS_TOKENS)
    assert prefix_grouped_chunks(rows, 10_000) == [[0, 1, 2, 3]] + [[rest[j] for j in c] for c in pooled]
    tight = prefix_grouped_chunks(rows, 230)  # two rows of episode 0 fit in 230 padded tokens
    assert sorted(i for chunk in tight for i in chunk) == list(range(len(rows)))
    assert [c for c in tight if 0 in {rows[i].episode for i in c}] == [[0, 1], [2, 3]]


def test_a_shared_prefix_that_holds_action_tokens_scores_them_like_the_plain_forward() -> None:
    """Rows that share their first turn, actions included (a windowed context's rows), and then differ in
    length: the learner's forward (``skip_unread``, ``share_prefix``) scores the shared actions once for all
    rows, and its log-probs, entropies and gradients are the plain forward's to float rounding."""
    torch.manual_seed(0)
    model = load_model(resolve_model("tiny")).eval()
    pad = int(load_tokenizer(resolve_model("tiny")).pad_token_id)
    gen = torch.Generator().manual_seed(1)
    first = TokenSequence()
    first.extend_context(torch.randint(4, 4000, (25,), generator=gen).tolist())
    first.extend_action(torch.randint(4, 4000, (10,), generator=gen).tolist(), [-1.0] * 10, 0)
    rows = []
    for k in range(5):
        seq = TokenSequence(
            list(first.token_ids),
            list(first.action_mask),
            list(first.rollout_logprobs),
            list(first.token_versions),
        )
        seq.extend_context(torch.randint(4, 4000, (3 + 4 * k,), generator=gen).tolist())
        seq.extend_action(torch.randint(4, 4000, (2 + k,), generator=gen).tolist(), [-1.0] * (2 + k), 0)
        rows.append(seq)
    batch = collate(rows, pad)
    assert shared_prefix_length(batch.input_ids, batch.attention_mask) >= 35  # the first turn's actions
    scores = []
    for fast in (False, True):
        lp, entropy = selected_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            with_entropy=True,
            skip_unread=fast,
            share_prefix=fast,
        )
        grads = torch.autograd.grad(lp.sum(), list(model.parameters()))
        scores.append((lp.detach(), entropy, grads))
    (plain, plain_entropy, plain_grads), (fast_lp, fast_entropy, fast_grads) = scores
    assert float((plain - fast_lp).abs().max()) <= 1e-5
    assert float((plain_entropy - fast_entropy).abs().max()) <= 1e-5
    scale = max(float(g.abs().max()) for g in plain_grads)
    assert (
        max(float((a - b).abs().max()) for a, b in zip(plain_grads, fast_grads, strict=True)) <= 1e-6 * scale
    )


# ---------------------------------------------------------------------------------------------------------
# 9. Bad input fails before any work, naming the value and what is valid
# ---------------------------------------------------------------------------------------------------------

BAD = [
    pytest.param({"env": "nope"}, "unknown env 'nope'; valid: \\['alfworld', 'math_tir'\\]", id="env"),
    pytest.param({"algo": "nope"}, "unknown algorithm 'nope'; valid: .*spo\\+\\+", id="algo"),
    pytest.param({"model": "nope"}, "unknown model 'nope'.*Valid names: 'tiny'", id="model"),
    pytest.param(
        {"algo": "grpo", "algorithm": {"group_size": 1}},
        "batch_rule='groups' needs group_size >= 2, got 1",
        id="grpo-G1",
    ),
    pytest.param(
        {"algo": "grpo", "algorithm": {"group_size": 4}, "batch": 6},
        "batch=6 must be a multiple of grpo's group_size=4",
        id="batch-not-multiple-of-G",
    ),
    pytest.param(
        {"batch": 8, "tasks": 4}, "batch=8 is larger than the task set \\(4 tasks\\)", id="batch-gt-tasks"
    ),
    pytest.param(
        {"algo": "spo", "batch": 1}, "batch=1 is too small for spo: .* needs batch >= 2", id="spo-batch-1"
    ),
    pytest.param({"temperature": 0.0}, "temperature must be > 0.*got 0.0", id="temperature-0"),
    pytest.param(
        {"eval_episodes": 8, "final_eval_episodes": 4},
        "final_eval_episodes=4 must be >= eval_episodes=8",
        id="final-eval-below-curve",
    ),
    pytest.param(
        {"keep_versions": 1, "max_staleness": 2},
        "keep_versions=1 must be >= max_staleness \\+ 1 = 3",
        id="keep",
    ),
    pytest.param(
        {"average_last": 4},
        "average_last=4 averages the last 4 published versions, but keep_versions=3 keeps only that many",
        id="average-beyond-kept",
    ),
    pytest.param(
        {"average_last": 1, "learner": LearnerConfig(finetune="lora")},
        "average_last > 0 averages full weights; LoRA adapters do not average",
        id="average-lora",
    ),
    pytest.param(
        {"init": "sft", "sft": {"epochz": 3}},
        "sft=\\{'epochz': 3\\}: unknown sft override\\(s\\) \\['epochz'\\]; SFTConfig fields: .*'epochs'",
        id="sft-unknown",
    ),
    pytest.param(
        {"init": "sft", "sft": {"epochs": 0}}, "sft=.*epochs and batch_size must be >= 1, got 0", id="sft-bad"
    ),
    pytest.param(
        {"sft": {"seed": 1}}, "sft overrides \\{'seed': 1\\} need init='sft', got init='base'", id="sft-base"
    ),
    pytest.param(
        {"constrain_actions": True},
        "constrain_actions=True: the math_tir env's prompt format has no action_choices",
        id="constrain-math",
    ),
    pytest.param(
        {
            "env": "alfworld",
            "constrain_actions": True,
            "backend": "vllm",
            "learner": LearnerConfig(finetune="lora"),
        },
        "constrain_actions=True needs the hf backend",
        id="constrain-vllm",
    ),
    pytest.param(
        {"env": "alfworld", "avoid_repeats": True},
        "avoid_repeats=True needs constrain_actions=True",
        id="avoid-unconstrained",
    ),
    pytest.param(
        {"dispatch": "sized"}, "dispatch must be 'fill' or 'trainable', got 'sized'", id="dispatch-unknown"
    ),
    pytest.param(
        {"env": "alfworld", "eval_split": "valid_seen"},
        "unknown eval_split 'valid_seen' of env 'alfworld'; valid: \\['train', 'eval_seen', 'eval_unseen', "
        "'validation'\\]",
        id="eval-split",
    ),
    pytest.param(
        {"schedule_updates": 0},
        "schedule_updates must be >= 1 \\(or None: the run's updates\\), got 0",
        id="schedule-updates",
    ),
    pytest.param(
        {"balance_by": "task_type"},
        "balance_by='task_type' is not an attribute of every math_tir training task .*valid: \\['family', 'source'\\]",
        id="balance-by",
    ),
    pytest.param(
        {"env_kwargs": {"max_stepz": 3}},
        "env_kwargs=\\{'max_stepz': 3\\} do not fit the math_tir env",
        id="env-kwargs",
    ),
]


def test_offline_values_of_a_constrained_policy_are_cached_apart(tmp_path: Path) -> None:
    """The offline values' cache key holds the action constraint: a constrained policy (with or without repeats)
    plays other episodes than the free one, so a run never starts from another policy's prompt values."""
    from streamrl.agents.env_specs import env_spec
    from streamrl.algorithms.run_dir import RunDir
    from streamrl.algorithms.side_rollouts import SideRollouts

    paths = set()
    for constrain, avoid in ((False, False), (True, False), (True, True)):
        config = TrainConfig(
            out=str(tmp_path), env="alfworld", constrain_actions=constrain, avoid_repeats=avoid
        )
        side = SideRollouts(
            config,
            env_spec("alfworld"),
            backend=None,  # type: ignore[arg-type]  # the key needs no backend
            sampling=SamplingParams(max_new_tokens=24),
            tokenizer=None,
            files=RunDir(tmp_path),
            progress=False,
        )
        paths.add(
            side.offline_cache_path(resolve_model("tiny"), ["alfworld/train/0000", "alfworld/train/0001"])
        )
    assert len(paths) == 3


def test_balance_by_gives_each_value_of_the_attribute_an_equal_share_of_dispatches(tmp_path: Path) -> None:
    """``balance_by`` reaches the trainer's sampler: over Math-TIR's training tasks each family gets the same
    probability, where the sampler alone gives each family its share of the tasks (unequal here)."""
    trainer = Trainer(
        run_config(tmp_path / "run", tasks=None, balance_by="family"), progress=False, log=QUIET
    )
    try:
        strata = trainer.tracker.strata
        assert strata is not None and set(strata) == set(trainer.task_ids)
        families = Counter(strata.values())
        assert len(families) >= 3 and len(set(families.values())) > 1  # unequal family sizes
        mass: Counter[str] = Counter()
        for task, p in trainer.tracker.sampling_probabilities().items():
            mass[strata[task]] += p
        assert mass == pytest.approx({f: 1 / len(families) for f in families})
    finally:
        trainer.close()


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_input_fails_before_any_work(overrides: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        Trainer(run_config(tmp_path / "run", **{"model": "tiny", **overrides}), progress=False, log=QUIET)
    assert not (tmp_path / "run").exists()


def test_schedule_updates_trains_the_first_updates_of_a_longer_schedule(tmp_path: Path) -> None:
    """``schedule_updates`` spans the learning-rate schedule over a longer run than ``updates`` trains (SPO++
    Table 2's C10 is the first ten updates of the preset's run): the first updates get that run's learning
    rates, not a schedule squeezed into the updates trained."""
    from streamrl.algorithms.placement import make_learner

    model_dir = resolve_model("tiny")

    def factors(**overrides: Any) -> list[float]:
        config = run_config(tmp_path, **overrides)
        learner = make_learner(config, load_model(model_dir), model_dir, pad_token_id=0)
        return [learner.scheduler.lr_lambdas[0](step) for step in range(config.updates)]  # type: ignore[attr-defined]

    longer = factors(updates=6)[:2]
    assert factors(updates=2, schedule_updates=6) == longer
    assert factors(updates=2) != longer  # the run's own schedule decays over its 2 updates
    assert factors(updates=2)[1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_resuming_with_another_config_fails(tmp_path: Path) -> None:
    config = run_config(tmp_path / "run", "tiny")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config.to_dict()))
    changed = replace(config, batch=2, updates=9)  # more updates are fine, batch is not
    with pytest.raises(ConfigError, match=r"cannot resume .* with a different config \(batch: 4 -> 2\)"):
        Trainer(changed, resume=True, progress=False, log=QUIET)
    with pytest.raises(ConfigError, match="already holds a run; pass resume=True"):
        Trainer(config, progress=False, log=QUIET)
    # a run saved before a field existed resumes at that field's old behaviour, and only there
    saved = config.to_dict()
    for field in ("average_last", "dispatch", "schedule_updates"):
        saved.pop(field)
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    config.validate(make_algorithm(config.algo), resume=True)
    with pytest.raises(ConfigError, match=r"with a different config \(average_last: 0 -> 2\)"):
        replace(config, average_last=2).validate(make_algorithm(config.algo), resume=True)


def test_resuming_from_another_start_fails(tmp_path: Path) -> None:
    """A checkpoint records the model its run started from: resuming over other starting weights (a changed SFT
    preset, a model directory rewritten) would train the saved state against the wrong base, so it refuses."""
    model = tmp_path / "model"
    shutil.copytree(resolve_model("tiny"), model)
    config = run_config(tmp_path / "run", model, updates=1, offline_rollouts=0, checkpoint_every=1)
    train(config)
    saved = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["start"]
    assert saved == {"model_dir": "model", "weights": weights_fingerprint(model)}
    other = load_model(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    other.save_pretrained(model)
    with pytest.raises(ConfigError, match=r"it started from model, but the weights of model changed \("):
        Trainer(replace(config, updates=2), resume=True, progress=False, log=QUIET)


def test_top_p_is_rejected_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.cli.main import main

    with pytest.raises(
        ValueError, match="unknown train config key\\(s\\) \\['top_p'\\] \\(rollouts sample the full"
    ):
        TrainConfig.from_dict({"top_p": 0.9})
    yaml = tmp_path / "train.yaml"
    yaml.write_text("top_p: 0.9\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(yaml), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "top_p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--top-p", "0.9", "--out", str(tmp_path / "run")])
    assert "unrecognized arguments: --top-p" in capsys.readouterr().err


def test_cli_reports_bad_input_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamrl.cli.main import main

    assert main(["train", "--out", str(tmp_path / "run"), "--init", "base", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrl train: unknown model 'nope'") and "Traceback" not in err
