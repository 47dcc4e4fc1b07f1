"""The contracts every agent and every generation backend honours.

An *agent* turns observations into actions for any number of concurrent episodes, each named by a
hashable ``episode_id`` chosen by the caller (a vector env's ``(env_id, episode)`` pair, a counter, ...).
The first ``act`` call for an unseen id starts that episode; ``end_episode`` closes it and hands back the
token record a learner needs (``None`` for agents that keep none, such as scripted experts).

A *generation backend* is token ids in, token ids and per-token log-probs out; LoRA adapters are
published to it by version with ``set_adapter``. See ``streamrl.agents.hf_backend`` (embedded default)
and ``streamrl.agents.vllm_backend`` (fast path). What both backends check and derive the same way lives
here: ``check_score_inputs``, ``request_seeds`` and, for generation constrained to a set of token strings
(``generate(..., choices=...)``), ``check_choices`` and ``allowed_next_tokens``. ``derive_seed`` makes stable
seeds from a run seed, e.g. the one an ``LLMAgent`` samples each (episode, turn) with.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from streamrl.agents.trajectory import Trajectory

EpisodeId = Hashable

FinishReason = Literal["stop", "length"]
"""Why a generation ended: "stop" (an EOS token, a stop id or a stop string) or "length" (the budget)."""

SEED_BITS = 62
"""Seeds handed to a backend are in ``[0, 2**62)``: what both engines accept, with room for ``seed + i``."""


@runtime_checkable
class Agent(Protocol):
    """Acts in text environments; one call serves a batch of episodes."""

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        """Return one action per episode. ``observations[i]`` is the latest observation of
        ``episode_ids[i]`` (the reset observation on its first call) and ``infos[i]`` the matching info."""
        ...

    def end_episode(self, episode_id: EpisodeId) -> Trajectory | None:
        """Forget ``episode_id``; return its token record (or ``None`` if the agent keeps none)."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Decoding controls shared by every backend.

    Defaults are the SPO++ rollout setting (temperature 1, top-p 1, top-k off). ``top_k=0`` disables top-k.
    ``seed`` makes a call reproducible on the same backend: prompt ``i`` of the call samples with ``seed + i``
    (unless the call passes its own per-prompt ``seeds``); ``None`` draws from the backend's generator. An
    ``LLMAgent`` reads it as the *run* seed and derives one seed per (episode, turn) from it (``derive_seed``).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One completion: the sampled token ids, the engine's log-prob of each, and why it stopped.

    ``error`` is set, with no tokens, when the backend lost the request: the engine serving it died
    (``streamrl.agents.ray_engines.RayEngines`` replaces it). The request is never retried, so no sample is
    silently redrawn; ``LLMAgent`` ends such an episode as failed, as the vector env ends the episodes of a
    dead env worker.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    adapter_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    """Token ids in, token ids and per-token log-probs out."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> list[Generation]:
        """Complete every prompt (batched where the engine can). ``seeds[i]``, when given, seeds prompt ``i``'s
        sample whatever else shares the call (it overrides ``params.seed``; see ``request_seeds``).

        ``choices[i]``, when given and not ``None``, constrains prompt ``i``'s completion to one of those token
        id sequences (a prefix of one when the budget runs out): each step samples from the model's
        distribution renormalized over ``allowed_next_tokens`` (``-inf`` elsewhere, before temperature and
        top-k / top-p), and the reported log-probs are of that renormalized distribution, which the learner
        recomputes from the same sets (``TokenSequence.choice_ids``). A backend that cannot constrain raises
        ``ValueError`` when a prompt is constrained."""
        ...

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        """Log-probs of ``sequences[i][prompt_lengths[i]:]`` under the current policy (no sampling)."""
        ...

    def set_adapter(self, path: str | None, version: int) -> None:
        """Serve the LoRA adapter saved (peft format) at ``path`` as policy ``version``; ``None`` = base model."""
        ...

    @property
    def adapter_version(self) -> int:
        """The version of the adapter being served now (0 = base model)."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------------------
# What every backend checks and derives the same way


def check_score_inputs(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> None:
    """Raise ``ValueError`` unless there is one prompt length per sequence and each is in ``[1, len]``
    (the first token has no log-prob: nothing precedes it)."""
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        if not 1 <= p <= len(seq):
            raise ValueError(f"prompt_lengths[{i}]={p} must be in [1, len(sequence)={len(seq)}]")


def check_choices(
    count: int, choices: Sequence[Sequence[Sequence[int]] | None] | None
) -> list[list[list[int]] | None]:
    """``choices`` of a ``generate`` call of ``count`` prompts as lists, or ``ValueError`` naming the entry: one
    entry per prompt, ``None`` (unconstrained) or at least one non-empty token id sequence."""
    if choices is None:
        return [None] * count
    if len(choices) != count:
        raise ValueError(f"{count} prompts but {len(choices)} choice lists")
    out: list[list[list[int]] | None] = []
    for i, options in enumerate(choices):
        if options is None:
            out.append(None)
            continue
        listed = [[int(t) for t in option] for option in options]
        if not listed:
            raise ValueError(f"choices[{i}] is empty; pass None for an unconstrained prompt")
        for j, option in enumerate(listed):
            if not option:
                raise ValueError(f"choices[{i}][{j}] is empty; every choice needs at least one token")
        out.append(listed)
    return out


def allowed_next_tokens(choices: Sequence[Sequence[int]], prefix: Sequence[int]) -> list[int]:
    """The token ids that continue ``prefix`` towards one of ``choices`` (sorted; empty once ``prefix`` is a
    whole choice that no longer choice extends, or when it has left every choice)."""
    n = len(prefix)
    head = list(prefix)
    return sorted({int(c[n]) for c in choices if len(c) > n and list(c[:n]) == head})


def request_seeds(
    count: int, params: SamplingParams, generator: random.Random, seeds: Sequence[int] | None = None
) -> list[int]:
    """The seed of each of ``count`` requests of one ``generate`` call.

    ``seeds`` as given when the caller names one per prompt; else ``params.seed + i`` for prompt ``i``;
    else draws from the backend's own ``generator`` (seeded by its config, so a run is reproducible when its
    calls come in the same order).
    """
    if seeds is not None:
        if len(seeds) != count:
            raise ValueError(f"{count} prompts but {len(seeds)} seeds")
        for i, s in enumerate(seeds):
            if not 0 <= s < 1 << SEED_BITS:
                raise ValueError(f"seeds[{i}]={s} must be in [0, 2**{SEED_BITS})")
        return [int(s) for s in seeds]
    if params.seed is None:
        return [generator.randrange(1 << SEED_BITS) for _ in range(count)]
    return [params.seed + i for i in range(count)]


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts``, e.g. (run seed, purpose, index) or (run seed, episode id, turn).

    A hash (BLAKE2b) of ``repr(parts)``: the same parts give the same seed in any process (unlike ``hash()``,
    which is salted per process for strings), different parts give unrelated seeds. Stable for parts made of
    ints, strings and tuples of them (whose ``repr`` is their value). 31 bits: valid for every consumer
    (numpy, gymnasium, torch, vLLM).
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
