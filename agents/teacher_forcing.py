"""Expert data for behaviour cloning, rendered through the LLM agent's own prompts and masks.

Each expert episode (``ALFWorldSearchAgent``, which searches the room and decides from what the agent sees;
``MathSolverAgent`` writing correct tool code) is played through a real ``LLMAgent`` whose backend is
*teacher-forced*: it "generates" the tokens of the expert's action followed by the end-of-turn token. The
resulting ``Trajectory`` therefore has exactly the token layout, chat rendering, context policy and
``action_mask`` that the agent produces at RL time -- one piece of code renders both, so what SFT trains on is
what the policy later sees and emits.

Options: DART noise (random actions that are context, not targets, so the expert's next actions are recovery
demonstrations), slips (a near miss of the expert's action that the env rejects, then the missed action as a
target: what to write after "Nothing happens."), extra generated tasks (``EnvSpec.synthetic_tasks``) and
downsampling of frequent actions (``downsample_turns``). ``sequences_of`` turns the trajectories into training
sequences, masking the turns that are context only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from streamrl.agents.base import Agent, EpisodeId, Generation, SamplingParams
from streamrl.agents.env_specs import env_spec, expert_factory, make_env, task_ids_of
from streamrl.agents.llm_agent import ContextPolicy, LLMAgent
from streamrl.agents.prompts import PromptFormat
from streamrl.agents.rollout import play_episode
from streamrl.agents.trajectory import TokenSequence, Trajectory


class TeacherForcedBackend:
    """A ``GenerationBackend`` that "generates" queued token ids (log-prob 0): the expert's action tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.queue: list[list[int]] = []

    @property
    def adapter_version(self) -> int:
        return 0

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        if len(self.queue) != len(prompts):
            raise RuntimeError(f"{len(prompts)} prompts but {len(self.queue)} forced completions queued")
        out = [Generation(list(ids), [0.0] * len(ids), "stop") for ids in self.queue]
        self.queue = []
        return out

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        raise NotImplementedError("a teacher-forced backend has no model to score with")

    def set_adapter(self, path: str | None, version: int) -> None:
        raise NotImplementedError("a teacher-forced backend has no model")

    def close(self) -> None:
        pass


