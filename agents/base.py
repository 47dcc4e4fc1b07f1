"""The contracts every agent and every generation backend honours.

An *agent* turns observations into actions for any number of concurrent episodes, each named by a
hashable ``episode_id`` chosen by the caller (a vector env's ``(env_id, episode)`` pair, a counter, ...).
The first ``act`` call for an unseen id starts that episode; ``end_episode`` closes it and hands back the
token record a learner needs (``None`` for agents that keep none, such as scripted experts).

A *generation backend* is token ids in, token ids and per-token log-probs out; LoRA adapters are
published to it by version with ``set_adapter``. See ``streamrl.agents.hf_backend`` (embedded default)
and ``streamrl.agents.vllm_backend`` (fast path).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

EpisodeId = Hashable


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

    def end_episode(self, episode_id: EpisodeId) -> Any | None:
        """Forget ``episode_id``; return its token record (or ``None`` if the agent keeps none)."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Decoding controls shared by every backend.

    Defaults are the SPO++ rollout setting (temperature 1, top-p 1, top-k off). ``top_k=0`` disables top-k.
    ``seed`` makes a call reproducible on the same backend; ``None`` draws from the backend's generator.
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
    """One completion: the sampled token ids, the engine's log-prob of each, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop id / stop string) or "length"
    adapter_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class GenerationBackend(Protocol):
    """Token ids in, token ids and per-token log-probs out."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Complete every prompt (batched where the engine can)."""
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
