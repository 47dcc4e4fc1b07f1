"""The trajectory record: one finished episode, self-contained, for a learner in any process.

A ``Trajectory`` holds one or more ``TokenSequence``s -- the exact token ids the policy saw and produced, with
``action_mask`` 1 on policy-generated tokens and 0 on prompt, observation and tool-output tokens, the
rollout engine's log-prob of each generated token (0 elsewhere) and the adapter version that generated it
(-1 elsewhere):

- context policy ``"full"`` (SPO++): one sequence for the whole episode, actions and observations interleaved;
- context policy ``"window"`` (verl-agent): one sequence per turn (its prompt re-renders the last k turns as
  context, mask 0; only that turn's action has mask 1). The mask convention is the same.

The agent fills tokens and turns; the episode's outcome (reward, won, terminated, truncated, final info) is
known only to whoever stepped the env, which fills it with ``Trajectory.set_outcome``
(``streamrl.agents.rollout.play_episode`` does, so its ``result.record`` is complete). ``to_dict`` / ``from_dict`` (and the
JSON variants) round-trip everything; the ``ticket`` is opaque here and is stored as given (it must be
JSON-serializable for ``to_json``, or the caller passes ``ticket_to_json`` / ``ticket_from_json``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args

ContextMode = Literal["full", "window"]
"""How a trajectory's sequences are laid out (module doc; ``streamrl.agents.llm_agent.ContextPolicy``)."""
CONTEXT_POLICIES: tuple[ContextMode, ...] = get_args(ContextMode)

TurnFinish = Literal["", "stop", "length", "context"]
"""Why a turn's generation ended: the backend's "stop" / "length", "context" when the context budget left no
room to generate, "" when unknown."""


