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

from collections.abc import Iterator
from contextlib import contextmanager
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


SHARED_PREFIX_MIN_TOKENS = 64
"""``last_hidden_states(share_prefix=True)`` computes a common prefix once when that saves at least this many
token positions ((rows - 1) x prefix length): below it the second decoder call costs about what it saves."""


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row's real tokens come first and its padding (if any) after them, as ``collate`` pads."""
    lengths = attention_mask.sum(-1, keepdim=True)
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return bool((attention_mask.bool() == (positions < lengths)).all())


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens all rows have in common, at most the shortest row's length - 1 (so that every
    row keeps a token of its own)."""
    shortest = int(attention_mask.sum(-1).min())
    same = (input_ids[:, : shortest - 1] == input_ids[:1, : shortest - 1]).all(0)
    return int(same.long().cumprod(0).sum())


def last_hidden_states(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    share_prefix: bool = False,
    used: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder's final hidden states ``[B, T, H]`` (no vocabulary projection); works through peft.

    Without ``share_prefix`` or ``used``: the plain masked forward. With either, the caller reads no padding,
    and right-padded rows (``right_padded``) run without an attention mask: causal attention alone keeps a
    row's real tokens from its padding, which only follows them, so the fused causal kernel runs (no mask to
    build or apply); their positions ``0..T-1`` are ``cumsum(mask) - 1`` on the real tokens.

    ``share_prefix`` (right-padded rows only): the leading tokens every row has in common
    (``shared_prefix_length``, e.g. a system prompt) go through the decoder once, in one row, and the rest of
    every row attends to that row's keys and values (a KV cache repeated over the rows); its hidden states are
    repeated over the rows, so the output, and the gradient (the shared part's is the sum over rows), are
    those of the plain forward up to float rounding. Only where it saves ``SHARED_PREFIX_MIN_TOKENS`` tokens.
    Not for FSDP-sharded models: the extra decoder call is an extra collective that other ranks may not run.

    ``used`` (bool ``[B, T]``): the positions whose hidden states the caller reads. A position's output of
    the last layer feeds nothing but its own hidden state, so that layer's position-wise parts that do not
    make keys or values (``_last_layer_position_wise``: the query and output projections, the MLP) run only
    at these positions; the hidden states elsewhere are then not the model's.

    Both give the plain forward's values up to float rounding, not bit for bit: a caller that must reproduce
    earlier bits (a reproducible SFT build) leaves them off.
    """
    decoder = model.get_decoder()
    unread = _last_layer_position_wise(decoder)
    if not (share_prefix or used is not None) or not right_padded(attention_mask):
        with _only_at(unread, used):
            return decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
            ).last_hidden_state
    rows, width = input_ids.shape
    positions = torch.arange(width, device=input_ids.device).expand(rows, width)
    shared = shared_prefix_length(input_ids, attention_mask) if share_prefix and rows > 1 else 0
    if shared == 0 or (rows - 1) * shared < SHARED_PREFIX_MIN_TOKENS:
        with _only_at(unread, used):
            return decoder(input_ids=input_ids, position_ids=positions).last_hidden_state
    with _only_at(unread, None if used is None else used[:, :shared].any(0, keepdim=True)):
        prefix = decoder(
            input_ids=input_ids[:1, :shared], position_ids=positions[:1, :shared], use_cache=True
        )
    cache = prefix.past_key_values
    cache.batch_repeat_interleave(rows)
    with _only_at(unread, None if used is None else used[:, shared:]):
        rest = decoder(
            input_ids=input_ids[:, shared:],
            position_ids=positions[:, shared:],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
    return torch.cat([prefix.last_hidden_state.expand(rows, -1, -1), rest], dim=1)


def _last_layer_position_wise(decoder: Any) -> list[torch.nn.Module]:
    """The last decoder layer's modules that act on each position alone and whose outputs at a position
    reach only that position's output: its MLP, and its attention's query and output projections (queries
    at a position are read by that position alone; keys and values are read by later positions). Those of
    them the layer has under the names Llama-style decoders use (``layers[-1].mlp``,
    ``layers[-1].self_attn.q_proj`` / ``o_proj``); none for other decoders."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return []
    attention = getattr(layers[-1], "self_attn", None)
    found = [
        getattr(layers[-1], "mlp", None),
        getattr(attention, "q_proj", None),
        getattr(attention, "o_proj", None),
    ]
    return [m for m in found if isinstance(m, torch.nn.Module)]


@contextmanager
def _only_at(modules: list[torch.nn.Module], keep: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the position-wise ``modules`` (each called on ``[B, T, H]``) compute only the ``keep``
    positions (bool ``[B, T]``, as one ``[1, n, H]`` row) and output zeros elsewhere."""
    if not modules or keep is None:
        yield
        return
    called: list[bool] = []

    def gather(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        called.append(bool(args) and isinstance(args[0], torch.Tensor) and args[0].shape[:-1] == keep.shape)
        return (args[0][keep][None], *args[1:]) if called[-1] else None

    def scatter(_: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if not called.pop():
            return None
        return out.new_zeros((*keep.shape, out.shape[-1])).masked_scatter(keep[..., None], out[0])

    handles = [m.register_forward_pre_hook(gather) for m in modules]
    handles += [m.register_forward_hook(scatter) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def selected_token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    allowed: torch.Tensor | None = None,
    share_prefix: bool = False,
    skip_unread: bool = False,
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

    ``skip_unread``: skip the work no selected log-prob reads (right-padded rows without an attention mask, the
    last layer's MLP only at selected positions); ``share_prefix``: compute the rows' common prefix once. See
    ``last_hidden_states``: the same values up to float rounding, not bit for bit.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score a sampling policy, got {temperature}")
    # [B, T]: the hidden states that predict a selected token
    used = torch.nn.functional.pad(select, (0, 1)) if skip_unread else None
    hidden = last_hidden_states(model, input_ids, attention_mask, share_prefix=share_prefix, used=used)
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
    with torch.no_grad():  # 0 log 0 = 0 outside the allowed ids (log-probs of finite logits are finite)
        finite = log_probs if allowed is None else log_probs.masked_fill(torch.isinf(log_probs), 0.0)
        entropy = -(log_probs.exp() * finite).sum(-1)
    return selected, entropy
