"""The probe: does a backend serve the policy that was published?

Other RL stacks have shipped rollouts that silently sampled the base model after a weight sync. Whoever
publishes a policy (the trainer's ``Publisher``) stores, beside it, a *probe*: a fixed token sequence and the
log-probs the publishing model gives it (``write_adapter_probe``, file ``streamrl_probe.json``). Whoever serves
the policy scores the same sequence and compares (``check_probe``): the trainer after each publication, the vLLM
backend after each adapter load (``VLLMBackendConfig.verify_adapters``, for users who load adapters themselves),
and ``RayEngines`` on every engine. The comparison and its tolerance rule live here, once.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PROBE_FILE = "streamrl_probe.json"
"""Name of the file, inside a published policy's directory, that holds a probe sequence and its expected
log-probs."""

Measure = Literal["mean", "max"]


class AdapterMismatchError(RuntimeError):
    """A backend does not serve the policy it was given (its probe log-probs are not the expected ones)."""


def probe_atol(dtype: str) -> float:
    """The default tolerance of a probe check (mean |served - expected| log-prob, nats/token) for an engine
    running in ``dtype``: 1e-3 in float32, 0.2 in 16-bit (``VLLMBackendConfig.adapter_atol`` says why)."""
    return 1e-3 if dtype == "float32" else 0.2


def probe_token_ids(vocab_size: int, length: int = 64, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence: a LoRA update changes the log-probs of any context, and random
    ids need no tokenizer, so publisher and backend agree on it from the vocabulary size alone."""
    if vocab_size < 2 or length < 2:
        raise ValueError(f"need vocab_size >= 2 and length >= 2, got {vocab_size} and {length}")
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def write_adapter_probe(
    adapter_dir: str | os.PathLike[str], token_ids: Sequence[int], logprobs: Sequence[float]
) -> Path:
    """Store the expected log-probs of ``token_ids[1:]`` under the policy saved in ``adapter_dir``.

    The publisher (the learner, which holds the adapted model) computes them, e.g. with
    ``streamrl.agents.logprobs.token_logprobs``, so a GPU backend can verify the adapter without a second
    model. Returns the file's path.
    """
    if len(logprobs) != len(token_ids) - 1:
        raise ValueError(f"need len(token_ids) - 1 log-probs, got {len(logprobs)} for {len(token_ids)} ids")
    path = Path(adapter_dir) / PROBE_FILE
    payload = {"token_ids": [int(t) for t in token_ids], "logprobs": [float(x) for x in logprobs]}
    path.write_text(json.dumps(payload))
    return path


def read_adapter_probe(adapter_dir: str | os.PathLike[str]) -> tuple[list[int], list[float]] | None:
    """``(token_ids, expected log-probs of token_ids[1:])`` from ``adapter_dir``, or ``None`` if absent."""
    path = Path(adapter_dir) / PROBE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    ids, lps = [int(t) for t in data["token_ids"]], [float(x) for x in data["logprobs"]]
    if len(lps) != len(ids) - 1:
        raise ValueError(f"{path}: {len(ids)} token ids need {len(ids) - 1} log-probs, found {len(lps)}")
    return ids, lps


@dataclass(frozen=True)
class ProbeComparison:
    """How far served probe log-probs are from the expected ones (nats/token)."""

    mean: float
    """Mean ``|served - expected|`` over the probe's scored tokens."""
    worst: float
    """Largest ``|served - expected|``."""
    tokens: int
    """Scored tokens (the probe's length - 1)."""

    def of(self, measure: Measure) -> float:
        return self.mean if measure == "mean" else self.worst


def compare_probe(served: Sequence[float], expected: Sequence[float]) -> ProbeComparison:
    """Compare the served and expected log-probs of one probe (same length)."""
    diffs = [abs(a - b) for a, b in zip(served, expected, strict=True)]
    return ProbeComparison(sum(diffs) / max(len(diffs), 1), max(diffs, default=0.0), len(diffs))


def probe_mismatch(served: Sequence[float], expected: Sequence[float]) -> tuple[float, float]:
    """``(mean, max)`` of ``|served - expected|`` over a probe's log-probs."""
    found = compare_probe(served, expected)
    return found.mean, found.worst


def check_probe(
    served: Sequence[float],
    expected: Sequence[float],
    *,
    atol: float,
    measure: Measure = "mean",
) -> ProbeComparison | None:
    """The one check of a served policy: ``None`` when the served log-probs of the probe are the expected ones
    within ``atol`` on ``measure`` (``"mean"`` or ``"max"`` of ``|served - expected|``), else the comparison,
    for the caller to raise its error with (it knows what was served by whom). A NaN never passes."""
    if measure not in ("mean", "max"):
        raise ValueError(f"measure must be 'mean' or 'max', got {measure!r}")
    found = compare_probe(served, expected)
    return None if found.of(measure) <= atol else found
