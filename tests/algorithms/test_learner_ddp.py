"""The learner as data-parallel ranks under torch.distributed (gloo, CPU, one thread per rank).

A 2-rank learner must make the single-rank update on the same batch: the gradient it steps with (summed over
the ranks) equals the single-rank gradient to float32 rounding, and so do the weights after the AdamW step;
every rank holds the same weights. The batch is real: five Math-TIR episodes played by ``tiny`` through the
runtime, so the two ranks' shards differ in episodes and tokens (3 + 2 episodes). The loss counts (N_tok for
SPO++'s token-mean, B and T_max for Dr. GRPO) must be the batch's on every rank: SPO++'s advantages have zero
mean under the batch's token measure (Eq. 6) but not on a shard, and a rank that divided by its own count
would change the gradient. Then a 2-rank ``streamrl train`` run, and bad input.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_ledger_closes,
    assert_same_update,
    record_steps,
    single_rank,
    spec_for,
    train_both,
)
from safetensors.torch import load_file
from streamrl.agents.models import load_model, resolve_model
from streamrl.algorithms.base import Episode, make_algorithm
from streamrl.algorithms.distributed import (
    DistributedLearner,
    LearnerRank,
    free_port,
    parameter_digest,
)
from streamrl.algorithms.learner import (
    Learner,
    LearnerConfig,
    Shard,
    length_sorted_chunks,
    shard_batch,
    training_rows,
)
from streamrl.algorithms.train import ConfigError, TrainConfig, Trainer
from streamrl.cli.main import parse_train_args
from torch.distributed.tensor import DTensor


def test_two_ranks_make_the_single_rank_spo_pp_update_and_keep_zero_mean(episodes: list[Episode]) -> None:
    algorithm = make_algorithm("spo++")
    advantages = [float(a) for a in algorithm.advantages(episodes)]
    tokens = [e.num_action_tokens for e in episodes]
    # Eq. 6: zero mean under the token measure of the whole batch ...
    assert abs(sum(a * n for a, n in zip(advantages, tokens, strict=True))) < 1e-9
    shards = shard_batch(episodes, advantages, 2)
    shard_tokens = [sum(e.num_action_tokens for e in s.episodes) for s in shards]
    assert sorted(len(s.episodes) for s in shards) == [2, 3] and shard_tokens[0] != shard_tokens[1]  # uneven
    # ... but not on a shard: dividing by a shard's own count would give another loss and gradient
    shard_sums = [
        sum(float(a) * e.num_action_tokens for a, e in zip(s.advantages, s.episodes, strict=True))
        for s in shards
    ]
    assert min(abs(x) for x in shard_sums) > 1.0
    own_counts = -sum(x / n for x, n in zip(shard_sums, shard_tokens, strict=True))

    one, two, learner = train_both(spec_for("spo++"), episodes, advantages, algorithm)
    try:
        assert_same_update(one, two)
        # at the first step pi = pi_old and the rollout IS weight is ~1, so the token-mean loss is
        # -sum_i A_i L_i / N_tok = 0 on the batch; with each rank's own count it would be ``own_counts``
        assert abs(two["metrics"]["loss"]) < 1e-5 < 1e-3 < abs(own_counts)
        digests = learner.digests()
        assert digests[0] == digests[1] == parameter_digest(learner)
        # a checkpoint loaded on rank 0 reaches every rank
        state = learner.state_dict()
        state["weights"] = {k: torch.zeros_like(v) for k, v in state["weights"].items()}
        learner.load_state_dict(state)
        zeroed = learner.digests()
        assert zeroed[0] == zeroed[1] != digests[0]
    finally:
        learner.close()


def test_mini_batches_and_dr_grpo_counts_are_the_batch_s_on_every_rank(episodes: list[Episode]) -> None:
    """Dr. GRPO divides by B x T_max of the step: both must be the step's, not a shard's; two optimizer
    steps (mini-batches of 3 and 2 episodes, each split over the ranks), on LoRA adapters."""
    algorithm = make_algorithm("grpo", variant="dr-grpo", group_size=2)
    advantages = [1.0, -0.5, 0.25, -1.0, 0.5]
    spec = spec_for("grpo", finetune="lora", mini_batches=2, max_grad_norm=1e6)
    one, two, learner = train_both(spec, episodes, advantages, algorithm)
    try:
        assert len(two["grads"]) == 2
        assert_same_update(one, two)
        # a rank that dies takes the update down with its error, not a hang
        learner._ranks[0].process.kill()  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="learner rank 1"):
            learner.update(episodes, advantages, algorithm)
        with pytest.raises(ValueError, match="started for GRPO, not SPOPP"):
            learner.update(episodes, advantages, make_algorithm("spo++"))
    finally:
        learner.close()


def micro_batches(shard: Shard, mini_batch: int, micro_batch_tokens: int) -> int:
    """The forwards a rank runs for ``shard`` in optimizer step ``mini_batch``."""
    trajectories = [
        e.trajectory for e, m in zip(shard.episodes, shard.mini_batch, strict=True) if m == mini_batch
    ]
    return len(length_sorted_chunks(training_rows(trajectories), micro_batch_tokens))


def rank0_part(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's FSDP shard of a full tensor of 2 ranks: the first ``torch.chunk`` along dim 0."""
    return torch.chunk(t, 2, dim=0)[0]