class TeacherForcedAgent:
    """Plays an expert's actions while recording them as an ``LLMAgent`` would have generated them.

    With ``noise > 0`` (DART, Laskey et al. 2017, arXiv:1703.09327), each turn is, with that probability, a
    ``random_action`` instead of the expert's: the episode then visits states off the expert's path, and the
    expert's next actions are recovery demonstrations. Noise turns stay in the trajectory (as context of the
    turns after them) but are not trained on: their indices are in ``info["noise_turns"]`` and
    ``info["untrained_turns"]``, which ``sequences_of`` masks. The
    expert must decide from the state, not from a plan (``ALFWorldSearchAgent``, not the walkthrough).

    With ``slips > 0``, each turn (but the one right after a slip) is, with that probability, a slip: the
    ``slip_action`` near miss of the expert's own action, which the env rejects without changing the state.
    The slip is context only (``info["slip_turns"]``, in ``info["untrained_turns"]``) and the turn after it
    plays the command the slip missed -- still the expert's action, the state being the same, though the
    expert might decide otherwise on "Nothing happens." than on the observation it had (ALFWorld's reads
    "You pick up ..." to go and heat what it picked) -- always a target (``info["recovery_turns"]``, which
    ``downsample_turns`` leaves alone): a policy that imitates it writes, after a rejected command, the one it
    missed instead of repeating the rejected one -- what greedy decoding, deterministic in an unchanged state,
    never finds by itself.
    """

    def __init__(
        self,
        expert: Agent,
        tokenizer: Any,
        prompt_format: PromptFormat,
        context: ContextPolicy,
        noise: float = 0.0,
        random_action: Callable[[Mapping[str, Any], random.Random], str] | None = None,
        seed: int = 0,
        slips: float = 0.0,
        slip_action: Callable[[str, Mapping[str, Any], random.Random], str | None] | None = None,
    ) -> None:
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        if noise and random_action is None:
            raise ValueError(f"noise={noise} needs a random_action to inject")
        if not 0.0 <= slips < 1.0:
            raise ValueError(f"slips must be in [0, 1), got {slips}")
        if slips and slip_action is None:
            raise ValueError(f"slips={slips} needs a slip_action to make them")
        self.expert = expert
        self.backend = TeacherForcedBackend(tokenizer)
        self.llm = LLMAgent(
            self.backend,
            prompt_format=prompt_format,
            tokenizer=tokenizer,
            sampling=SamplingParams(max_new_tokens=4096),
            context=context,
        )
        eos = tokenizer.eos_token_id
        self._eos = [int(eos)] if eos is not None else []
        self.noise, self.random_action, self._rng = noise, random_action, random.Random(seed)
        self.slips, self.slip_action = slips, slip_action
        self._noise_turns: dict[EpisodeId, list[int]] = {}
        self._slip_turns: dict[EpisodeId, list[int]] = {}
        self._missed: dict[EpisodeId, str] = {}
        self._turns: dict[EpisodeId, int] = {}

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = self.expert.act(observations, infos, episode_ids)
        for i, (info, eid) in enumerate(zip(infos, episode_ids, strict=True)):
            turn = self._turns.get(eid, 0)
            self._turns[eid] = turn + 1
            missed = self._missed.pop(eid, None)
            if missed is not None:  # the turn after a slip: the command it missed, always a target
                actions[i] = missed
            elif self.slips and self._rng.random() < self.slips and self._slip(actions, i, info, eid):
                self._slip_turns.setdefault(eid, []).append(turn)
            elif self.noise and self._rng.random() < self.noise:
                assert self.random_action is not None
                actions[i] = self.random_action(info, self._rng)
                self._noise_turns.setdefault(eid, []).append(turn)
        self.backend.queue = [self.llm.chat.encode(a) + self._eos for a in actions]
        self.llm.act(observations, infos, episode_ids)
        return actions

    def _slip(self, actions: list[str], i: int, info: Mapping[str, Any], eid: EpisodeId) -> bool:
        """Replace ``actions[i]`` by its slip and remember the command it missed for the next turn; ``False``
        (unchanged) when it has none."""
        assert self.slip_action is not None
        slip = self.slip_action(actions[i], info, self._rng)
        if slip is not None:
            self._missed[eid], actions[i] = actions[i], slip
        return slip is not None

    def end_episode(self, episode_id: EpisodeId) -> Trajectory:
        self.expert.end_episode(episode_id)
        noise_turns = self._noise_turns.pop(episode_id, [])
        slip_turns = self._slip_turns.pop(episode_id, [])
        self._missed.pop(episode_id, None)
        self._turns.pop(episode_id, None)
        trajectory = self.llm.end_episode(episode_id)
        trajectory.info["noise_turns"] = list(noise_turns)
        if self.slips:
            trajectory.info["slip_turns"] = list(slip_turns)
            # every slip but one on the episode's last turn is followed by its recovery
            trajectory.info["recovery_turns"] = [t + 1 for t in slip_turns if t + 1 < len(trajectory.turns)]
        trajectory.info["untrained_turns"] = sorted({*noise_turns, *slip_turns})
        return trajectory


