"""SAO (``streamrl.algorithms.sao``): the critic's values, skip-observation GAE over rows, DIS in the learner,
critic-only warm-up, K critic steps, checkpoint and resume of the critic, value pretraining -- on ``tiny``."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from streamrl.agents.models import load_model, load_tokenizer, resolve_model
from streamrl.agents.trajectory import TokenSequence, Trajectory
from streamrl.algorithms.advantages import gae, length_adaptive_lambda, masked_whiten, outcome_token_rewards
from streamrl.algorithms.base import Episode, SetupContext, make_algorithm
from streamrl.algorithms.learner import Learner, LearnerConfig
from streamrl.algorithms.sao import MLP_PROJECTIONS, SAO, SAOConfig, value_targets
from streamrl.algorithms.tracker import Ticket
from streamrl.algorithms.train import ConfigError, TrainConfig, Trainer, train
from streamrl.cli.main import main, parse_train_args


@pytest.fixture(scope="module")
def tiny() -> Path:
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def pad_id(tiny: Path) -> int:
    return int(load_tokenizer(tiny).pad_token_id)


def _context(tiny: Path, pad_id: int) -> SetupContext:
    return SetupContext(
        model_dir=tiny,
        device=torch.device("cpu"),
        pad_token_id=pad_id,
        tokenizer=None,
        micro_batch_tokens=64,  # several micro-batches even for these short rows
        seed=3,
        log=lambda msg: None,
    )


def _sao(tiny: Path, pad_id: int, **overrides: Any) -> SAO:
    sao = make_algorithm("sao", env="math_tir", **overrides)
    assert isinstance(sao, SAO)
    sao.setup(_context(tiny, pad_id))
    return sao


def _sequence(rng: random.Random, parts: list[tuple[str, int]]) -> TokenSequence:
    seq = TokenSequence()
    for kind, n in parts:
        ids = [rng.randrange(20, 4000) for _ in range(n)]
        if kind == "ctx":
            seq.extend_context(ids)
        else:
            seq.extend_action(ids, [-1.0] * n, version=0)
    return seq


def _episode(sequences: list[TokenSequence], reward: float, index: int, window: bool = False) -> Episode:
    ticket = Ticket(f"task-{index}", 0, None, index, 0.0)
    traj = Trajectory(
        task_id=ticket.task_id,
        ticket=ticket,
        context_policy="window" if window else "full",
        sequences=sequences,
    )
    traj.reward = reward
    return Episode(traj, ticket)


def _episodes(seed: int = 0) -> list[Episode]:
    """A full-context episode (observations inside one row) and a window-context one (three rows, each
    re-rendering earlier turns as context), of different lengths, so micro-batches pad."""
    rng = random.Random(seed)
    full = _sequence(rng, [("ctx", 7), ("act", 5), ("ctx", 4), ("act", 3), ("ctx", 2), ("act", 4)])
    window = [
        _sequence(rng, [("ctx", 6), ("act", 4)]),
        _sequence(rng, [("ctx", 9), ("act", 2)]),
        _sequence(rng, [("ctx", 12), ("act", 6)]),
    ]
    return [_episode([full], 1.0, 0), _episode(window, 0.0, 1, window=True)]


# ---------------------------------------------------------------------------------------------------------
# config and registry


def test_sao_is_registered_with_per_env_presets_and_validates_its_config() -> None:
    math_tir = make_algorithm("sao", env="math_tir")
    alfworld = make_algorithm("sao", env="alfworld")
    assert isinstance(math_tir, SAO) and math_tir.config.batch_rule == "any"
    assert (math_tir.config.eps_low, math_tir.config.eps_high) == (0.3, 5.0)
    assert (alfworld.config.eps_low, alfworld.config.eps_high) == (0.8, 3.0)
    assert math_tir.tracker_config(0).mode == "bookkeeping"
    assert [math_tir.train_policy(u) for u in range(4)] == [False, False, True, True]  # warm-up of 2
    with pytest.raises(ValueError, match="one rollout per task"):
        SAOConfig(batch_rule="groups", group_size=4)
    with pytest.raises(ValueError, match="eps_low"):
        SAOConfig(eps_low=0.0)
    with pytest.raises(ValueError, match="critic_updates"):
        SAOConfig(critic_updates=0)
    with pytest.raises(ValueError, match="value_clip"):
        SAOConfig(value_clip=0.0)
    assert SAOConfig(critic_lora_targets=["up_proj"]).critic_lora_targets == ("up_proj",)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="setup"):
        SAO().advantages(_episodes())


def test_train_flags_include_the_critic_fields(tmp_path: Path) -> None:
    _, config = parse_train_args(
        [
            "--algo",
            "sao",
            "--out",
            str(tmp_path),
            "--critic-lora-targets",
            "gate_proj",
            "up_proj",
            "--eps-low",
            "0.5",
        ]
    )
    sao = make_algorithm(config.algo, env=config.env, **config.algorithm)
    assert isinstance(sao, SAO) and sao.config.eps_low == 0.5
    assert sao.config.critic_lora_targets == ("gate_proj", "up_proj")


# ---------------------------------------------------------------------------------------------------------
# the critic


def test_critic_values_are_the_head_on_the_hidden_state_before_each_action_token(
    tiny: Path, pad_id: int
) -> None:
    sao = _sao(tiny, pad_id)
    critic = sao.critic
    assert critic is not None
    # frozen attention: only LoRA matrices on the MLP projections train in the backbone (decision D13)
    names = critic.trainable_names()
    assert names and all(any(f".mlp.{p}." in n for p in MLP_PROJECTIONS) and "lora_" in n for n in names)
    episodes = _episodes()
    got = critic.values([e.trajectory for e in episodes])

    plain = load_model(tiny)  # the critic's LoRA starts at B = 0: same hidden states as the plain model
    with torch.no_grad():
        for episode, values in zip(episodes, got, strict=True):
            expected = []
            for seq in episode.trajectory.sequences:  # one unpadded forward per row, by hand
                hidden = plain.model(input_ids=torch.tensor([seq.token_ids])).last_hidden_state[0]
                for t in range(1, len(seq)):
                    if seq.action_mask[t]:  # predicted at position t - 1: the state before token t
                        expected.append(critic.head(hidden[t - 1]).squeeze(-1))
            assert values.shape == (episode.num_action_tokens,)
            torch.testing.assert_close(values, torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert float(torch.cat(got).abs().max()) > 1e-3  # the seeded head is not zero: the check has teeth


def test_gae_advantages_equal_gae_on_the_padded_form_of_rows(tiny: Path, pad_id: int) -> None:
    """Skip-observation GAE over an episode's rows = ``gae`` on the episode's rows laid end to end with its
    observation tokens masked out -- for a window-context episode split into three rows and a full-context one."""
    episodes = _episodes()
    for whiten in (False, True):
        sao = _sao(tiny, pad_id, whiten=whiten, alpha=1.5)
        assert sao.critic is not None
        got = sao.advantages(episodes)
        values = sao.critic.values([e.trajectory for e in episodes])
        # padded form: each episode's rows concatenated, mask 0 on context/observations, garbage values there
        width = max(sum(len(s) for s in e.trajectory.sequences) for e in episodes)
        mask = torch.zeros(len(episodes), width, dtype=torch.float64)
        vals = torch.randn(len(episodes), width, dtype=torch.float64) * 100  # never read where mask = 0
        for i, (episode, v) in enumerate(zip(episodes, values, strict=True)):
            flat = [m for s in episode.trajectory.sequences for m in s.action_mask]
            mask[i, : len(flat)] = torch.tensor(flat, dtype=torch.float64)
            vals[i][mask[i].bool()] = v.double()
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
        lam = length_adaptive_lambda(mask.sum(-1), 1.5)
        expected = gae(outcome_token_rewards(rewards, mask), vals, mask, gamma=1.0, lam=lam).advantages
        if whiten:
            expected = masked_whiten(expected, mask)
        for i, adv in enumerate(got):
            assert isinstance(adv, torch.Tensor)
            torch.testing.assert_close(adv.double(), expected[i][mask[i].bool()], rtol=1e-5, atol=1e-6)
    assert lam[1] == pytest.approx(1 - 1 / (1.5 * 12))  # l counts the window episode's 12 action tokens


def test_value_targets_are_the_outcome_on_every_action_token() -> None:
    targets = value_targets([3, 0, 2], [1.0, 0.5, 0.0])
    assert [t.tolist() for t in targets] == [[1.0, 1.0, 1.0], [], [0.0, 0.0]]


# ---------------------------------------------------------------------------------------------------------
# DIS in the learner


def test_dis_masks_tokens_outside_the_band_and_reports_the_fraction(tiny: Path, pad_id: int) -> None:
    sao = _sao(tiny, pad_id)
    learner = Learner(
        load_model(tiny),
        LearnerConfig(finetune="full", lr=1e-4, micro_batch_tokens=64),
        pad_token_id=pad_id,
        total_steps=2,
    )
    episodes = _episodes(seed=1)
    logps = learner.episode_logprobs([e.trajectory for e in episodes])
    shifted = 0
    for episode, logp in zip(episodes, logps, strict=True):  # rollout log-probs = the policy's, some shifted
        flat = iter(logp.tolist())
        for seq in episode.trajectory.sequences:
            for t, m in enumerate(seq.action_mask):
                if m:
                    lp = next(flat)
                    shift = 2.0 if t % 3 == 0 else 0.0  # r = e^2 = 7.4 >= 1 + eps_high = 6: rejected
                    seq.rollout_logprobs[t] = lp - shift
                    shifted += shift > 0
    total = sum(e.num_action_tokens for e in episodes)
    assert 0 < shifted < total
    metrics = learner.update(episodes, sao.advantages(episodes), sao)
    assert metrics["masked_frac"] == pytest.approx(shifted / total, abs=1e-6)
    assert metrics["clip_frac_high"] == pytest.approx(shifted / total, abs=1e-6)
    assert metrics["clip_frac_low"] == 0.0
    assert math.isfinite(metrics["loss"])


# ---------------------------------------------------------------------------------------------------------
# end to end, checkpoint and resume


def _config(out: Path, updates: int) -> TrainConfig:
    return TrainConfig(
        out=str(out),
        env="math_tir",
        algo="sao",
        init="base",
        updates=updates,
        batch=4,
        num_envs=4,
        tasks=8,
        offline_rollouts=0,
        eval_every=0,
        max_new_tokens=16,
        env_workers="inprocess",
        checkpoint_every=1,
        algorithm={"warmup_updates": 1},
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_model(path).state_dict().items()}


def test_train_sao_end_to_end_with_warm_up_and_resume(tmp_path: Path, tiny: Path) -> None:
    out = tmp_path / "run"
    train(_config(out, updates=3), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert [r["learner/policy_trained"] for r in rows] == [0.0, 1.0, 1.0]  # critic-only warm-up of 1
    assert [r["learner/critic/steps"] for r in rows] == [2.0, 4.0, 6.0]  # K = 2 critic steps per update
    for r in rows:
        assert math.isfinite(r["learner/critic/value_loss"]) and math.isfinite(r["learner/critic/grad_norm"])
    for r in rows[1:]:
        assert math.isfinite(r["learner/loss"]) and "learner/masked_frac" in r
    assert "learner/loss" not in rows[0]
    # the policy: untouched by the warm-up update (v1 = the starting weights), changed by the next one
    start, v1, v2 = _weights(tiny), _weights(out / "policy" / "v1"), _weights(out / "policy" / "v2")
    assert all(torch.equal(start[k], v1[k]) for k in start)
    assert any(not torch.equal(v1[k], v2[k]) for k in v1)

    # resume restores the critic (weights, optimizer, step count) from checkpoint/learner.pt
    saved = torch.load(out / "checkpoint" / "learner.pt", weights_only=False)["algorithm"]["critic"]
    trainer = Trainer(_config(out, updates=4), resume=True, progress=False, log=lambda msg: None)
    critic = trainer.algorithm.critic
    assert critic is not None and critic.steps == 6
    state = critic.state_dict()
    assert all(torch.equal(state["weights"][k], saved["weights"][k]) for k in saved["weights"])
    assert torch.equal(state["head"]["weight"], saved["head"]["weight"])
    assert state["optimizer"]["state"][0]["step"] == saved["optimizer"]["state"][0]["step"] == 6
    fresh = _sao(tiny, int(trainer.tokenizer.pad_token_id)).critic
    assert fresh is not None and not torch.equal(fresh.head.weight, critic.head.weight)  # it was trained
    trainer.run()
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["update"] == 4 and last["learner/critic/steps"] == 8.0


# ---------------------------------------------------------------------------------------------------------
# value pretraining


def test_value_pretrain_command_fits_a_critic_that_sao_loads(
    tmp_path: Path, tiny: Path, pad_id: int, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "critic"
    args = ["value-pretrain", "--out", str(out), "--init", "base", "--tasks", "4", "--rollouts", "2"]
    args += ["--num-envs", "4", "--max-new-tokens", "12", "--env-workers", "inprocess", "--epochs", "3"]
    assert main([*args, "--batch", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 8 and len(report["epochs"]) == 3
    assert report["epochs"][-1]["value_loss"] < report["epochs"][0]["value_loss"]  # the critic fits
    meta = json.loads((out / "critic.json").read_text())
    assert meta["lora_rank"] == 16 and meta["report"]["episodes"] == 8

    loaded = _sao(tiny, pad_id, critic_init=str(out), warmup_updates=0)
    fresh = _sao(tiny, pad_id)
    blob = torch.load(out / "critic.pt", weights_only=True)
    assert loaded.critic is not None and fresh.critic is not None
    assert torch.equal(loaded.critic.head.weight, blob["head"]["weight"])
    assert not torch.equal(fresh.critic.head.weight, blob["head"]["weight"])

    with pytest.raises(ValueError, match="lora_rank: saved 16, here 8"):
        _sao(tiny, pad_id, critic_init=str(out), critic_lora_rank=8)
    with pytest.raises(ValueError, match="holds no critic"):
        _sao(tiny, pad_id, critic_init=str(tmp_path))
    assert main([*args, "--batch", "2"]) == 2  # out already holds a critic
    assert "already holds a critic" in capsys.readouterr().err
    other = ["--out", str(tmp_path / "other"), "--critic-init", str(out), "--critic-lora-rank", "8"]
    assert main([*args, *other]) == 2  # before any rollout
    assert "lora_rank: saved 16, here 8" in capsys.readouterr().err and not (tmp_path / "other").exists()


def test_value_pretrain_rolls_out_the_constrained_policy_of_a_constrained_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The critic learns the returns of the policy it rolls out, so a constrained SAO run's critic is pretrained
    on constrained rollouts: the bare model then takes only admissible commands (unconstrained, almost none)."""
    out = tmp_path / "critic"
    args = ["value-pretrain", "--out", str(out), "--env", "alfworld", "--init", "base", "--tasks", "2"]
    args += ["--rollouts", "1", "--num-envs", "2", "--env-workers", "inprocess", "--epochs", "1"]
    assert main([*args, "--constrain-actions", "--avoid-repeats"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 2 and report["valid_action_rate"] == 1.0
    assert report["config"]["constrain_actions"] and report["config"]["avoid_repeats"]

    bad = [
        ([*args, "--avoid-repeats"], "avoid_repeats=True needs constrain_actions=True"),
        (
            [*args[:4], "math_tir", *args[5:], "--constrain-actions"],
            "math_tir env's prompt format has no action_choices",
        ),
    ]
    for argv, message in bad:  # refused before anything is built
        with pytest.raises(SystemExit) as refused:
            main([*argv[:2], str(tmp_path / "other"), *argv[3:]])
        assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_train_rejects_a_critic_init_that_does_not_fit(tmp_path: Path) -> None:
    config = TrainConfig(
        out=str(tmp_path / "run"),
        algo="sao",
        init="base",
        batch=4,
        tasks=8,
        env_workers="inprocess",
        algorithm={"critic_init": str(tmp_path)},
    )
    with pytest.raises(ConfigError, match=r"sao: critic_init=.* holds no critic"):
        Trainer(config, progress=False, log=lambda msg: None)
