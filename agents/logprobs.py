"""Token log-probabilities of a causal LM: the one computation that inference scoring and training share.

``HFBackend.score`` calls it without grad to report log-probs; the learners (SFT, RL) call it with grad to
train. Keeping both on one function is what makes "the importance ratio is 1 when nothing was updated" hold
exactly: the learner's old log-probs and the backend's scores come from the same code path.

Conventions: inputs are ``[B, T]`` token ids with an attention mask (left or right padding); outputs are
aligned with the *predicted* tokens, ``[B, T-1]``, where position ``t`` scores ``input_ids[:, t+1]``. Positions
are ``cumsum(mask) - 1`` so padding never shifts the positions of real tokens (docs/platform.md §2).
Log-probs are computed in fp32 whatever the model's dtype (bf16 log-softmax loses ~1e-2 nats).
"""

from __future__ import annotations

from typing import Any

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding (left or right): ``cumsum(mask) - 1``, clamped at 0 on pad slots."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])`` in fp32, shape ``[B, T-1]``.

    Works for left or right padding (positions from the mask); values on pad positions are meaningless and
    must be masked by the caller. Differentiable: the learner calls it with grad, ``score`` without.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )
    logits = out.logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def last_hidden_states(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's final hidden states ``[B, T, H]`` (no vocabulary projection); works through peft."""
    return model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).last_hidden_state


def selected_token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    allowed: torch.Tensor | None = None,
) -> Any:
    """``token_logprobs(...)[select]`` without computing logits anywhere else, shape ``[select.sum()]``.

    ``select`` is a bool ``[B, T-1]`` mask over predicted positions (e.g. action tokens, shifted by one). The
    vocabulary projection and log-softmax -- most of the cost and memory of a small model with a large vocabulary
    -- run only on the selected hidden states. Differentiable; works through a peft wrapper.

    With ``with_entropy`` it returns ``(logprobs, entropy)``: the entropy of the scored next-token distribution
    at each selected position (a training diagnostic; it costs no second projection).
    ``temperature`` scores under softmax(logits / T), the distribution a sampler at temperature T draws from.

    ``allowed`` (``[select.sum(), W]`` long, -1-padded; ``TokenBatch.allowed``) scores a constrained policy:
    at a position with allowed ids, the distribution renormalized over them (``log p(t) - logsumexp`` of their
    log-probs; the gradient flows through the normalizer too), and the entropy is that distribution's; a row
    of -1 leaves its position unconstrained.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score a sampling policy, got {temperature}")
    hidden = last_hidden_states(model, input_ids, attention_mask)
    chosen = hidden[:, :-1][select]
    logits = model.get_output_embeddings()(chosen).float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:][select]
    if allowed is not None:
        if allowed.shape[0] != logits.shape[0]:
            raise ValueError(f"allowed has {allowed.shape[0]} rows; select has {logits.shape[0]} positions")
        valid = allowed >= 0
        hits = torch.zeros_like(logits).scatter_add_(-1, allowed.clamp(min=0), valid.to(logits.dtype))
        inside = (hits > 0) | ~valid.any(-1, keepdim=True)
        logits = logits.masked_fill(~inside, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    selected = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return selected
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs.masked_fill(torch.isinf(log_probs), 0.0)).sum(-1)
    return selected, entropy
