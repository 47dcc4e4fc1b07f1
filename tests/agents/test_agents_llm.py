"""LLMAgent end to end on the real envs with real models: token/mask invariants, context policies, parsers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import gymnasium as gym
import pytest
import streamrl.envs  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st
from streamrl.agents.base import Agent, SamplingParams, derive_seed
from streamrl.agents.env_specs import task_ids_of
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.llm_agent import ContextPolicy, LLMAgent
from streamrl.agents.prompts import ALFWorldPrompt, MathTIRPrompt
from streamrl.agents.random_agent import RandomTextAgent
from streamrl.agents.rollout import play_episode
from streamrl.agents.trajectory import Trajectory, TurnRecord
from streamrl.envs.alfworld_text import go_to_frontier
from streamrl.envs.math_answer import extract_boxed


@pytest.fixture(scope="module")
def tiny() -> HFBackend:
    return HFBackend("tiny")


@pytest.fixture(scope="module")
def alfworld_env() -> Iterator[gym.Env]:
    env = gym.make("streamrl/ALFWorld-v0", split="train", max_steps=4)
    yield env
    env.close()


@pytest.fixture(scope="module")
def math_env() -> Iterator[gym.Env]:
    env = gym.make("streamrl/MathTIR-v0", source="procedural", size=8, max_tool_calls=2, max_turns=3)
    yield env
    env.close()


def check_trajectory(traj: Trajectory, backend: HFBackend, result_actions: list[str]) -> None:
    """The invariants a learner relies on, checked against the model itself."""
    traj.validate()
    tok = backend.tokenizer
    assert [t.action for t in traj.turns] == result_actions
    for seq_index, seq in enumerate(traj.sequences):
        turns = [t for t in traj.turns if t.sequence == seq_index]
        # The spans tile the sequence: context, action, context, action, ... (token ids == concatenation).
        pieces: list[int] = []
        for turn in turns:
            assert turn.prompt_span[0] == len(pieces) and turn.prompt_span[1] == turn.action_span[0]
            pieces += seq.token_ids[turn.prompt_span[0] : turn.action_span[1]]
            assert tok.decode(seq.token_ids[slice(*turn.action_span)], skip_special_tokens=True) == turn.text
            assert set(seq.action_mask[slice(*turn.action_span)]) == {1}
        assert pieces == seq.token_ids
        # Every action token's rollout log-prob is what the model gives it in this very sequence: the
        # recorded ids are the ones the policy saw (temperature 1, no filtering).
        scored = backend.score([seq.token_ids], [1])[0]
        for i, m in enumerate(seq.action_mask):
            if m:
                assert abs(scored[i - 1] - seq.rollout_logprobs[i]) < 1e-4, i


def play(env: gym.Env, agent: Agent, task: int = 0) -> tuple[Trajectory, list[str]]:
    ids = task_ids_of(env)
    result = play_episode(env, agent, options={"task_id": ids[task]})
    traj = result.record
    assert traj is not None
    assert traj.task_id == ids[task] and traj.won == result.won and traj.reward == result.reward
    assert traj.truncated == result.truncated and traj.terminated == result.terminated
    assert [t.observation for t in traj.turns] == [t.observation for t in result.turns]
    if "tool_calls" in result.final_info:
        assert sum(t.tool_calls for t in traj.turns) == result.final_info["tool_calls"]
    return traj, [t.action for t in result.turns]


def test_alfworld_full_history_episode(tiny: HFBackend, alfworld_env: gym.Env) -> None:
    agent = LLMAgent(tiny, prompt_format=ALFWorldPrompt(), sampling=SamplingParams(max_new_tokens=12))
    traj, actions = play(alfworld_env, agent)
    assert len(traj.sequences) == 1 and len(traj.turns) == 4 and traj.truncated
    check_trajectory(traj, tiny, actions)
    seq = traj.sequences[0]
    # The sequence opens with the chat template's own rendering of the system and first user message.
    first_obs, first_info = alfworld_env.reset(options={"task_id": traj.task_id})
    fmt = ALFWorldPrompt()
    head = tiny.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": fmt.system_prompt(first_obs, first_info)},
            {"role": "user", "content": fmt.user_message(first_obs, first_info, 0)},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tiny.tokenizer.decode(seq.token_ids[: traj.turns[0].action_span[0]]) == head
    # Observations come back as user turns (mask 0) in the same sequence.
    next_prompt = tiny.tokenizer.decode(seq.token_ids[slice(*traj.turns[1].prompt_span)])
    assert traj.turns[0].observation.strip() in next_prompt and next_prompt.endswith(
        "<|im_start|>assistant\n"
    )
    assert Trajectory.from_json(traj.to_json()).to_dict() == traj.to_dict()
    bad = Trajectory.from_json(traj.to_json())
    bad.sequences[0].rollout_logprobs.pop()
    with pytest.raises(ValueError, match=r"sequences\[0\]: rollout_logprobs has \d+ entries"):
        bad.validate()
    bad = Trajectory.from_json(traj.to_json())
    bad.turns[0].action_span = (bad.turns[0].action_span[0] + 1, bad.turns[0].action_span[1])
    with pytest.raises(ValueError, match="exactly the turns' action spans"):
        bad.validate()


def test_constrained_actions_are_admissible_and_the_learner_scores_their_policy(tiny: HFBackend) -> None:
    from streamrl.agents.env_specs import env_spec, play_tasks
    from streamrl.agents.models import load_model, resolve_model
    from streamrl.algorithms.learner import Learner, LearnerConfig

    spec = env_spec("alfworld")
    records: list[Trajectory] = []

    class Keep:  # play_tasks's agent, keeping every record
        def __init__(self, agent: LLMAgent) -> None:
            self.agent = agent

        def act(self, *args: object) -> list[str]:
            return self.agent.act(*args)  # type: ignore[arg-type]

        def end_episode(self, episode_id: object) -> Trajectory:
            records.append(self.agent.end_episode(episode_id))
            return records[-1]

    # The untrained model: free, it writes no admissible command; constrained, nothing else.
    for constrain in (False, True):
        records.clear()
        agent = spec.llm_agent(tiny, SamplingParams(max_new_tokens=24, seed=3), constrain_actions=constrain)
        played = play_tasks(Keep(agent), "alfworld", "train", 2, 2, {"max_steps": 4})
        assert played.episodes == 2 and played.steps == 8 and len(records) == 2
        assert played.valid_steps == (8 if constrain else 0)
        assert all(r.truncated and not r.won for r in records)  # play_lockstep fills the outcome
        for record in records:
            for turn in record.turns:
                assert turn.action_valid is constrain
                seq = record.sequences[turn.sequence]
                positions = range(*turn.action_span)
                if constrain:  # the reply is exactly a command and its end-of-turn token
                    assert turn.text == turn.action and turn.finish_reason == "stop"
                    assert seq.choice_positions == list(positions)
                else:
                    assert seq.choice_positions == [] and seq.choice_ids == []
    for record in records:
        assert Trajectory.from_json(record.to_json()).to_dict() == record.to_dict()
    # The learner scores the constrained policy the tokens were sampled from (its old log-probs: the ratio
    # pi_old / pi_rollout is 1 before any update), which the unconstrained model would not.
    learner = Learner(
        load_model(resolve_model("tiny")),
        LearnerConfig(device="cpu"),
        pad_token_id=tiny.pad_token_id,
        total_steps=1,
    )
    for record, scored in zip(records, learner.episode_logprobs(records), strict=True):
        rollout = [
            lp
            for seq in record.sequences
            for lp, m in zip(seq.rollout_logprobs, seq.action_mask, strict=True)
            if m
        ]
        assert max(abs(a - b) for a, b in zip(scored.tolist(), rollout, strict=True)) < 1e-4
        free = [
            lp
            for seq in record.sequences
            for lp, m in zip(tiny.score([seq.token_ids], [1])[0], seq.action_mask[1:], strict=True)
            if m
        ]
        assert sum(free) < sum(rollout) - 1.0
    bad = Trajectory.from_json(records[0].to_json())
    bad.sequences[0].choice_ids[0] = [t + 1 for t in bad.sequences[0].choice_ids[0]]
    with pytest.raises(ValueError, match=r"sequences\[0\]: token \d+ \(\d+\) is not among the ids allowed"):
        bad.validate()
    with pytest.raises(
        ValueError, match=r"needs a prompt format with action_choices.*MathTIRPrompt has none"
    ):
        LLMAgent(tiny, prompt_format=MathTIRPrompt(), constrain_actions=True)


def test_avoid_repeats_takes_no_command_twice_from_one_state(tiny: HFBackend) -> None:
    # One state seen again and again (the same observation, the same three commands), played greedily: with
    # avoid_repeats the first three turns take the three commands, each once, and each turn records as allowed
    # exactly the first tokens of the commands not taken yet (what the learner rescores); once all were taken
    # the whole list is allowed again. A policy that ignored the option would repeat its greedy choice.
    commands = ["look", "inventory", "go to desk 1"]
    info = {"admissible_commands": commands}
    obs = "You are in the middle of a room. Your task is to: put a pen in desk."
    agent = LLMAgent(
        tiny,
        prompt_format=ALFWorldPrompt(list_admissible=True, one_command_per_line=True),
        sampling=SamplingParams(max_new_tokens=24, temperature=0.0),
        context=ContextPolicy(mode="window", window_turns=1, max_context_tokens=1024),
        constrain_actions=True,
        avoid_repeats=True,
    )
    actions = [agent.act([obs], [info], ["e"])[0] for _ in range(4)]
    assert sorted(actions[:3]) == sorted(commands) and actions[3] in commands
    first = {c: agent.chat.encode(c)[0] for c in commands}
    assert len(set(first.values())) == 3  # the commands start with distinct tokens
    record = agent.end_episode("e")
    for t, turn in enumerate(record.turns):
        seq = record.sequences[turn.sequence]
        allowed = seq.choice_ids[seq.choice_positions.index(turn.action_span[0])]
        left = [c for c in commands if c not in actions[:t]] if t < 3 else commands
        assert allowed == sorted(first[c] for c in left)
    with pytest.raises(ValueError, match="avoid_repeats=True needs constrain_actions=True"):
        LLMAgent(tiny, prompt_format=ALFWorldPrompt(), avoid_repeats=True)


def test_a_windowed_episode_keeps_its_head_once_and_every_later_turn_starts_from_it() -> None:
    # The window drops the previous turn, so no prompt continues the last one whole; what every turn shares is
    # the first prompt (system message, first observation). The agent has the backend keep that head: turns
    # 1.. start from it, the cache holds one entry per episode, and the episodes play exactly as without it.
    from streamrl.agents.hf_backend import HFBackendConfig

    on = HFBackend("tiny", config=HFBackendConfig(decode="static"))
    off = HFBackend("tiny", config=HFBackendConfig(decode="static", prefix_cache_bytes=0))
    commands = ["look", "inventory", "go to desk 1", "open drawer 1"]
    first = "You are in the middle of a room. Your task is to: put a pen in desk."
    played = []
    for backend in (on, off):
        agent = LLMAgent(
            backend,
            prompt_format=ALFWorldPrompt(list_admissible=True, one_command_per_line=True),
            sampling=SamplingParams(max_new_tokens=24, seed=7),
            context=ContextPolicy(mode="window", window_turns=1, max_context_tokens=1024),
            constrain_actions=True,
        )
        for turn in range(5):
            obs = first if turn == 0 else f"You arrive at shelf {turn}. On the shelf {turn}, you see nothing."
            info = {"admissible_commands": commands[turn % 2 :]}
            agent.act([obs, obs], [info, info], ["a", "b"])
        played.append([agent.end_episode(e) for e in ("a", "b")])
    for a, b in zip(*played, strict=True):
        assert [t.action for t in a.turns] == [t.action for t in b.turns]
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    heads = [len(r.sequences[0].token_ids) - r.sequences[0].action_mask.count(1) for r in played[0]]
    assert on.prefix_cache.hits == 8 and on.prefix_cache.reused_tokens == 4 * sum(heads)
    assert len(on.prefix_cache) == 1  # both episodes' first prompts are the same tokens: one entry
    assert off.prefix_cache.hits == 0


def test_math_window_policy_and_batched_act(tiny: HFBackend, math_env: gym.Env) -> None:
    policy = ContextPolicy(mode="window", window_turns=1, max_context_tokens=1024)
    agent = LLMAgent(
        tiny, prompt_format=MathTIRPrompt(), sampling=SamplingParams(max_new_tokens=16), context=policy
    )
    traj, actions = play(math_env, agent, task=1)
    assert traj.context_policy == "window" and len(traj.sequences) == len(traj.turns) == 3
    check_trajectory(traj, tiny, actions)
    # Batched act: two episodes with different prompt lengths share generate calls.
    envs = [
        gym.make("streamrl/MathTIR-v0", source="procedural", size=8, max_tool_calls=1, max_turns=2)
        for _ in range(2)
    ]
    full = LLMAgent(tiny, prompt_format=MathTIRPrompt(), sampling=SamplingParams(max_new_tokens=16))
    obs_info = [e.reset(options={"task_id": task_ids_of(e)[i + 2]}) for i, e in enumerate(envs)]
    sent: dict[int, list[str]] = {0: [], 1: []}
    live = {0, 1}
    while live:
        ids = sorted(live)
        acts = full.act([obs_info[i][0] for i in ids], [obs_info[i][1] for i in ids], ids)
        for i, a in zip(ids, acts, strict=True):
            sent[i].append(a)
            obs, _, term, trunc, info = envs[i].step(a)
            obs_info[i] = (obs, info)
            if term or trunc:
                live.discard(i)
                record = full.end_episode(i)
                record.set_outcome(0.0, bool(info["won"]), term, trunc, info, obs, bool(info["action_valid"]))
                check_trajectory(record, tiny, sent[i])
    for e in envs:
        e.close()


def test_context_budget_exhaustion_is_an_invalid_action(tiny: HFBackend, alfworld_env: gym.Env) -> None:
    agent = LLMAgent(
        tiny,
        prompt_format=ALFWorldPrompt(),
        sampling=SamplingParams(max_new_tokens=8),
        context=ContextPolicy(mode="full", max_context_tokens=420),
    )
    traj, actions = play(alfworld_env, agent)
    assert traj.info.get("context_exhausted") is True
    assert actions[-1] == "" and traj.turns[-1].action_span == (0, 0) and traj.turns[-1].action_valid is False
    assert len(traj.sequences[0]) <= 420
    check_trajectory(traj, tiny, actions)


def test_random_text_agent_smoke(math_env: gym.Env) -> None:
    result = play_episode(math_env, RandomTextAgent(seed=3), options={"task_id": task_ids_of(math_env)[0]})
    again = play_episode(math_env, RandomTextAgent(seed=3), options={"task_id": task_ids_of(math_env)[0]})
    assert [t.action for t in result.turns] == [t.action for t in again.turns] and result.record is None


def test_parsers() -> None:
    info = {"admissible_commands": ["go to fridge 1", "take apple 1 from fridge 1", "look"]}
    fmt = ALFWorldPrompt()
    assert fmt.parse_action("  > Go to Fridge 1.\nblah", info).action == "go to fridge 1"
    assert fmt.parse_action("Action: look", info).valid
    bad = fmt.parse_action("fly to the moon", info)
    assert not bad.valid and bad.action == "fly to the moon" and "not an admissible" in (bad.error or "")
    assert not fmt.parse_action("", info).valid
    math = MathTIRPrompt()
    code = math.parse_action("Compute.\n```python\nprint(2)\n```\n```output\n3\n```", {})
    assert code.valid and code.action.endswith("```") and "output" not in code.action
    assert math.parse_action("so \\boxed{\\frac{1}{2}}", {}).valid
    assert extract_boxed("a \\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert not math.parse_action("I think it is 4", {}).valid


def test_alfworld_commands_one_per_line_tokenize_like_replies(tiny: HFBackend) -> None:
    # Listed one per line, each command is the same token string as the reply that issues it (comma-separated,
    # the first word of every command but the first gets a leading-space token instead).
    commands = ["examine pan 1", "move pan 1 to cabinet 7", "take apple 2 from cabinet 7"]
    info = {"admissible_commands": ["go to fridge 1", *commands]}
    text = ALFWorldPrompt(list_go_to=False, one_command_per_line=True).user_message("You arrive.", info, 1)
    assert text == "You arrive.\nAdmissible commands:\n" + "\n".join(commands)
    tok = tiny.tokenizer
    listed = tok.encode(text, add_special_tokens=False)
    for command in commands:
        reply = tok.encode(command, add_special_tokens=False)
        assert any(listed[i : i + len(reply)] == reply for i in range(len(listed))), command
    flat = tok.encode(
        ALFWorldPrompt(list_go_to=False).user_message("You arrive.", info, 1), add_special_tokens=False
    )
    reply = tok.encode(commands[1], add_special_tokens=False)
    assert not any(flat[i : i + len(reply)] == reply for i in range(len(flat)))


def test_alfworld_frontier_lists_the_receptacles_left_to_search_next_first() -> None:
    commands = ["examine drawer 1", "go to cabinet 1", "go to drawer 1", "go to fridge 1", "open drawer 1"]
    assert go_to_frontier(commands, []) == ["go to cabinet 1", "go to drawer 1", "go to fridge 1"]
    assert go_to_frontier(commands, ["drawer 1"]) == ["go to cabinet 1", "go to fridge 1"]
    # Every receptacle visited: the search starts over, least recently visited first, never where it stands.
    assert go_to_frontier(commands, ["fridge 1", "cabinet 1", "drawer 1"]) == [
        "go to fridge 1",
        "go to cabinet 1",
    ]
    assert go_to_frontier(["look"], ["drawer 1"]) == []
    info = {"admissible_commands": commands, "visited": ["drawer 1"]}
    text = ALFWorldPrompt(list_go_to="frontier", one_command_per_line=True).user_message(
        "You arrive.", info, 1
    )
    assert text == (
        "You arrive.\nAdmissible commands:\nexamine drawer 1\nopen drawer 1\n"
        "Left to search:\ngo to cabinet 1\ngo to fridge 1"
    )
    assert (
        ALFWorldPrompt(list_go_to="frontier")
        .user_message("Hi.", info, 1)
        .endswith("Left to search: go to cabinet 1, go to fridge 1")
    )
    with pytest.raises(ValueError, match="list_go_to must be True, False or 'frontier'"):
        ALFWorldPrompt(list_go_to="unvisited")  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.lists(st.text(max_size=20), max_size=5))
def test_parsers_never_raise(text: str, commands: list[str]) -> None:
    for fmt in (ALFWorldPrompt(), MathTIRPrompt()):
        parsed = fmt.parse_action(text, {"admissible_commands": commands})
        assert isinstance(parsed.action, str) and (parsed.valid or parsed.error)


@pytest.mark.slow
def test_smollm2_plays_a_short_episode(alfworld_env: gym.Env) -> None:
    backend = HFBackend("smollm2-135m")
    agent = LLMAgent(backend, prompt_format=ALFWorldPrompt(), sampling=SamplingParams(max_new_tokens=6))
    env = gym.make("streamrl/ALFWorld-v0", split="train", max_steps=2)
    try:
        traj, actions = play(env, agent)
    finally:
        env.close()
    assert len(traj.turns) == 2
    check_trajectory(traj, backend, actions)


def test_a_run_seed_gives_each_episode_and_turn_its_own_draws(tiny: HFBackend, math_env: gym.Env) -> None:
    """``sampling.seed`` is the run seed: each (episode, turn) samples with its own seed derived from it, so
    episodes acting in separate calls on the same observation (a replayed task, a group) draw different
    samples, and the same (run seed, episode, turn) reproduces its sample."""
    obs, info = math_env.reset(options={"task_id": task_ids_of(math_env)[0]})

    def run(seed: int) -> tuple[LLMAgent, list[str]]:
        agent = LLMAgent(
            tiny, prompt_format=MathTIRPrompt(), sampling=SamplingParams(max_new_tokens=16, seed=seed)
        )
        texts = []
        for eid in ("a", "b"):  # the same first observation, one call each
            agent.act([obs], [info], [eid])
            texts.append(agent._episodes[eid].trajectory.turns[0].text)
        agent.act([obs, obs], [info, info], ["a", "b"])  # a second turn of both, in one call
        return agent, texts

    agent, texts = run(seed=5)
    assert texts[0] != texts[1]
    again, texts_again = run(seed=5)
    assert texts_again == texts
    assert run(seed=6)[1] != texts
    for eid in ("a", "b"):
        record, repeat = agent.end_episode(eid), again.end_episode(eid)
        assert [s.token_ids for s in record.sequences] == [s.token_ids for s in repeat.sequences]
        seeds = [turn.seed for turn in record.turns]
        assert seeds == [derive_seed(5, eid, t) for t in range(2)] and seeds[0] != seeds[1]
        # a turn's sample is its prompt and its seed: regenerating them gives the recorded tokens
        turn, seq = record.turns[1], record.sequences[0]
        prompt = seq.token_ids[: turn.action_span[0]]
        params = replace(agent.sampling, max_new_tokens=16)
        (same,) = tiny.generate([prompt], params, seeds=[turn.seed])
        assert same.token_ids == seq.token_ids[slice(*turn.action_span)]


def test_play_episode_returns_a_complete_record(tiny: HFBackend, alfworld_env: gym.Env) -> None:
    agent = LLMAgent(tiny, prompt_format=ALFWorldPrompt(), sampling=SamplingParams(max_new_tokens=8))
    task_id = task_ids_of(alfworld_env)[1]
    result = play_episode(alfworld_env, agent, options={"task_id": task_id})
    record = result.record
    assert isinstance(record, Trajectory) and result.truncated  # max_steps=4 for tiny's random walk
    assert (record.reward, record.won, record.terminated, record.truncated) == (
        result.reward,
        result.won,
        result.terminated,
        result.truncated,
    )
    assert record.info["task_id"] == task_id and "admissible_commands" in record.info
    assert [t.observation for t in record.turns] == [t.observation for t in result.turns]
    assert [t.action_valid for t in record.turns] == [t.action_valid for t in result.turns]


def test_set_outcome_fills_the_last_turn_from_the_final_info() -> None:
    record = Trajectory(task_id="t")
    record.turns.append(
        TurnRecord(text="go", action="go", sequence=0, action_span=(0, 0), prompt_span=(0, 0))
    )
    record.set_outcome(1.0, True, True, False, {"action_valid": True, "won": True}, last_observation="done")
    assert record.turns[-1].action_valid is True and record.turns[-1].observation == "done"
    assert record.reward == 1.0 and record.won and record.info["won"] is True