def full_weights(learner: Learner) -> list[torch.Tensor]:
    """The learner's trainable weights in parameter order, unsharded (``state_dict``: with FSDP, on all ranks)."""
    weights = learner.state_dict()["weights"]
    return [weights[n] for n, p in learner.model.named_parameters() if p.requires_grad]


def assert_close_in_norm(a: list[torch.Tensor], b: list[torch.Tensor], rel: float) -> None:
    diff = torch.cat([(x - y).flatten() for x, y in zip(a, b, strict=True)])
    assert float(diff.norm()) <= rel * float(torch.cat([x.flatten() for x in a]).norm())


def test_fsdp_ranks_make_the_single_rank_update_and_save_its_full_state(
    episodes: list[Episode], tmp_path: Path
) -> None:
    """Two FSDP ranks (each holding half of every weight, gradient and Adam moment) against one rank, on two
    SPO++ optimizer steps of one row per micro-batch: the ranks' shards get 2 + 1 micro-batches in the first
    step and 3 + 2 forwards to score, so the lighter rank runs filler forwards (FSDP's gathers are
    collectives). Rank 0's shard of each step's gradient is that part of the single-rank gradient (to 1e-4 of
    its largest entry: the gradient is clipped, and the float32 norm of the embedding's gradient, taken whole
    or in two shards, differs by ~1e-5 relative; unclipped the shards agree to 1e-7), the full weights after the steps are the single-rank weights (1e-6 relative in norm;
    rank 0's shard also elementwise, as in ``assert_same_update``) and so are the metrics. The full state
    gathered to rank 0 is a single rank's checkpoint (weights, Adam moments keyed by parameter index), it
    loads both ways, and the published policy and the log-probs match the single rank's."""
    algorithm = make_algorithm("spo++")
    advantages = [float(a) for a in algorithm.advantages(episodes)]
    spec = spec_for("spo++", sharding="fsdp", micro_batch_tokens=1, mini_batches=2)
    shards = shard_batch(episodes, advantages, 2, 2)
    forwards = [[micro_batches(s, m, 1) for m in range(2)] for s in shards]
    assert sorted(map(sum, forwards)) == [2, 3] and forwards[0][0] != forwards[1][0]  # fillers in step 1
    single = single_rank(spec)
    two = DistributedLearner(load_model(spec.model_dir), spec, 2)
    try:
        assert isinstance(two.params[0], DTensor)
        # before any step: the same checkpoint, and gathering it takes no optimizer step (DCP would make one)
        blank = two.state_dict()
        assert blank["optimizer"] == single.state_dict()["optimizer"] and not two.optimizer.state
        two.load_state_dict(blank)
        runs = []
        for learner in (single, two):
            grads = record_steps(learner)
            before = full_weights(learner)
            metrics = learner.update(episodes, advantages, algorithm)
            runs.append(
                {"grads": grads, "before": before, "after": full_weights(learner), "metrics": metrics}
            )
        one, sharded = runs
        assert_close_in_norm(one["after"], sharded["after"], 1e-6)
        parts = {key: [rank0_part(t) for t in one[key]] for key in ("before", "after")}
        assert_same_update(
            {**one, **parts, "grads": [[rank0_part(g) for g in step] for step in one["grads"]]},
            {**sharded, **{key: [rank0_part(t) for t in sharded[key]] for key in ("before", "after")}},
            grads=1e-4,  # clipped by 1 / norm: torch's float32 norm of 1.5M entries is good to ~1e-5 relative
        )
        assert len(set(two.digests())) == 1
        # the full state on rank 0 is the single rank's checkpoint
        state, reference = two.state_dict(), single.state_dict()
        assert set(state) == set(reference) and state["steps"] == reference["steps"] == 2
        assert list(state["weights"]) == list(reference["weights"])
        moments = state["optimizer"]["state"]
        assert state["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
        assert set(moments) == set(reference["optimizer"]["state"]) == set(range(len(single.params)))
        for i, values in reference["optimizer"]["state"].items():
            assert torch.equal(moments[i]["step"], values["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_in_norm(
                [v[key] for _, v in sorted(reference["optimizer"]["state"].items())],
                [v[key] for _, v in sorted(moments.items())],
                1e-4,  # the clipped gradients', as above
            )
        # ... and loads into one rank; the single rank's loads into the FSDP ranks, exactly
        other = single_rank(spec)
        other.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(full_weights(other), sharded["after"], strict=True))
        two.load_state_dict(
            copy.deepcopy(reference)
        )  # loading aliases the moments (torch does), and both step
        assert two.digests() == [parameter_digest(single)] * 2
        again = two.state_dict()
        for i, values in reference["optimizer"]["state"].items():
            assert all(torch.equal(again["optimizer"]["state"][i][k], v) for k, v in values.items())
        # publication: the full model on disk, and the probe's and the episodes' log-probs, are the single rank's
        published = [
            learner.save_policy(tmp_path / name) for name, learner in (("one", single), ("two", two))
        ]
        files = [load_file(str(path / "model.safetensors")) for path in published]
        assert set(files[0]) == set(files[1]) and all(torch.equal(files[0][k], files[1][k]) for k in files[0])
        assert (published[1] / "config.json").is_file()
        probe = [int(t) for t in episodes[0].trajectory.sequences[0].token_ids[:40]]
        assert two.token_logprobs(probe) == pytest.approx(single.token_logprobs(probe), abs=1e-5)
        trajectories = [e.trajectory for e in episodes]
        for a, b in zip(
            two.episode_logprobs(trajectories), single.episode_logprobs(trajectories), strict=True
        ):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
        # after the same checkpoint, the same next update (the Adam moments and step counts came across)
        for learner in (single, two):
            learner.update(episodes, advantages, algorithm)
        assert_close_in_norm(full_weights(single), full_weights(two), 1e-6)
    finally:
        two.close()


def tiny_run(out: Path, **config: Any) -> TrainConfig:
    """A synchronous Math-TIR run of ``tiny`` sized for CI (batches of 4, 16 new tokens a turn, no evaluation)."""
    return TrainConfig(
        **{
            "out": str(out),
            "env": "math_tir",
            "init": "base",
            "batch": 4,
            "num_envs": 4,
            "tasks": 4,
            "max_staleness": 0,
            "offline_rollouts": 0,
            "eval_every": 0,
            "max_new_tokens": 16,
            "env_workers": "inprocess",
            **config,
        }
    )


def test_a_two_rank_training_run_trains_like_one_rank(tmp_path: Path) -> None:
    """``streamrl train`` with ``learner_ranks=2``: a synchronous SAO run of one update (the critic's values
    make the advantages vary although ``tiny`` never wins; the critic trains on rank 0). The published weights
    are those of the single-rank run (the two updates differ by less than 1e-3 of their size) and so are the
    loss and the gradient norm: Adam's step hardly changes when every gradient is scaled alike (as one count
    per rank on even shards would do), the norm does."""
    from safetensors.torch import load_file

    weights, rows = [], []
    for ranks in (1, 2):
        config = tiny_run(
            tmp_path / f"ranks{ranks}",
            algo="sao",
            updates=1,
            checkpoint_every=0,
            learner_ranks=ranks,
            algorithm={"warmup_updates": 0, "critic_updates": 1},
        )
        Trainer(config, log=lambda _: None, progress=False).run()
        row = json.loads((tmp_path / f"ranks{ranks}" / "metrics.jsonl").read_text().splitlines()[-1])
        assert row["learner/policy_trained"] == 1.0 and row["ledger/trained"] == 4
        rows.append(row)
        weights.append(load_file(str(tmp_path / f"ranks{ranks}" / "policy" / "v1" / "model.safetensors")))
    start = load_file(str(resolve_model("tiny") / "model.safetensors"))
    keys = sorted(weights[0])
    step = torch.cat([(weights[0][k] - start[k]).flatten() for k in keys])
    diff = torch.cat([(weights[0][k] - weights[1][k]).flatten() for k in keys])
    assert float(step.abs().max()) > 1e-5  # the update moved the weights
    assert float(diff.norm()) <= 1e-3 * float(step.norm())
    for key in ("learner/grad_norm", "learner/action_tokens", "learner/critic/value_loss"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-4), key
    assert rows[1]["learner/loss"] == pytest.approx(rows[0]["learner/loss"], abs=1e-6)  # ~0: whitened


def test_an_fsdp_training_run_closes_its_ledger_and_resumes_on_one_rank(tmp_path: Path) -> None:
    """``streamrl train --learner-ranks 2 --sharding fsdp``: two SPO updates, each followed by SPO's rescoring
    (the ranks score their share of the episodes), a publication (the full weights gathered to rank 0, the
    probe's forward on both ranks, checked against the backend) and a checkpoint (the full state). Every row's
    ledger closes. The checkpoint is a single rank's: the run resumes on one replicated rank (how the ranks
    hold the policy is placement, like their number) and trains a third update."""
    config = tiny_run(
        tmp_path / "run",
        algo="spo",
        updates=2,
        checkpoint_every=1,
        learner_ranks=2,
        learner=LearnerConfig(sharding="fsdp"),
    )
    Trainer(config, log=lambda _: None, progress=False).run()
    run = Path(config.out)
    assert json.loads((run / "config.json").read_text())["learner"]["sharding"] == "fsdp"
    assert (run / "policy" / "v2" / "model.safetensors").is_file()
    state = torch.load(run / "checkpoint" / "learner.pt", weights_only=False)["learner"]
    assert state["steps"] == 2 and state["finetune"] == "full" and len(state["optimizer"]["state"]) > 0
    resumed = replace(config, updates=3, learner_ranks=1, learner=LearnerConfig())
    Trainer(resumed, resume=True, log=lambda _: None, progress=False).run()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(r["learner/policy_trained"] == 1.0 for r in rows)
    assert_ledger_closes(rows)


def test_shards_hold_the_single_rank_mini_batches_balanced_by_tokens(episodes: list[Episode]) -> None:
    tokens = [e.num_action_tokens for e in episodes]
    advantages = [float(i) for i in range(len(episodes))]
    for mini_batches in (1, 2, 3):
        for ranks in range(1, len(episodes) + 1):
            shards = shard_batch(episodes, advantages, ranks, mini_batches)
            assert shards == shard_batch(episodes, advantages, ranks, mini_batches)  # deterministic
            assert sorted(p for s in shards for p in s.positions) == list(range(len(episodes)))
            assert all(s.mini_batches == mini_batches for s in shards)
            for s in shards:
                assert s.positions == sorted(s.positions)
                assert [episodes[p] for p in s.positions] == s.episodes
                assert s.advantages == [advantages[p] for p in s.positions]
                assert s.mini_batch == [p % mini_batches for p in s.positions]  # every episode has tokens
            for m in range(mini_batches):  # dealt longest first to the lightest rank: within one episode
                load = [
                    sum(tokens[p] for p, b in zip(s.positions, s.mini_batch, strict=True) if b == m)
                    for s in shards
                ]
                members = [tokens[p] for p in range(len(episodes)) if p % mini_batches == m]
                assert max(load) - min(load) <= max(members)


def test_bad_input_is_refused_with_the_valid_range(episodes: list[Episode], tmp_path: Path) -> None:
    advantages = [0.0] * len(episodes)
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        shard_batch(episodes, advantages, 0)
    with pytest.raises(ValueError, match=r"6 learner ranks for an update batch of 5 trajectories.*at most 5"):
        shard_batch(episodes, advantages, 6)
    with pytest.raises(ValueError, match="learner ranks must be >= 1, got 0"):
        DistributedLearner(None, spec_for("spo++"), 0)
    # a rank that cannot build its replica fails the start with its error (rank 0 never waits to rendezvous)
    missing = replace(spec_for("spo++"), model_dir=str(tmp_path / "no-model"))
    with pytest.raises(RuntimeError, match=r"(?s)learner rank 1 failed to start.*no-model"):
        DistributedLearner(load_model(resolve_model("tiny")), missing, 2)
    base = dict(out=str(tmp_path / "run"), init="base", batch=4, tasks=4, env_workers="inprocess")
    with pytest.raises(ConfigError, match="learner_ranks must be >= 1, got 0"):
        Trainer(TrainConfig(**base, learner_ranks=0), progress=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="learner_ranks=5 is more than the batch \\(4 trajectories\\)"):
        Trainer(TrainConfig(**base, learner_ranks=5), progress=False)  # type: ignore[arg-type]
    # sharding
    with pytest.raises(ValueError, match="sharding must be 'replicate' or 'fsdp', got 'zero3'"):
        LearnerConfig(sharding="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sharding='fsdp' shards a fully fine-tuned model.*finetune='full'"):
        LearnerConfig(sharding="fsdp", finetune="lora")
    assert LearnerConfig(sharding="fsdp").resolved_finetune(10**10) == "full"  # "auto" picks full under FSDP
    fsdp = LearnerConfig(sharding="fsdp")
    with pytest.raises(ConfigError, match=r"sharding='fsdp' .* needs learner_ranks >= 2, got 1"):
        Trainer(TrainConfig(**base, learner=fsdp), progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sharding='fsdp' .* needs their group"):
        Learner(load_model(resolve_model("tiny")), fsdp, pad_token_id=0, total_steps=1)
    _, parsed = parse_train_args(
        ["--out", str(tmp_path / "cli"), "--learner-ranks", "2", "--sharding", "fsdp"]
    )
    assert parsed.learner.sharding == "fsdp" and parsed.learner_ranks == 2
    with pytest.raises(SystemExit):
        parse_train_args(["--out", str(tmp_path / "cli"), "--sharding", "zero3"])


def test_a_cpu_learner_on_a_machine_with_a_gpu_joins_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' backend follows the learner's device, not the machine: NCCL cannot carry a CPU learner."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = spec_for("spo++")  # device="cpu"
    learner = DistributedLearner(load_model(resolve_model("tiny")), spec, 1)
    try:
        assert learner.group is not None and learner.group.backend == "gloo"
    finally:
        learner.close()
    rank = LearnerRank(0, 1, f"tcp://127.0.0.1:{free_port()}", spec)
    try:
        assert rank.group.backend == "gloo"
    finally:
        rank.close()


def test_a_trainer_whose_build_fails_leaves_no_learner_rank_behind(tmp_path: Path) -> None:
    """A config error found after the ranks started (here: env arguments the env refuses) closes them: no rank
    process outlives the failed ``Trainer``."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    config = TrainConfig(
        out=str(tmp_path / "run"),
        init="base",
        batch=4,
        tasks=4,
        env_workers="inprocess",
        learner_ranks=2,
        env_kwargs={"no_such_option": 1},
    )
    with pytest.raises(ConfigError, match=r"env_kwargs=.* do not fit the math_tir env"):
        Trainer(config, progress=False)
    started = [p for p in me.children(recursive=True) if p.pid not in before]
    started = [
        p for p in started if "resource_tracker" not in " ".join(p.cmdline())
    ]  # lives with the process
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not [(p, p.cmdline()) for p in alive if p.status() != psutil.STATUS_ZOMBIE]
