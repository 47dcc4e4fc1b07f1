"""The SFT cold start's loss: behaviour cloning of expert token sequences (``sft_loss``). It takes the model and
token sequences, not the per-token tensors of the RL losses in ``streamrl.algorithms.losses``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from streamrl.agents.batch import collate
from streamrl.agents.logprobs import selected_token_logprobs
from streamrl.agents.trajectory import TokenSequence

__all__ = ["sft_loss"]


def sft_loss(
    model: Any, batch: Sequence[TokenSequence], pad_token_id: int, context_weight: float = 0.0
) -> tuple[torch.Tensor, int]:
    """Behaviour-cloning loss: the mean negative log-likelihood of the action tokens of ``batch`` (``collate``d),
    plus ``context_weight`` times the mean NLL of its other tokens (``SFTConfig.context_weight``); returns
    (loss, action tokens). Each mean is over its tokens of the whole batch (token-mean aggregation).

    Logits are computed only where they are needed (``selected_token_logprobs``): at the positions whose next
    token is an action token, or at every position when ``context_weight`` is non-zero.
    """
    device = next(model.parameters()).device
    padded = collate(batch, pad_token_id).to(device)
    select = padded.target_mask if context_weight else padded.action_mask
    lp = selected_token_logprobs(model, padded.input_ids, padded.attention_mask, select)
    if not context_weight:
        return -lp.mean(), int(lp.numel())
    is_action = padded.action_mask[select]
    loss = -lp[is_action].mean()
    if not bool(is_action.all()):
        loss = loss - context_weight * lp[~is_action].mean()
    return loss, int(is_action.sum())
