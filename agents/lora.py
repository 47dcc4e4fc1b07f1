"""LoRA adapters through peft: configuration, wrapping, saving in peft's own format, reference log-probs.

Adapters are saved with ``PeftModel.save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``),
the format a plain ``PeftModel.from_pretrained``, ``HFBackend.set_adapter`` and vLLM's ``LoRARequest`` load.
The reference policy of a KL term is the same model with its adapter disabled -- no second copy of the
weights in memory (docs/platform.md §2). At initialization LoRA's ``B`` matrix is zero, so policy == reference.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from streamrl.agents.logprobs import token_logprobs


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapter shape (Hu et al. 2021, "LoRA", Eq. 3: ``W + (alpha / r) B A``)."""

    rank: int = 8
    """``r``, the rank of ``B A``."""
    alpha: int = 16
    """Scale numerator: the update is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapter input (0 keeps rollout and training log-probs identical)."""
    target_modules: Literal["all-linear"] | tuple[str, ...] = "all-linear"
    """peft's "all-linear" (every linear layer except the output head) or module-name suffixes such as
    ("q_proj", "v_proj")."""
    seed: int = 0
    """Seeds ``A``'s initialization (``B`` starts at zero)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"target_modules must be 'all-linear' or a tuple of module names, got {self.target_modules!r}"
            )

    def to_peft(self) -> Any:
        from peft import LoraConfig, TaskType

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            task_type=TaskType.CAUSAL_LM,
        )


def wrap_lora(model: Any, config: LoRAConfig | None = None, adapter_name: str = "default") -> Any:
    """Return ``model`` wrapped as a trainable ``PeftModel``; only the adapter's parameters require grad."""
    from peft import get_peft_model

    config = config or LoRAConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return get_peft_model(model, config.to_peft(), adapter_name=adapter_name)


def save_adapter(peft_model: Any, directory: str | os.PathLike[str]) -> Path:
    """Save the active adapter in peft's format into ``directory`` (created); returns it."""
    from peft import PeftModel

    if not isinstance(peft_model, PeftModel):
        raise TypeError(f"save_adapter needs a peft PeftModel, got {type(peft_model).__name__}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(path))
    return path


def reference_logprobs(
    peft_model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """``token_logprobs`` of the base model (adapter disabled), without grad: the KL reference policy."""
    with torch.no_grad(), peft_model.disable_adapter():
        return token_logprobs(peft_model, input_ids, attention_mask)


def trainable_parameters(model: Any) -> Sequence[torch.nn.Parameter]:
    """The parameters an optimizer should update (the adapter's, for a LoRA-wrapped model)."""
    return [p for p in model.parameters() if p.requires_grad]
