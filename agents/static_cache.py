"""Decoding a Llama- or Qwen2-architecture model over a preallocated (static) KV cache, one tensor op per step of
the model's own arithmetic and no module calls.

``HFBackend.generate`` spends a decode step of a small model mostly outside its arithmetic when it calls the
transformers forward: module dispatch, mask and position bookkeeping, a cache that grows by concatenation, and
grouped-query attention that copies every cached key and value head-repeated, every step. ``StaticCacheDecoder``
runs the same computation from the model's weight tensors directly:

- the layer arithmetic is transformers' own, operation for operation (RMSNorm in fp32, rotary embedding as
  ``q * cos + rotate_half(q) * sin``, ``scaled_dot_product_attention`` at scale ``head_dim ** -0.5``, SwiGLU
  MLP), so a step computes the logits the model's forward computes up to float rounding;
- the cache is allocated once per batch, ``[rows, kv_heads, capacity, head_dim]`` per layer; a step writes one
  column and attends to the columns written so far, grouped-query heads reading the shared key and value heads
  in place (queries viewed as ``[rows, kv_heads, group, head_dim]``) instead of repeated copies;
- prompts are right-padded, so the prefill attends with ``is_causal`` and no mask; generated tokens go to the
  columns after the longest prompt, and a row's padding columns are masked out of its later steps;
- the last layer of the prefill computes its keys and values at every prompt position but its attention and MLP
  only at each prompt's last position: the other positions' outputs would feed nothing but the unused logits;
- ``prefill(..., prefixes=...)`` starts rows from kept keys and values (``streamrl.agents.prefix_cache``): a
  row's cached prefix is copied to the columns of its positions and only the rest of its prompt runs, attending
  to the prefix and causally to itself under an explicit mask; ``export`` copies a row's keys and values out;
- LoRA layers of peft (unmerged, plain LoRA) add ``lora_B(lora_A(x)) * scaling`` after the base projection,
  peft's own order of operations, read from the adapter weights at construction; the decoder reads the adapter
  state (active adapters, disabled adapters) of the model as it is when constructed.

``StaticCacheDecoder.unsupported(model)`` says why a model cannot be decoded this way (another architecture, an
attention implementation other than ``sdpa``, rotary scaling, sliding windows, LoRA variants such as DoRA, ...);
the backend then steps the transformers forward instead (``HFForwardDecoder`` in ``streamrl.agents.hf_backend``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from streamrl.agents.prefix_cache import CachedPrefix

_LAYER_CLASSES = ("Qwen2DecoderLayer", "LlamaDecoderLayer")
_FIRST_ROOM = 64
"""Generated tokens the cache has room for at first; the room doubles when full."""


@dataclass(frozen=True)
class _Lora:
    a: torch.Tensor
    a_bias: torch.Tensor | None
    b: torch.Tensor
    b_bias: torch.Tensor | None
    scaling: float


@dataclass(frozen=True)
class _Linear:
    """A projection: the base weight and bias, then each active LoRA adapter's low-rank update (peft's order)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    loras: tuple[_Lora, ...] = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        for lora in self.loras:
            out = out + F.linear(F.linear(x, lora.a, lora.a_bias), lora.b, lora.b_bias) * lora.scaling
        return out


def _linear(module: Any) -> _Linear:
    """The ``_Linear`` of a ``torch.nn.Linear`` or of peft's ``lora.Linear`` over one; ``ValueError`` otherwise."""
    if type(module) is torch.nn.Linear:
        return _Linear(module.weight, module.bias)
    lora_a = getattr(module, "lora_A", None)
    base = getattr(module, "base_layer", None)
    if lora_a is None or type(base) is not torch.nn.Linear:
        raise ValueError(
            f"{type(module).__name__} is neither torch.nn.Linear nor peft's lora.Linear over one"
        )
    if module.disable_adapters or module.merged:  # peft's forward is the base layer's then
        return _Linear(base.weight, base.bias)
    loras = []
    for name in module.active_adapters:
        if name not in lora_a.keys():
            continue
        if name in getattr(module, "lora_variant", {}):
            raise ValueError(f"adapter {name!r} is a LoRA variant (e.g. DoRA)")
        dropout = module.lora_dropout[name]
        if not isinstance(dropout, torch.nn.Identity) and dropout.training:
            raise ValueError(f"adapter {name!r} applies dropout (its module is in training mode)")
        a, b = lora_a[name], module.lora_B[name]
        if a.weight.dtype != base.weight.dtype:
            raise ValueError(f"adapter {name!r} is {a.weight.dtype}, its base layer {base.weight.dtype}")
        loras.append(_Lora(a.weight, a.bias, b.weight, b.bias, float(module.scaling[name])))
    return _Linear(base.weight, base.bias, tuple(loras))


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' ``Qwen2RMSNorm`` / ``LlamaRMSNorm``: normalized in fp32, then scaled in the input dtype."""
    weight, eps = norm
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


