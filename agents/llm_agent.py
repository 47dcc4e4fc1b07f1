"""``LLMAgent``: a generation backend + a prompt format, token-in/token-out, for many concurrent episodes.

Per episode the agent keeps the exact token ids the policy saw and produced. Observations are appended as
tokenized chat turns (the tokenizer's own chat template, rendered as a *delta*: the end of the assistant turn
that the model did not generate itself, then the user message and the opening of the next assistant turn);
generated tokens are appended as the backend returned them. Text is never re-tokenized to rebuild what the
policy generated, so ``action_mask`` is 1 exactly on tokens the policy sampled and the training sequence is
the sampled one.

Context policies (``ContextPolicy``):

- ``"full"`` (SPO++): one growing sequence per episode -- system, first observation, action, observation, ...
  When the next prompt would leave no room under ``max_context_tokens``, the agent stops generating for that
  episode: it answers ``""`` (an invalid action) and notes ``info["context_exhausted"] = True``.
- ``"window"`` (verl-agent): each turn is its own sequence: the system message, the first observation (the task
  or problem, always kept), then the last ``window_turns`` (action, observation) pairs re-rendered as context,
  then the current observation; older turns are dropped first when over ``max_context_tokens``.

Seeds: ``sampling.seed`` is the *run* seed. Turn ``t`` of episode ``e`` samples with its own seed
``derive_seed(run seed, e, t)`` (``streamrl.agents.base``), whatever else shares the backend call, so episodes
that act on the same prompt in separate calls (a replayed task, the members of a group) draw different
samples, and a run replays exactly from its seed and episode ids. The seed is kept in
``TurnRecord.seed``: a turn's tokens are ``backend.generate([prompt], params, seeds=[seed])``. With
``sampling.seed=None`` the backend's own generator draws every seed (``TurnRecord.seed`` is then ``None``).

Constrained actions: ``constrain_actions=True`` makes every turn one of the prompt format's
``action_choices(info)`` (ALFWorld: the admissible commands), each followed by the end-of-turn token: the
backend samples only tokens that continue one of them (``GenerationBackend.generate(choices=...)``) and the
sequence records which ids were allowed at each generated token (``TokenSequence.choice_ids``), so that the
learner scores the renormalized distribution the tokens were drawn from. The policy then never writes an
inadmissible command; a turn whose info lists no choices is generated unconstrained. HF backends (local or
as Ray engines) constrain; vLLM's raises. ``avoid_repeats=True`` also leaves out of a turn's choices the
commands the episode already took from the same state (the same observation with the same choices), unless
none would be left: a constrained policy can then not cycle (``use desklamp 1`` again and again, two
receptacles in turn), it tries something else from a state it has seen. The recorded allowed ids are the
reduced set, so the learner scores the policy as it sampled.

Lost generations: a backend that loses a request (``Generation.error``: a rollout engine died) gets no turn
recorded for it; ``lost(episode_id)`` says why, and the episode must end there (the runtime ends it as failed).

Outcomes: ``play_episode`` fills reward / won / terminated / truncated and the final info into the record it
returns; whoever steps the env itself (a vector env's runtime) calls ``Trajectory.set_outcome``::

    agent = LLMAgent(HFBackend("tiny"), prompt_format=ALFWorldPrompt())
    trajectory = play_episode(env, agent).record
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from streamrl.agents.base import (
    EpisodeId,
    Generation,
    GenerationBackend,
    SamplingParams,
    allowed_next_tokens,
    derive_seed,
)
from streamrl.agents.prompts import PromptFormat
from streamrl.agents.trajectory import CONTEXT_POLICIES, ContextMode, TokenSequence, Trajectory, TurnRecord


@dataclass(frozen=True)
class ContextPolicy:
    """What the policy sees at each turn."""

    mode: ContextMode = "full"
    """"full": the whole episode in one sequence (SPO++); "window": the last ``window_turns`` turns (verl-agent)."""
    window_turns: int = 2
    """``k``: past (action, observation) pairs kept in "window" mode (the first observation is always kept)."""
    max_context_tokens: int = 4096
    """Budget for prompt + generation of one turn (the sequence length in "full" mode)."""

    def __post_init__(self) -> None:
        if self.mode not in CONTEXT_POLICIES:
            raise ValueError(f"context mode must be one of {CONTEXT_POLICIES}, got {self.mode!r}")
        if self.window_turns < 0:
            raise ValueError(f"window_turns must be >= 0, got {self.window_turns}")
        if self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {self.max_context_tokens}")


class ChatTokens:
    """Chat turns as token ids through a tokenizer's own chat template (ChatML and similar).

    ``start`` renders the system and first user message plus the generation prompt; ``continuation`` is
    what follows a generated assistant turn: the template's end-of-turn text not generated by the model, the
    next user message and the generation prompt. Derived once by rendering probe conversations.
    """

    _SYS, _USER, _ACT, _NEXT = "\x01SYS\x01", "\x01USER\x01", "\x01ACT\x01", "\x01NEXT\x01"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        base = [
            {"role": "system", "content": self._SYS},
            {"role": "user", "content": self._USER},
            {"role": "assistant", "content": self._ACT},
        ]
        closed = self._render(base, generation_prompt=False)
        opened = self._render([*base, {"role": "user", "content": self._NEXT}], generation_prompt=True)
        if not opened.startswith(closed) or self._ACT not in closed:
            raise ValueError(
                f"chat template of {type(tokenizer).__name__} does not render conversations incrementally "
                "(appending a message changes earlier text); LLMAgent needs such a template, e.g. ChatML"
            )
        self.turn_close = closed[closed.index(self._ACT) + len(self._ACT) :]
        self.user_prefix, self.user_suffix = opened[len(closed) :].split(self._NEXT)
        eos = tokenizer.eos_token
        self.eos_text: str = eos if isinstance(eos, str) else ""
        self.eos_token_id: int | None = tokenizer.eos_token_id

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt."""
        return self.encode(self._render(messages, generation_prompt=True))

    def continuation(self, user_content: str, generated: Sequence[int]) -> list[int]:
        """Tokens to append after the generated tokens ``generated`` to add a user turn ``user_content``."""
        close = self.turn_close
        if generated and generated[-1] == self.eos_token_id and close.startswith(self.eos_text):
            close = close[len(self.eos_text) :]  # the model already produced the end-of-turn token
        return self.encode(close + self.user_prefix + user_content + self.user_suffix)