@dataclass
class TokenSequence:
    """One training sequence; the four per-token lists have equal length.

    Action tokens generated under a constraint (``LLMAgent(constrain_actions=True)``: each step chose among
    the tokens that continue one of the env's admissible commands) list, at ``choice_positions``, the token
    ids ``choice_ids`` that were allowed there: the policy at such a token is the model's distribution
    renormalized over those ids, which is what its rollout log-prob is of and what the learner scores
    (``TokenBatch.allowed``). Unconstrained tokens are not listed.
    """

    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    choice_positions: list[int] = field(default_factory=list)
    """Ascending indices of constrained action tokens."""
    choice_ids: list[list[int]] = field(default_factory=list)
    """Per constrained token, the sorted token ids allowed there (the token itself among them)."""

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend_context(self, ids: list[int]) -> tuple[int, int]:
        """Append tokens the policy did not generate (prompt, observation); return their span."""
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.action_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))
        self.token_versions.extend([-1] * len(ids))
        return start, len(self.token_ids)

    def extend_action(
        self,
        ids: list[int],
        logprobs: list[float],
        version: int,
        allowed: list[list[int]] | None = None,
    ) -> tuple[int, int]:
        """Append policy-generated tokens with their rollout log-probs; return their span. ``allowed``: for a
        constrained generation, the token ids allowed at each generated token (class doc)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} generated tokens but {len(logprobs)} log-probs")
        start = len(self.token_ids)
        if allowed is not None:
            if len(allowed) != len(ids):
                raise ValueError(f"{len(ids)} generated tokens but {len(allowed)} allowed-token lists")
            self.choice_positions.extend(range(start, start + len(ids)))
            self.choice_ids.extend(sorted(int(t) for t in a) for a in allowed)
        self.token_ids.extend(ids)
        self.action_mask.extend([1] * len(ids))
        self.rollout_logprobs.extend(logprobs)
        self.token_versions.extend([version] * len(ids))
        return start, len(self.token_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    def validate(self, where: str = "sequence") -> None:
        """Raise ``ValueError`` naming the first inconsistency."""
        n = len(self.token_ids)
        for name in ("action_mask", "rollout_logprobs", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{where}: {name} has {len(getattr(self, name))} entries, token_ids has {n}")
        for i, (m, lp, v) in enumerate(
            zip(self.action_mask, self.rollout_logprobs, self.token_versions, strict=True)
        ):
            if m not in (0, 1):
                raise ValueError(f"{where}: action_mask[{i}]={m!r}, must be 0 or 1")
            if m == 1 and not (math.isfinite(lp) and lp <= 1e-6):
                raise ValueError(
                    f"{where}: rollout_logprobs[{i}]={lp!r} on an action token must be finite and <= 0"
                )
            if m == 1 and v < 0:
                raise ValueError(f"{where}: token_versions[{i}]={v} on an action token must be >= 0")
            if m == 0 and (lp != 0.0 or v != -1):
                raise ValueError(
                    f"{where}: non-action token {i} has rollout_logprob {lp} / version {v}; expected 0.0 / -1"
                )
        if len(self.choice_positions) != len(self.choice_ids):
            raise ValueError(
                f"{where}: {len(self.choice_positions)} choice_positions but {len(self.choice_ids)} choice_ids"
            )
        last = -1
        for p, allowed in zip(self.choice_positions, self.choice_ids, strict=True):
            if not last < p < n or not self.action_mask[p]:
                raise ValueError(
                    f"{where}: choice_positions must ascend over action tokens; {p} does not (after {last})"
                )
            if self.token_ids[p] not in allowed:
                raise ValueError(
                    f"{where}: token {p} ({self.token_ids[p]}) is not among the ids allowed there {allowed[:8]}"
                )
            last = p


@dataclass
class TurnRecord:
    """One agent turn: what was generated, what the env made of it, and where its tokens are."""

    text: str
    """The generated text (decoded action tokens, special tokens skipped)."""
    action: str
    """The action sent to the env (the prompt format's parse of ``text``)."""
    sequence: int
    """Index into ``Trajectory.sequences`` of the sequence holding this turn's tokens."""
    action_span: tuple[int, int]
    """``[start, end)`` of the generated tokens in that sequence (mask 1 exactly there)."""
    prompt_span: tuple[int, int]
    """``[start, end)`` of the context tokens appended for this turn before generating (observation turn)."""
    parse_error: str | None = None
    """Why the prompt format could not parse ``text`` into an action (then the action is invalid)."""
    finish_reason: TurnFinish = ""
    adapter_version: int = 0
    observation: str = ""
    """The env's reply to ``action`` (filled at the next ``act`` or by ``set_outcome`` for the last turn)."""
    action_valid: bool | None = None
    """The env's verdict (``info["action_valid"]``); ``None`` until known."""
    tool_calls: int = 0
    """Tool calls the env ran for this action (``info["tool_calls"]`` delta, Math-TIR)."""
    seed: int | None = None
    """The seed this turn was sampled with (derived from the run seed), ``None`` if the backend drew it."""
    generation_seconds: float = 0.0


@dataclass
class Trajectory:
    """One finished episode (see module doc)."""

    task_id: str
    ticket: Any = None
    context_policy: ContextMode = "full"
    sequences: list[TokenSequence] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    reward: float = 0.0
    won: bool = False
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Final env info plus agent notes (``error`` when a worker failure ended it, ``context_exhausted``)."""
    timings: dict[str, float] = field(default_factory=dict)
    """``start`` / ``finish`` (unix seconds), ``generation_s`` and ``env_s`` (time between acts)."""

    def __post_init__(self) -> None:
        if self.context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"context_policy must be one of {CONTEXT_POLICIES}, got {self.context_policy!r}")

    # -- the single-sequence view: one trajectory as one sequence, for the "full" context policy ----------

    def _only(self) -> TokenSequence:
        if len(self.sequences) != 1:
            raise ValueError(
                f"trajectory of {self.task_id!r} holds {len(self.sequences)} sequences (context policy "
                f"{self.context_policy!r}); iterate .sequences instead of using the single-sequence fields"
            )
        return self.sequences[0]

    @property
    def token_ids(self) -> list[int]:
        return self._only().token_ids

    @property
    def action_mask(self) -> list[int]:
        return self._only().action_mask

    @property
    def rollout_logprobs(self) -> list[float]:
        return self._only().rollout_logprobs

    @property
    def token_versions(self) -> list[int]:
        return self._only().token_versions

    @property
    def num_action_tokens(self) -> int:
        """``L``: generated tokens over all sequences (the token count a token-mean loss divides by)."""
        return sum(s.num_action_tokens for s in self.sequences)

    # -- outcome ---------------------------------------------------------------------------------------------

    def set_outcome(
        self,
        reward: float,
        won: bool,
        terminated: bool,
        truncated: bool,
        info: Mapping[str, Any] | None = None,
        last_observation: str | None = None,
        last_action_valid: bool | None = None,
    ) -> Trajectory:
        """Fill the fields only the env's stepper knows; returns ``self``.

        The last turn gets the env's reply to it: ``last_observation``, and its validity from
        ``last_action_valid`` or else the final ``info["action_valid"]``.
        """
        self.reward, self.won = float(reward), bool(won)
        self.terminated, self.truncated = bool(terminated), bool(truncated)
        if info is not None:
            self.info = {**dict(info), **self.info}  # agent notes (e.g. context_exhausted) win
        if self.turns:
            if info is not None and isinstance(info.get("tool_calls"), int):
                earlier = sum(t.tool_calls for t in self.turns[:-1])  # info counts are cumulative
                self.turns[-1].tool_calls = max(0, info["tool_calls"] - earlier)
            if last_observation is not None:
                self.turns[-1].observation = last_observation
            if last_action_valid is None and info is not None and "action_valid" in info:
                last_action_valid = bool(info["action_valid"])
            if last_action_valid is not None:
                self.turns[-1].action_valid = last_action_valid
        return self

    # -- checks ------------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` if masks, lengths or turn spans are inconsistent."""
        if self.context_policy == "full" and len(self.sequences) > 1:
            raise ValueError(
                f"full-context trajectory has {len(self.sequences)} sequences, expected at most 1"
            )
        covered: list[set[int]] = [set() for _ in self.sequences]
        for s_i, seq in enumerate(self.sequences):
            seq.validate(f"sequences[{s_i}]")
        for t_i, turn in enumerate(self.turns):
            if not 0 <= turn.sequence < len(self.sequences):
                if turn.action_span == (0, 0):  # a turn that generated nothing (context exhausted)
                    continue
                raise ValueError(
                    f"turns[{t_i}].sequence={turn.sequence} but there are {len(self.sequences)} sequences"
                )
            start, end = turn.action_span
            seq = self.sequences[turn.sequence]
            if not 0 <= start <= end <= len(seq):
                raise ValueError(
                    f"turns[{t_i}].action_span={turn.action_span} outside sequence of length {len(seq)}"
                )
            covered[turn.sequence].update(range(start, end))
        for s_i, seq in enumerate(self.sequences):
            ones = {i for i, m in enumerate(seq.action_mask) if m}
            if ones != covered[s_i]:
                stray = sorted(ones ^ covered[s_i])[:5]
                raise ValueError(
                    f"sequences[{s_i}]: action_mask 1 must be exactly the turns' action spans; differs at {stray}"
                )

    # -- serialization ---------------------------------------------------------------------------------------

    def to_dict(self, ticket_to_json: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """Plain dict of lists/numbers/strings (``ticket`` through ``ticket_to_json``; dataclasses via asdict)."""
        data = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("sequences", "turns", "ticket")
        }
        data["sequences"] = [asdict(s) for s in self.sequences]
        data["turns"] = [asdict(t) for t in self.turns]
        ticket = self.ticket
        if ticket_to_json is not None:
            ticket = ticket_to_json(ticket)
        elif is_dataclass(ticket) and not isinstance(ticket, type):
            ticket = asdict(ticket)
        data["ticket"] = ticket
        data["info"] = dict(self.info)
        data["timings"] = dict(self.timings)
        return data

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], ticket_from_json: Callable[[Any], Any] | None = None
    ) -> Trajectory:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown trajectory fields {sorted(unknown)}; valid: {sorted(known)}")
        kwargs = dict(data)
        kwargs["sequences"] = [TokenSequence(**s) for s in data.get("sequences", [])]
        kwargs["turns"] = [
            TurnRecord(
                **{**t, "action_span": tuple(t["action_span"]), "prompt_span": tuple(t["prompt_span"])}
            )
            for t in data.get("turns", [])
        ]
        if ticket_from_json is not None:
            kwargs["ticket"] = ticket_from_json(data.get("ticket"))
        traj = cls(**kwargs)
        traj.validate()
        return traj

    def to_json(self, ticket_to_json: Callable[[Any], Any] | None = None) -> str:
        return json.dumps(self.to_dict(ticket_to_json))

    @classmethod
    def from_json(cls, text: str, ticket_from_json: Callable[[Any], Any] | None = None) -> Trajectory:
        return cls.from_dict(json.loads(text), ticket_from_json)
