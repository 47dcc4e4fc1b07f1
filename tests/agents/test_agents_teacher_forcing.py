"""Teacher-forced expert data: rendered exactly as the LLM agent renders, with noise and downsampled turns
as context, on the real envs and the real tiny model's tokenizer."""

from __future__ import annotations

import random

import pytest
from streamrl.agents.env_specs import ENV_SPECS
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.teacher_forcing import downsample_turns, expert_trajectories, sequences_of
from streamrl.sft import SFTConfig


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model("tiny"))


@pytest.mark.parametrize("env_name", ["alfworld", "math_tir"])
def test_expert_data_is_the_agents_rendering(env_name: str, tokenizer) -> None:  # type: ignore[no-untyped-def]
    trajs = expert_trajectories(env_name, tokenizer, limit=3)
    assert len(trajs) == 3 and all(t.won for t in trajs)
    for traj in trajs:
        traj.validate()
        for turn in traj.turns:
            seq = traj.sequences[turn.sequence]
            ids = seq.token_ids[slice(*turn.action_span)]
            # The expert's action, then the end-of-turn token, is what the model is trained to generate.
            assert ids[-1] == tokenizer.eos_token_id
            assert tokenizer.decode(ids, skip_special_tokens=True) == turn.action == turn.text
        # Mask 0 on everything else, including the env's observations and tool output: each observation is in
        # the context of the next turn's sequence (full history: one sequence; window: one per turn).
        for turn, following in zip(traj.turns, traj.turns[1:], strict=False):
            seq = traj.sequences[following.sequence]
            ctx = tokenizer.decode([t for t, m in zip(seq.token_ids, seq.action_mask, strict=True) if not m])
            assert turn.observation.strip() in ctx
            if env_name == "alfworld":  # the admissible list leaves out the ~25 "go to" commands
                listed = ctx.rsplit("Admissible commands:", 1)[1].split("<|im_end|>")[0]
                assert "examine" in listed and "go to" not in listed


def test_dart_noise_turns_are_context_not_targets(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # Two plays of 6 games: the expert alone, then with 30% random actions (the searching expert recovers and
    # wins nearly all); every random action stays in the trajectory (as context) without being trained on.
    trajs = expert_trajectories("alfworld", tokenizer, limit=6, replays=2, noise=0.3, seed=1)
    assert len(trajs) >= 10 and all(not t.info["noise_turns"] for t in trajs[:6])  # the clean play first
    assert sum(len(t.info["noise_turns"]) for t in trajs[6:]) >= 6
    for traj in trajs:
        traj.validate()  # the record itself is untouched: the noise turns were generated like any other
        assert traj.info["untrained_turns"] == traj.info["noise_turns"]
    expected = [
        (t.sequences[turn.sequence], turn.action_span)
        for t in trajs
        for i, turn in enumerate(t.turns)
        if i not in t.info["noise_turns"]
    ]
    # Window context: one sequence per turn, so exactly the expert's turns remain, each trained on in full.
    trained = sequences_of(trajs)
    assert len(trained) == len(expected)
    for seq, (original, (start, end)) in zip(trained, expected, strict=True):
        assert seq.token_ids == original.token_ids
        assert [k for k, m in enumerate(seq.action_mask) if m] == list(range(start, end))


def test_slips_are_rejected_near_misses_followed_by_the_missed_command_as_a_target(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # 30% of the turns a slip: one number of the expert's command changed so the game rejects it. The state does
    # not change, so the next turn is the expert's command from the same state -- the one the slip missed -- and
    # it is trained on even where downsampling leaves nearly every other "go to" as context.
    trajs = expert_trajectories("alfworld", tokenizer, limit=6, slips=0.3, seed=2)
    assert len(trajs) == 6 and all(t.won for t in trajs)
    slips = [(t, i) for t in trajs for i in t.info["slip_turns"]]
    assert len(slips) >= 10
    for traj, i in slips:
        slip, recovery = traj.turns[i], traj.turns[i + 1]
        assert slip.action_valid is False and slip.observation.strip() == "Nothing happens."
        assert i + 1 in traj.info["recovery_turns"] and i in traj.info["untrained_turns"]
        same_words = [a == b for a, b in zip(slip.action.split(), recovery.action.split(), strict=True)]
        assert same_words.count(False) == 1  # one number changed, and the expert writes the right one after
        assert recovery.action_valid is not False
    assert sorted(i + 1 for _, i in slips) == sorted(i for t in trajs for i in t.info["recovery_turns"])
    downsample_turns(trajs, [("go to ", 0.01)], random.Random(0))
    targets = {(id(t), i) for t in trajs for i in range(len(t.turns)) if i not in t.info["untrained_turns"]}
    assert all((id(t), i + 1) in targets for t, i in slips)
    assert not any((id(t), i) in targets for t, i in slips)
    trained = sequences_of(trajs)
    assert len(trained) == len(targets)
    with pytest.raises(ValueError, match="slips must be in"):
        SFTConfig.alfworld(expert_slips=1.0)
    with pytest.raises(ValueError, match="no slip_action"):
        expert_trajectories("math_tir", tokenizer, limit=1, slips=0.1)


def test_alfworld_extra_games_extend_the_training_split(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # ALFWorld's "synthetic" episodes are the generated train split's games after its first 128 (never an eval
    # game): the expert wins them and the data carries their ids.
    trajs = expert_trajectories("alfworld", tokenizer, limit=0, synthetic=2)
    ids = [t.task_id for t in trajs]
    assert len(ids) == 2 and all(t.won for t in trajs), ids
    assert [i.split("/")[2][:4] for i in ids] == ["0128", "0129"]
    with pytest.raises(ValueError, match=">= 0"):
        ENV_SPECS["alfworld"].synthetic_tasks(-1, 0)  # type: ignore[misc]