@dataclass(frozen=True)
class _Layer:
    input_norm: tuple[torch.Tensor, float]
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    post_norm: tuple[torch.Tensor, float]
    gate: _Linear
    up: _Linear
    down: _Linear


def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU, ``down(silu(gate(h)) * up(h))``, in place on the gate's output (no grad: inference only)."""
    gate = F.silu(layer.gate(h), inplace=True)
    return layer.down(gate.mul_(layer.up(h)))


def _decoder_model(model: Any) -> Any:
    """The transformers ``*ForCausalLM`` inside ``model`` (through a peft wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _check_architecture(causal_lm: Any) -> None:
    """``ValueError`` unless ``causal_lm`` is a Llama/Qwen2-architecture model this module computes exactly."""
    config = getattr(causal_lm, "config", None)
    decoder = getattr(causal_lm, "model", None)
    layers = getattr(decoder, "layers", None)
    if config is None or decoder is None or not layers:
        raise ValueError(f"{type(causal_lm).__name__} is not a transformers decoder-only causal LM")
    names = {type(layer).__name__ for layer in layers}
    if not names <= set(_LAYER_CLASSES):
        raise ValueError(f"decoder layers {sorted(names)}; supported: {list(_LAYER_CLASSES)}")
    attention = getattr(config, "_attn_implementation", None)
    if attention != "sdpa":
        raise ValueError(f"attention implementation {attention!r}; supported: 'sdpa'")
    if getattr(config, "hidden_act", None) != "silu":
        raise ValueError(f"activation {getattr(config, 'hidden_act', None)!r}; supported: 'silu'")
    rope = getattr(getattr(decoder, "rotary_emb", None), "rope_type", None)
    if rope != "default":
        raise ValueError(f"rotary embedding type {rope!r}; supported: 'default'")
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        raise ValueError("sliding-window attention layers; supported: full attention only")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"pretraining_tp={config.pretraining_tp}; supported: 1")
    if type(decoder.embed_tokens) is not torch.nn.Embedding:
        raise ValueError(
            f"input embeddings are {type(decoder.embed_tokens).__name__}, not torch.nn.Embedding"
        )


class StaticCacheDecoder:
    """Prefill and decode steps of one batch over a preallocated KV cache (module doc).

    ``prefill(prompts, new_tokens)`` returns the logits after each prompt; each ``step(tokens)`` appends one
    token to every row and returns the next logits; ``keep(rows)`` drops the other rows (their cache rows
    included). Rows are the prompts in the order given, minus those dropped.
    """

    def __init__(self, model: Any) -> None:
        """Read ``model``'s weights (through a peft wrapper, with its adapter state as it is now); ``ValueError``
        naming what is not supported otherwise."""
        causal_lm = _decoder_model(model)
        _check_architecture(causal_lm)
        config = causal_lm.config
        decoder = causal_lm.model
        self.embedding: torch.Tensor = decoder.embed_tokens.weight
        self.layers = [
            _Layer(
                input_norm=(layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon)),
                q=_linear(layer.self_attn.q_proj),
                k=_linear(layer.self_attn.k_proj),
                v=_linear(layer.self_attn.v_proj),
                o=_linear(layer.self_attn.o_proj),
                post_norm=(
                    layer.post_attention_layernorm.weight,
                    float(layer.post_attention_layernorm.variance_epsilon),
                ),
                gate=_linear(layer.mlp.gate_proj),
                up=_linear(layer.mlp.up_proj),
                down=_linear(layer.mlp.down_proj),
            )
            for layer in decoder.layers[: config.num_hidden_layers]
        ]
        self.norm = (decoder.norm.weight, float(decoder.norm.variance_epsilon))
        self.lm_head = _linear(causal_lm.lm_head)  # type: ignore[assignment]
        attention = decoder.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.scale = float(attention.scaling)
        self.inv_freq: torch.Tensor = decoder.rotary_emb.inv_freq
        self.rope_scaling = float(decoder.rotary_emb.attention_scaling)
        self.dtype = self.embedding.dtype
        self.device = self.embedding.device
        self.rows = 0

    @staticmethod
    def unsupported(model: Any) -> str | None:
        """Why ``model`` cannot be decoded by this class, or ``None`` when it can."""
        try:
            StaticCacheDecoder(model)
        except ValueError as error:
            return str(error)
        return None

    # -- the batch ------------------------------------------------------------------------------------------

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        prefixes: Sequence[CachedPrefix | None] | None = None,
    ) -> torch.Tensor:
        """Start a batch: run ``prompts`` (right-padded) through the model, keep their keys and values in a cache
        that grows to room for ``new_tokens`` more per row, and return the logits after each prompt,
        ``[rows, vocab]`` (model dtype).

        ``prefixes[i]``, when given, holds the keys and values of the first ``prefixes[i].length`` tokens of
        ``prompts[i]`` (a strict prefix, computed with these weights): only the tokens after it run."""
        if prefixes is not None and any(p is not None for p in prefixes):
            return self._prefill_after(prompts, new_tokens, prefixes)
        rows = len(prompts)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros((rows, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        ids = ids.to(self.device)
        self._start(lengths, new_tokens, torch.empty)

        x = F.embedding(ids, self.embedding)
        cos, sin = self.cos[None, None, :width], self.sin[None, None, :width]
        for i, layer in enumerate(self.layers[:-1]):
            x = self._prompt_layer(i, layer, x, cos, sin)
        # The last layer: keys and values everywhere, the rest at each prompt's last position only.
        last = len(self.layers) - 1
        layer = self.layers[last]
        h = _rms_norm(x, layer.input_norm)
        self._store(last, layer, h, cos, sin, 0)
        index = torch.arange(rows, device=self.device)
        x_last = x[index, self.lengths - 1][:, None]
        h_last = h[index, self.lengths - 1][:, None]
        pos = self.lengths - 1
        mask = self.valid[:, None, None, :width] if self.padded else None
        x_last = self._finish_layer(last, layer, x_last, h_last, pos, mask)
        return self.lm_head(_rms_norm(x_last, self.norm))[:, -1]

    def _start(self, lengths: list[int], new_tokens: int, allocate: Any) -> None:
        """The batch's bookkeeping and its cache (``allocate``: ``torch.empty`` or ``torch.zeros``) for prompts
        of ``lengths`` and room for ``new_tokens`` more per row."""
        width = max(lengths)
        self.rows = len(lengths)
        self.width = width
        self.columns = width  # cache columns written so far
        self.max_columns = width + new_tokens
        self.lengths = torch.as_tensor(lengths, device=self.device)
        self.positions = self.lengths.clone()  # position of each row's next token
        self.padded = min(lengths) != width
        # The cache starts with room for a few generated tokens and doubles its generated part when full, so a
        # large max_new_tokens costs memory only when the tokens are generated.
        capacity = min(self.max_columns, width + _FIRST_ROOM)
        # A row's valid cache columns: its prompt, then every generated column.
        self.valid = torch.arange(capacity, device=self.device)[None, :] < self.lengths[:, None]
        shape = (self.rows, self.kv_heads, capacity, self.head_dim)
        self.keys = [allocate(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [allocate(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        positions = torch.arange(self.max_columns, device=self.device)
        freqs = positions[:, None].float() * self.inv_freq.to(device=self.device, dtype=torch.float)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        self.sin = (emb.sin() * self.rope_scaling).to(self.dtype)

    def _prefill_after(
        self, prompts: Sequence[Sequence[int]], new_tokens: int, prefixes: Sequence[CachedPrefix | None]
    ) -> torch.Tensor:
        """``prefill`` where some rows start with cached keys and values: a row's prompt tokens sit at the cache
        columns of their positions, its cached prefix is copied in, and only its remaining tokens (the
        *suffix*, right-padded to the longest suffix) run, attending causally to the prefix and to each other.
        Columns past a row's prompt are zeros and masked, as in a right-padded prefill."""
        rows = len(prompts)
        starts = [0 if p is None else p.length for p in prefixes]
        for row, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            if start >= len(prompt):
                raise ValueError(f"prefixes[{row}] covers {start} of the prompt's {len(prompt)} tokens")
        lengths = [len(p) for p in prompts]
        self._start(lengths, new_tokens, torch.zeros)
        width = self.width
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                for i in range(len(self.layers)):
                    self.keys[i][row, :, : prefix.length] = prefix.keys[i]
                    self.values[i][row, :, : prefix.length] = prefix.values[i]
        suffix = max(n - s for n, s in zip(lengths, starts, strict=True))
        ids = torch.zeros((rows, suffix), dtype=torch.long)
        for row, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            ids[row, : len(prompt) - start] = torch.as_tensor(list(prompt[start:]), dtype=torch.long)
        ids = ids.to(self.device)
        start_t = torch.as_tensor(starts, device=self.device)
        offsets = torch.arange(suffix, device=self.device)
        real = offsets[None, :] < (self.lengths - start_t)[:, None]  # [rows, suffix]: not padding
        pos = torch.where(real, start_t[:, None] + offsets[None, :], 0)  # padding reads position 0's rotation
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [rows, 1, suffix, head_dim]
        # Query (row, j) sees the columns up to its own position.
        mask = torch.arange(width, device=self.device)[None, None, None, :] <= pos[:, None, :, None]
        where = real.nonzero(as_tuple=True)
        rows_at, columns_at = where[0], pos[where]
        x = F.embedding(ids, self.embedding)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm)
            k = _rotate(layer.k(h).view(rows, suffix, -1, self.head_dim).transpose(1, 2), cos, sin)
            v = layer.v(h).view(rows, suffix, -1, self.head_dim)
            self.keys[i][rows_at, :, columns_at] = k.transpose(1, 2)[where]
            self.values[i][rows_at, :, columns_at] = v[where]
            if i == len(self.layers) - 1:  # the last layer: at each prompt's last position only
                last = self.lengths - start_t - 1
                index = torch.arange(rows, device=self.device)
                x = self._finish_layer(
                    i,
                    layer,
                    x[index, last][:, None],
                    h[index, last][:, None],
                    self.lengths - 1,
                    self.valid[:, None, None, :width],
                )
                break
            q = _rotate(layer.q(h).view(rows, suffix, -1, self.head_dim).transpose(1, 2), cos, sin)
            out = F.scaled_dot_product_attention(
                q,
                self.keys[i][:, :, :width],
                self.values[i][:, :, :width],
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=self.heads != self.kv_heads,
            )
            x = x + layer.o(out.transpose(1, 2).reshape(rows, suffix, -1))
            x = x + _mlp(layer, _rms_norm(x, layer.post_norm))
        self.padded = True
        return self.lm_head(_rms_norm(x, self.norm))[:, -1]

    def export(self, row: int, tokens: Sequence[int]) -> CachedPrefix:
        """The keys and values of ``tokens``, copied out of the batch's cache: batch row ``row``'s prompt and its
        first ``len(tokens) - prompt length`` generated tokens (prompt first; every generated one fed by a
        ``step``), or, when ``tokens`` is no longer than the prompt, the prompt's first ``len(tokens)``."""
        prompt = int(self.lengths[row])
        generated = len(tokens) - prompt
        if self.width + generated > self.columns:
            raise ValueError(f"row {row} has {prompt} prompt tokens and {self.columns - self.width} fed")

        def take(cache: torch.Tensor) -> torch.Tensor:
            if generated <= 0:
                return cache[row, :, : len(tokens)].clone()
            return torch.cat(
                (cache[row, :, :prompt], cache[row, :, self.width : self.width + generated]), dim=1
            )

        return CachedPrefix(
            tuple(tokens), tuple(take(k) for k in self.keys), tuple(take(v) for v in self.values)
        )

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (``[rows]``, one per row) and return the logits after them, ``[rows, vocab]``."""
        column = self.columns
        if column >= self.max_columns:
            raise RuntimeError(
                f"the batch has the {self.max_columns - self.width} new tokens prefill made room for"
            )
        if column >= self.valid.shape[1]:
            self._grow()
        self.valid[:, column] = True
        self.columns += 1
        mask = self.valid[:, None, None, : self.columns] if self.padded else None
        pos = self.positions
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]
        x = F.embedding(tokens[:, None], self.embedding)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm)
            self._store(i, layer, h, cos, sin, column)
            x = self._finish_layer(i, layer, x, h, pos, mask, cos, sin)
        self.positions = pos + 1
        return self.lm_head(_rms_norm(x, self.norm))[:, -1]

    def _grow(self) -> None:
        """Double the room for generated tokens (at most to ``max_columns``), copying the cache."""
        capacity = self.valid.shape[1]
        extra = min(self.max_columns, self.width + 2 * (capacity - self.width)) - capacity
        self.keys = [torch.cat((k, k.new_empty((*k.shape[:2], extra, k.shape[3]))), dim=2) for k in self.keys]
        self.values = [
            torch.cat((v, v.new_empty((*v.shape[:2], extra, v.shape[3]))), dim=2) for v in self.values
        ]
        self.valid = torch.cat((self.valid, self.valid.new_zeros((self.rows, extra))), dim=1)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows, in the order given)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
        self.rows = int(rows.numel())

    # -- the layer ------------------------------------------------------------------------------------------

    def _prompt_layer(
        self, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """A whole decoder layer over the right-padded prompts ``[rows, width, hidden]`` (causal attention)."""
        rows, width, _ = x.shape
        residual = x
        h = _rms_norm(x, layer.input_norm)
        q = layer.q(h).view(rows, width, -1, self.head_dim).transpose(1, 2)
        keys, values = self._store(i, layer, h, cos, sin, 0)
        q = _rotate(q, cos, sin)
        out = F.scaled_dot_product_attention(
            q, keys, values, scale=self.scale, is_causal=True, enable_gqa=self.heads != self.kv_heads
        )
        x = residual + layer.o(out.transpose(1, 2).reshape(rows, width, -1))
        h = _rms_norm(x, layer.post_norm)
        return x + _mlp(layer, h)

    def _store(
        self, i: int, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, column: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rotated keys and the values of ``h`` (``[rows, T, hidden]``) at ``column``; return the cache
        up to the last column written, ``[rows, kv_heads, columns, head_dim]`` each."""
        rows, length, _ = h.shape
        k = layer.k(h).view(rows, length, -1, self.head_dim).transpose(1, 2)
        v = layer.v(h).view(rows, length, -1, self.head_dim).transpose(1, 2)
        end = column + length
        self.keys[i][:, :, column:end] = _rotate(k, cos, sin)
        self.values[i][:, :, column:end] = v
        return self.keys[i][:, :, :end], self.values[i][:, :, :end]

    def _finish_layer(
        self,
        i: int,
        layer: _Layer,
        x: torch.Tensor,
        h: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor | None,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rest of a layer for one query per row (``x``, ``h`` = normed ``x``: ``[rows, 1, hidden]``) at
        positions ``pos``, attending to the cache columns written so far (``mask``: valid ones, ``None`` = all)."""
        rows = x.shape[0]
        if cos is None or sin is None:
            cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]
        q = _rotate(layer.q(h).view(rows, 1, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        # Grouped queries: each kv head serves `group` query heads, which attend as `group` query rows.
        group = self.heads // self.kv_heads
        q = q.reshape(rows, self.kv_heads, group, self.head_dim)
        end = self.columns
        out = F.scaled_dot_product_attention(
            q, self.keys[i][:, :, :end], self.values[i][:, :, :end], attn_mask=mask, scale=self.scale
        )
        x = x + layer.o(out.reshape(rows, 1, -1))
        h = _rms_norm(x, layer.post_norm)
        return x + _mlp(layer, h)