@dataclass
class _Episode:
    episode_id: EpisodeId
    trajectory: Trajectory
    messages: list[dict[str, str]]
    first_user: dict[str, str]
    sequence: TokenSequence | None = None
    last_generated: list[int] = field(default_factory=list)
    exhausted: bool = False
    lost: str | None = None  # why the backend lost the last generation (Generation.error)
    last_return: float | None = None
    tool_calls: int = 0  # the env's cumulative info["tool_calls"] seen so far
    tried: dict[tuple[str, tuple[str, ...]], set[str]] = field(default_factory=dict)
    """``avoid_repeats``: per state (observation, choices), the commands taken from it."""
    first_prompt: list[int] | None = None
    """"window" mode: the first turn's prompt ids, whose head every later prompt starts with."""


class LLMAgent:
    """An ``Agent`` backed by an LLM (see module doc)."""

    def __init__(
        self,
        backend: GenerationBackend,
        *,
        prompt_format: PromptFormat,
        tokenizer: Any = None,
        sampling: SamplingParams | None = None,
        context: ContextPolicy | None = None,
        constrain_actions: bool = False,
        avoid_repeats: bool = False,
    ) -> None:
        """``prompt_format``: how observations become messages and replies become actions (e.g.
        ``ALFWorldPrompt()``, ``MathTIRPrompt()``); its stop strings are added to ``sampling.stop_strings``.
        ``tokenizer`` defaults to ``backend.tokenizer``; ``sampling`` to temperature 1 and 64 new tokens, its
        ``seed`` being the run seed (module doc). ``constrain_actions``: generate only the prompt format's
        ``action_choices``; ``avoid_repeats`` (with it): not the commands already taken from the same state
        (module doc)."""
        self.backend = backend
        self.tokenizer: Any = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
        if self.tokenizer is None:
            raise ValueError(f"{type(backend).__name__} has no .tokenizer; pass tokenizer=...")
        self.prompt_format = prompt_format
        base = sampling or SamplingParams(max_new_tokens=64)
        stops = tuple(dict.fromkeys((*base.stop_strings, *prompt_format.stop_strings)))
        self.sampling = replace(base, stop_strings=stops)
        self.context = context or ContextPolicy()
        self.chat = ChatTokens(self.tokenizer)
        self.constrain_actions = constrain_actions
        if avoid_repeats and not constrain_actions:
            raise ValueError("avoid_repeats=True needs constrain_actions=True: it removes choices")
        self.avoid_repeats = avoid_repeats
        if constrain_actions:
            if not callable(getattr(prompt_format, "action_choices", None)):
                raise ValueError(
                    f"constrain_actions=True needs a prompt format with action_choices(info) (e.g. "
                    f"ALFWorldPrompt); {type(prompt_format).__name__} has none"
                )
            if "choices" not in inspect.signature(backend.generate).parameters:
                raise ValueError(
                    f"constrain_actions=True needs a backend whose generate takes choices= (HFBackend, "
                    f"RayEngines of HF engines); {type(backend).__name__}.generate does not"
                )
        # A windowed episode's prompts all start with its system message and first observation: a backend that
        # keeps prompt heads (HFBackend's prefix cache) keeps that one instead of every turn's whole sequence.
        self._keep_heads = (
            self.context.mode == "window" and "keep" in inspect.signature(backend.generate).parameters
        )
        self._episodes: dict[EpisodeId, _Episode] = {}
        self._pending: dict[EpisodeId, tuple[str | None, Any]] = {}

    # -- episode bookkeeping ------------------------------------------------------------------------------

    def begin_episode(self, episode_id: EpisodeId, task_id: str | None = None, ticket: Any = None) -> None:
        """Optionally name the task and attach the dispatcher's ticket before the first ``act``."""
        if episode_id in self._episodes:
            raise ValueError(f"episode {episode_id!r} already started")
        self._pending[episode_id] = (task_id, ticket)

    def _start(self, episode_id: EpisodeId, observation: str, info: Mapping[str, Any]) -> _Episode:
        task_id, ticket = self._pending.pop(episode_id, (None, None))
        trajectory = Trajectory(
            task_id=str(task_id if task_id is not None else info.get("task_id", "")),
            ticket=ticket,
            context_policy=self.context.mode,
            timings={"start": time.time(), "generation_s": 0.0, "env_s": 0.0},
        )
        system = {"role": "system", "content": self.prompt_format.system_prompt(observation, info)}
        first = {"role": "user", "content": self.prompt_format.user_message(observation, info, 0)}
        episode = _Episode(episode_id, trajectory, [system, first], first)
        self._episodes[episode_id] = episode
        return episode

    def _observe(self, episode: _Episode, observation: str, info: Mapping[str, Any]) -> str:
        """File the reply to the previous action; return the user message for ``observation``."""
        turn = episode.trajectory.turns[-1]
        turn.observation = observation
        if "action_valid" in info:
            turn.action_valid = bool(info["action_valid"])
        total = int(info.get("tool_calls", 0) or 0)  # cumulative in the env; the turn keeps its own share
        turn.tool_calls, episode.tool_calls = max(0, total - episode.tool_calls), total
        if episode.last_return is not None:
            episode.trajectory.timings["env_s"] += time.perf_counter() - episode.last_return
        content = self.prompt_format.user_message(observation, info, len(episode.trajectory.turns))
        episode.messages.append({"role": "assistant", "content": turn.text})
        episode.messages.append({"role": "user", "content": content})
        return content

    def _window_messages(self, episode: _Episode, keep_turns: int) -> list[dict[str, str]]:
        """System, first observation, then the last ``keep_turns`` (action, observation) pairs (at least the
        current observation)."""
        system, rest = episode.messages[0], episode.messages[2:]
        if not rest:
            return [system, episode.first_user]
        recent = rest[-2 * keep_turns :] if keep_turns else rest[-1:]
        return [system, episode.first_user, *recent]

    def _prompt(self, episode: _Episode, new_user: str | None) -> tuple[list[int], int] | None:
        """``(prompt ids, start of the new context)`` for the next generation, or ``None`` if out of budget."""
        budget = self.context.max_context_tokens
        if self.context.mode == "full":
            if episode.sequence is None:
                ids = self.chat.render(list(episode.messages))
                start = 0
            else:
                assert new_user is not None
                ids = episode.sequence.token_ids + self.chat.continuation(new_user, episode.last_generated)
                start = len(episode.sequence)
            return (ids, start) if len(ids) < budget else None
        for keep in range(min(self.context.window_turns, len(episode.trajectory.turns)), -1, -1):
            ids = self.chat.render(self._window_messages(episode, keep))
            if len(ids) < budget:
                return ids, 0
        return None

    # -- the Agent protocol ---------------------------------------------------------------------------------

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        """One action per episode; all episodes' generations go to the backend together."""
        if not len(observations) == len(infos) == len(episode_ids):
            raise ValueError(
                f"act got {len(observations)} observations, {len(infos)} infos, {len(episode_ids)} episode ids"
            )
        if len(set(episode_ids)) != len(episode_ids):
            raise ValueError(f"duplicate episode ids in one act call: {list(episode_ids)}")
        actions = [""] * len(observations)
        jobs: list[tuple[int, _Episode, list[int], int]] = []
        options: dict[int, list[list[int]] | None] = {}
        states: dict[int, tuple[str, tuple[str, ...]]] = {}
        for i, (obs, info, eid) in enumerate(zip(observations, infos, episode_ids, strict=True)):
            episode = self._episodes.get(eid)
            if episode is None:
                episode, new_user = self._start(eid, obs, info), None
            else:
                new_user = self._observe(episode, obs, info)
            prompt = None if episode.exhausted else self._prompt(episode, new_user)
            if prompt is None:
                episode.exhausted = True
                episode.trajectory.info["context_exhausted"] = True
                self._record_empty_turn(episode)
                continue
            ids, start = prompt
            jobs.append((i, episode, ids, start))
            if self.constrain_actions:
                listed = self.prompt_format.action_choices(info) or []  # type: ignore[attr-defined]
                texts = tuple(dict.fromkeys(str(t) for t in listed))
                if self.avoid_repeats:
                    states[i] = (obs, texts)
                    tried = episode.tried.get(states[i], set())
                    texts = tuple(t for t in texts if t not in tried) or texts
                options[i] = self._choices(texts)

        by_budget: dict[int, list[tuple[int, _Episode, list[int], int]]] = {}
        for job in jobs:
            room = self.context.max_context_tokens - len(job[2])
            by_budget.setdefault(min(self.sampling.max_new_tokens, room), []).append(job)
        for max_new, group in by_budget.items():
            params = replace(self.sampling, max_new_tokens=max_new)
            seeds = None
            if params.seed is not None:
                seeds = [
                    derive_seed(params.seed, e.episode_id, len(e.trajectory.turns)) for _, e, _, _ in group
                ]
            started = time.perf_counter()
            prompts = [ids for _, _, ids, _ in group]
            extra: dict[str, Any] = {}
            if self.constrain_actions:
                extra["choices"] = [options[i] for i, _, _, _ in group]
            if self._keep_heads:
                extra["keep"] = [self._head(e, ids) for _, e, ids, _ in group]
            generations = self.backend.generate(prompts, params, seeds, **extra)
            seconds = time.perf_counter() - started
            for j, ((i, episode, ids, start), gen) in enumerate(zip(group, generations, strict=True)):
                if gen.error is not None:  # no turn to record: the episode ends here (``lost``)
                    episode.lost = gen.error
                    continue
                seed = None if seeds is None else seeds[j]
                actions[i] = self._record_turn(
                    episode, ids, start, gen, seed, seconds, infos[i], options.get(i)
                )
                if i in states:
                    episode.tried.setdefault(states[i], set()).add(actions[i])
        now = time.perf_counter()
        for eid in episode_ids:
            self._episodes[eid].last_return = now
        return actions

    @staticmethod
    def _head(episode: _Episode, ids: list[int]) -> int:
        """How many leading tokens of ``ids`` the episode's first prompt shares (all of them at the first turn):
        the window's fixed head, which every later prompt of the episode starts with."""
        if episode.first_prompt is None:
            episode.first_prompt = list(ids)
            return len(ids)
        first, n = episode.first_prompt, 0
        for a, b in zip(first, ids, strict=False):
            if a != b:
                break
            n += 1
        return n

    def _record_turn(
        self,
        episode: _Episode,
        prompt: list[int],
        start: int,
        gen: Generation,
        seed: int | None,
        seconds: float,
        info: Mapping[str, Any],
        choices: list[list[int]] | None = None,
    ) -> str:
        trajectory = episode.trajectory
        allowed = None
        if choices is not None:
            generated = list(gen.token_ids)
            allowed = [allowed_next_tokens(choices, generated[:j]) for j in range(len(generated))]
            stray = next((j for j, a in enumerate(allowed) if generated[j] not in a), None)
            if stray is not None:
                raise RuntimeError(
                    f"{type(self.backend).__name__} ignored the action constraint: generated token {stray} "
                    f"({generated[stray]}) continues none of the {len(choices)} choices"
                )
        if self.context.mode == "full":
            if episode.sequence is None:
                episode.sequence = TokenSequence()
                trajectory.sequences.append(episode.sequence)
            sequence = episode.sequence
            prompt_span = sequence.extend_context(prompt[start:])
        else:
            sequence = TokenSequence()
            trajectory.sequences.append(sequence)
            prompt_span = sequence.extend_context(prompt)
        action_span = sequence.extend_action(
            list(gen.token_ids), list(gen.logprobs), gen.adapter_version, allowed
        )
        episode.last_generated = list(gen.token_ids)
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        parsed = self.prompt_format.parse_action(text, info)
        trajectory.turns.append(
            TurnRecord(
                text=text,
                action=parsed.action,
                sequence=len(trajectory.sequences) - 1,
                action_span=action_span,
                prompt_span=prompt_span,
                parse_error=parsed.error,
                finish_reason=gen.finish_reason,
                adapter_version=gen.adapter_version,
                action_valid=None if parsed.valid else False,
                seed=seed,
                generation_seconds=seconds,
            )
        )
        trajectory.timings["generation_s"] += seconds
        return parsed.action

    def _choices(self, texts: Sequence[str]) -> list[list[int]] | None:
        """The token ids of each command of ``texts`` (the prompt format's ``action_choices(info)``, less what
        ``avoid_repeats`` leaves out), ending with the end-of-turn token (as an expert's reply is tokenized for
        SFT); ``None`` when there is none (unconstrained turn)."""
        if not texts:
            return None
        eos = [] if self.chat.eos_token_id is None else [int(self.chat.eos_token_id)]
        return [self.chat.encode(t) + eos for t in texts]

    def _record_empty_turn(self, episode: _Episode) -> None:
        episode.trajectory.turns.append(
            TurnRecord(
                text="",
                action="",
                sequence=-1,
                action_span=(0, 0),
                prompt_span=(0, 0),
                parse_error=f"context budget of {self.context.max_context_tokens} tokens exhausted",
                finish_reason="context",
                action_valid=False,
            )
        )

    def end_episode(self, episode_id: EpisodeId) -> Trajectory:
        """Close ``episode_id`` and return its ``Trajectory``; its outcome is the env stepper's to fill
        (``play_episode`` does; otherwise ``Trajectory.set_outcome``)."""
        self._pending.pop(episode_id, None)
        episode = self._episodes.pop(episode_id, None)
        if episode is None:
            raise KeyError(f"unknown episode {episode_id!r}; active: {list(self._episodes)[:10]}")
        trajectory = episode.trajectory
        if episode.last_return is not None:
            trajectory.timings["env_s"] += time.perf_counter() - episode.last_return
        trajectory.timings["finish"] = time.time()
        trajectory.validate()
        return trajectory

    def discard(self, episode_id: EpisodeId) -> None:
        """Forget ``episode_id`` (begun or running) without a record: an episode the caller abandons, or one
        whose env failed before the agent ever acted. Unknown ids are ignored."""
        self._pending.pop(episode_id, None)
        self._episodes.pop(episode_id, None)

    def lost(self, episode_id: EpisodeId) -> str | None:
        """Why the backend lost the last generation of ``episode_id`` (``Generation.error``: its engine died),
        or ``None``. A lost episode's action from ``act`` is ``""`` and must not be played: the caller ends the
        episode as failed (the runtime does, like an env worker's failure)."""
        episode = self._episodes.get(episode_id)
        return None if episode is None else episode.lost

    def action_tokens(self, episode_id: EpisodeId) -> int:
        """Tokens generated so far in the running episode ``episode_id`` (0 before its first ``act``)."""
        episode = self._episodes.get(episode_id)
        return 0 if episode is None else episode.trajectory.num_action_tokens

    @property
    def active_episodes(self) -> list[EpisodeId]:
        return list(self._episodes)
