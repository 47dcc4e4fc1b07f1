"""The agents-side half of the latency simulator: a generation backend that only takes time, the prompt
format of ``streamrl/Latency-v0`` (``streamrl.envs.latency``) and its env spec for the trainer.

``LatencyBackend`` implements ``GenerationBackend`` the way a benchmark of the runtime needs it: a call
sleeps ``call_latency_s + n x token_latency_s`` where ``n`` is the number of new tokens of the call -- once
per call whatever the number of prompts, as a batched engine decodes all rows of a batch in the same forward
steps (the batch costs its longest row) -- and returns ``n`` ordinary token ids with a fixed log-prob per
token. The sleep releases the GIL, so a learner thread runs meanwhile, as it would beside an engine in
another process. Calls are served one at a time (one engine).

What a trainer needs beyond generation is real: ``score`` (the trainer checks, after each publication,
that the served policy's log-probs on a probe match the learner's) and ``set_adapter`` go to a ``scorer``
backend (e.g. ``HFBackend`` on the same model), which then holds the published policy. Without a scorer the
backend generates only (``score`` raises).

    backend = LatencyBackend(LatencyBackendConfig(token_latency_s=0.002), scorer=HFBackend("tiny"))
    register_env_spec("latency", latency_env_spec(step_latency_s=0.01))
    Trainer(TrainConfig(env="latency", init="base", ...), backend=backend).run()
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamrl.agents.base import Generation, GenerationBackend, SamplingParams, request_seeds
from streamrl.agents.env_specs import EnvSpec
from streamrl.agents.llm_agent import ContextPolicy
from streamrl.agents.prompts import ParsedAction
from streamrl.agents.random_agent import RandomTextAgent

__all__ = ["LatencyBackend", "LatencyBackendConfig", "LatencyPrompt", "latency_env_spec"]


@dataclass(frozen=True)
class LatencyBackendConfig:
    """How long a generation call takes and what it returns."""

    token_latency_s: float = 0.002
    """Seconds per decoding step: a call generating ``n`` tokens per row sleeps ``n`` times this."""
    call_latency_s: float = 0.0
    """Fixed seconds per call (prefill, scheduling)."""
    tokens_per_turn: int = 24
    """New tokens per row, capped by the call's ``SamplingParams.max_new_tokens``."""
    text: str = " go to the next place and look around"
    """The generated text: its tokens, repeated, fill each row (ordinary tokens, no stop string)."""
    logprob: float = -1.0
    """Rollout log-prob reported for every generated token."""

    def __post_init__(self) -> None:
        for name in ("token_latency_s", "call_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.tokens_per_turn < 1:
            raise ValueError(f"tokens_per_turn must be >= 1, got {self.tokens_per_turn}")
        if not self.text.strip():
            raise ValueError("text must hold at least one non-space character")
        if not self.logprob <= 0:
            raise ValueError(f"logprob must be <= 0, got {self.logprob}")


class LatencyBackend:
    """A ``GenerationBackend`` whose generation only takes time (see the module doc)."""

    def __init__(
        self,
        config: LatencyBackendConfig | None = None,
        *,
        tokenizer: Any = None,
        scorer: GenerationBackend | None = None,
    ) -> None:
        """``tokenizer`` defaults to the scorer's; one of them is required (the token ids must be the
        trained model's)."""
        self.config = config or LatencyBackendConfig()
        self.scorer = scorer
        self.tokenizer = tokenizer if tokenizer is not None else getattr(scorer, "tokenizer", None)
        if self.tokenizer is None:
            raise ValueError("LatencyBackend needs tokenizer=... or a scorer with a .tokenizer")
        ids = list(self.tokenizer(self.config.text, add_special_tokens=False)["input_ids"])
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self._filler = [i for i in ids if i not in special]
        if not self._filler:
            raise ValueError(f"text {self.config.text!r} encodes to no ordinary token")
        self._lock = threading.Lock()
        self._seeds = random.Random(0)
        self._version = 0
        self.calls = 0
        """Generation calls served."""
        self.rows = 0
        """Prompts served (over all calls)."""
        self.busy_seconds = 0.0
        """Seconds spent inside generation calls (the simulated engine's busy time)."""

    @property
    def adapter_version(self) -> int:
        return self._version

    @property
    def model(self) -> Any:
        """The scorer's model: where a trainer loads fully fine-tuned weights at publication."""
        model = getattr(self.scorer, "model", None)
        if model is None:
            raise AttributeError("this LatencyBackend has no scorer with a .model to load weights into")
        return model

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sleep for the call, then return the filler tokens for every prompt (``seeds`` are checked as every
        backend checks them, and otherwise unused: nothing is sampled)."""
        request_seeds(len(prompts), params, self._seeds, seeds)
        if not prompts:
            return []
        n = min(self.config.tokens_per_turn, params.max_new_tokens)
        reps = -(-n // len(self._filler))
        ids = (self._filler * reps)[:n]
        with self._lock:
            started = time.perf_counter()
            time.sleep(self.config.call_latency_s + n * self.config.token_latency_s)
            version = self._version
            self.calls += 1
            self.rows += len(prompts)
            self.busy_seconds += time.perf_counter() - started
        finish = "length" if n == params.max_new_tokens else "stop"
        return [
            Generation(list(ids), [self.config.logprob] * n, finish, adapter_version=version) for _ in prompts
        ]

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        if self.scorer is None:
            raise RuntimeError("LatencyBackend.score needs a scorer backend (LatencyBackend(scorer=...))")
        return self.scorer.score(sequences, prompt_lengths)

    def set_adapter(self, path: str | None, version: int) -> None:
        if version < 0:
            raise ValueError(f"adapter version must be >= 0, got {version}")
        if self.scorer is not None:
            self.scorer.set_adapter(path, version)
        with self._lock:  # never mid-call: a call's tokens carry one version
            self._version = version

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()


@dataclass(frozen=True)
class LatencyPrompt:
    """``streamrl/Latency-v0``: the observation is the user message; the action is the generated text."""

    name: str = "latency"
    stop_strings: tuple[str, ...] = ()

    def system_prompt(self, first_observation: str, info: Mapping[str, Any]) -> str:
        return "Reply with your next move."

    def user_message(self, observation: str, info: Mapping[str, Any], turn: int) -> str:
        return observation.strip()

    def parse_action(self, text: str, info: Mapping[str, Any]) -> ParsedAction:
        action = text.strip()
        return ParsedAction(action, bool(action), None if action else "empty generation")


def latency_env_spec(**env_kwargs: Any) -> EnvSpec:
    """The ``EnvSpec`` of ``streamrl/Latency-v0`` with ``env_kwargs`` (``step_latency_s``, ``turns``, ...),
    to register under a name (``register_env_spec``) and train on. SPO++'s context policy (the whole episode
    in one sequence: one training row per episode, the cheapest for the learner) and ALFWorld's turn budget
    (24 new tokens); its expert is a random-text agent (any non-empty text is a valid action)."""
    return EnvSpec(
        gym_id="streamrl/Latency-v0",
        train_split="train",
        eval_splits=("test",),
        split_keyword="split",
        prompt=LatencyPrompt,
        context=ContextPolicy(mode="full", max_context_tokens=4096),
        max_new_tokens=24,
        expert=lambda env: RandomTextAgent(),
        env_kwargs=dict(env_kwargs),
    )