def expert_trajectories(
    env_name: str,
    tokenizer: Any,
    split: str | None = None,
    limit: int | None = None,
    synthetic: int = 0,
    seed: int = 0,
    replays: int = 1,
    noise: float = 0.0,
    slips: float = 0.0,
) -> list[Trajectory]:
    """Won expert episodes of ``env_name`` as trajectories: every task of the split (or the first ``limit``),
    then ``synthetic`` generated tasks (``EnvSpec.synthetic_tasks``; an error for envs without a generator).

    Each split task is played ``replays`` times: the first time by the expert alone, then with DART noise
    ``noise`` (``TeacherForcedAgent``; needs ``EnvSpec.random_action``), each replay with its own draws.
    ``slips`` is the per-turn probability of a slip and its recovery in every episode, generated ones
    included (``TeacherForcedAgent``; needs ``EnvSpec.slip_action``).
    """
    spec = env_spec(env_name)
    make_expert = expert_factory(env_name)
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    if noise and spec.random_action is None:
        raise ValueError(
            f"env {env_name!r} has no random_action for DART noise; noise must be 0, got {noise}"
        )
    if slips and spec.slip_action is None:
        raise ValueError(f"env {env_name!r} has no slip_action; slips must be 0, got {slips}")
    sources: list[tuple[Any, list[str], float, int]] = []
    env = make_env(env_name, split or spec.train_split, **dict(spec.expert_env_kwargs))
    task_ids = task_ids_of(env, env_name)[:limit]
    sources.append((env, task_ids, 0.0, seed))
    for replay in range(1, replays):
        sources.append((env, task_ids, noise, seed * 1000 + replay))
    if synthetic:
        if spec.synthetic_tasks is None:
            raise ValueError(f"env {env_name!r} has no task generator; synthetic must be 0, got {synthetic}")
        extra = {**spec.synthetic_tasks(synthetic, seed), **dict(spec.expert_env_kwargs)}
        synth_env = make_env(env_name, spec.train_split, **extra)
        sources.append((synth_env, task_ids_of(synth_env, env_name), 0.0, seed))
    out: list[Trajectory] = []
    try:
        for source_env, source_ids, source_noise, source_seed in sources:
            agent = TeacherForcedAgent(
                make_expert(source_env),
                tokenizer,
                spec.prompt(),
                spec.context,
                noise=source_noise,
                random_action=spec.random_action,
                seed=source_seed,
                slips=slips,
                slip_action=spec.slip_action,
            )
            for task_id in source_ids:
                result = play_episode(source_env, agent, options={"task_id": task_id})
                trajectory = result.record
                assert trajectory is not None  # a TeacherForcedAgent keeps a record
                if trajectory.won and "context_exhausted" not in trajectory.info:
                    out.append(trajectory)
    finally:
        for source_env in {id(s[0]): s[0] for s in sources}.values():
            source_env.close()
    return out


def downsample_turns(
    trajectories: Sequence[Trajectory], rules: Sequence[tuple[str, float]], rng: random.Random
) -> None:
    """Add to ``info["untrained_turns"]`` each turn whose action starts with a rule's prefix, unless a draw
    falls under the rule's keep probability (``SFTConfig.downsample``). Recoveries from a slip
    (``info["recovery_turns"]``) stay targets: they are what the slips are there to teach."""
    if not rules:
        return
    for traj in trajectories:
        untrained = set(traj.info.get("untrained_turns", ()))
        recoveries = set(traj.info.get("recovery_turns", ()))
        for i, turn in enumerate(traj.turns):
            if i in recoveries:
                continue
            keep = next((p for prefix, p in rules if turn.action.startswith(prefix)), 1.0)
            if keep < 1.0 and rng.random() >= keep:
                untrained.add(i)
        traj.info["untrained_turns"] = sorted(untrained)


def sequences_of(trajectories: Sequence[Trajectory]) -> list[TokenSequence]:
    """The training sequences of ``trajectories``: those with action tokens, where the turns listed in
    ``info["untrained_turns"]`` (noise, downsampled) are context (mask 0) -- copies; trajectories unchanged."""
    out: list[TokenSequence] = []
    for traj in trajectories:
        sequences = list(traj.sequences)
        for index in traj.info.get("untrained_turns", ()):
            turn = traj.turns[index]
            if turn.sequence < 0 or turn.action_span[0] == turn.action_span[1]:
                continue
            seq = sequences[turn.sequence]
            if seq is traj.sequences[turn.sequence]:  # copy before the first change
                seq = sequences[turn.sequence] = TokenSequence(
                    list(seq.token_ids),
                    list(seq.action_mask),
                    list(seq.rollout_logprobs),
                    list(seq.token_versions),
                )
            for k in range(*turn.action_span):
                seq.action_mask[k], seq.rollout_logprobs[k], seq.token_versions[k] = 0, 0.0, -1
        out.extend(s for s in sequences if s.num_action_tokens)
    return out
