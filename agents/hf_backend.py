"""The embedded generation backend: Hugging Face transformers, token ids in, token ids and log-probs out.

``HFBackend`` implements ``streamrl.agents.base.GenerationBackend`` with its own decoding loop rather than
``model.generate``, because RL needs things ``generate`` does not give directly:

- the log-prob of every sampled token **under the distribution it was actually sampled from** -- softmax of
  ``logits / temperature`` restricted to the top-k / top-p set and renormalized (vLLM's
  ``logprobs_mode="processed_logprobs"``). With the SPO++ rollout setting (temperature 1, top-p 1, top-k off)
  this is exactly the model's log-prob, which ``score`` and the learner recompute. Greedy decoding (temperature
  0) reports the model's temperature-1 log-prob of the argmax token.
- per-request seeds that do not depend on the batch: row ``i`` of a call samples with seed ``seeds[i]`` or
  ``seed + i`` (``streamrl.agents.base.request_seeds``). Its ``k``-th token inverts the CDF of its distribution
  at the ``k``-th uniform of a generator seeded with its seed (``sampling_uniforms``, ``inverse_cdf_sample``):
  the whole batch samples in a few tensor operations, and a prompt's sample is reproducible whatever else
  shares its batch.
- stop strings checked on the decoded tail of a row, only after a token that may complete one
  (``stop_string_candidates``); the token that completes a stop string is kept (a token cannot be cut),
  ``Generation.extra["stop"]`` names what stopped it.
- generation constrained to given token sequences (``choices``, e.g. an env's admissible commands): every
  step masks the logits outside the tokens that continue some choice, and a row that has written a whole
  choice stops (``extra["stop"] == "choice"`` when no stop id ended it).

The model runs in ``streamrl.agents.static_cache.StaticCacheDecoder`` (Llama/Qwen2 architectures: a
preallocated KV cache, the layer arithmetic from the weight tensors, no module calls) or, for any other causal
LM, ``HFForwardDecoder`` (the model's forward over a ``DynamicCache``); ``HFBackendConfig.decode`` chooses.
Finished rows stay in the batch until they are a quarter of it, then leave it (their KV-cache rows are dropped).

Episode history. After a call, the static decoder's keys and values of each row's prompt and generated tokens
stay in ``HFBackend.prefix_cache`` (``streamrl.agents.prefix_cache``, at most
``HFBackendConfig.prefix_cache_bytes``) until the weights change; a later prompt that continues one of them (the
next turn of an episode: prompt, generated tokens, observation) runs only its new tokens. The generated ids and
log-probs are those of the whole prompt to float rounding (the kept keys were computed one decode step at a time).
``generate(..., keep=...)`` keeps a given head of a prompt instead (a windowed episode's system message and first
observation, which every later prompt of the episode starts with but no later prompt continues whole).

Adapters. ``set_adapter(path, v)`` loads the peft adapter saved at ``path`` under a name of the backend's own
(``streamrl-v<v>-load<n>``) and serves it; the backend's previous loads are then deleted. ``set_adapter(None,
v)`` serves the base weights (every adapter disabled during the backend's forward passes) without deleting
anything. A model handed over already loaded -- e.g. the learner's own ``PeftModel`` -- is the caller's: it is
served *as is* (its active adapter, version 0) until the first ``set_adapter``, and the backend never deletes,
deactivates or freezes the caller's adapters: a published adapter is loaded next to them and made active only
for the duration of the backend's own passes (the active adapter and every ``requires_grad`` flag are restored
afterwards), so a learner can keep training its adapter in place. (A plain ``PreTrainedModel`` handed over
is wrapped by peft at the first load, which injects the adapter's layers into its modules.) The backend does
put the model in eval mode (dropout off), at construction and when it loads an adapter.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from streamrl.agents.base import (
    FinishReason,
    Generation,
    SamplingParams,
    allowed_next_tokens,
    check_choices,
    check_score_inputs,
    request_seeds,
)
from streamrl.agents.batch import pad_right
from streamrl.agents.logprobs import position_ids_from_mask, token_logprobs
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.prefix_cache import CachedPrefix, PrefixCache
from streamrl.agents.static_cache import StaticCacheDecoder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HFBackendConfig:
    """Where and how the model runs."""

    device: str = "auto"
    """"auto" = "cuda" when available, else "cpu"; or any torch device string."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """"auto" = bfloat16 on a GPU that supports it, float32 otherwise; or "float32" / "bfloat16" / "float16"."""
    max_batch_size: int = 32
    """Prompts per forward pass; longer calls are split into chunks."""
    seed: int = 0
    """Seeds the backend's own generator, used for calls whose ``SamplingParams.seed`` is ``None``."""
    num_threads: int | None = None
    """If set, ``torch.set_num_threads`` at construction (1 is best on a shared CPU box, docs/platform.md §3)."""
    decode: Literal["auto", "static", "hf"] = "auto"
    """How generation runs the model: "static" = ``StaticCacheDecoder`` (Llama/Qwen2 architectures; a preallocated
    KV cache, no module calls; ``ValueError`` for a model it cannot run), "hf" = the model's own forward over a
    transformers ``DynamicCache`` (any causal LM), "auto" (default) = "static" where it can run, else "hf". Both
    compute the same logits up to float rounding and sample them the same way."""
    prefix_cache_bytes: int = 1 << 30
    """Keys and values kept for prompts that continue an earlier generation (the next turn of an episode), at most
    this many bytes (``streamrl.agents.prefix_cache``); 0 = every prompt runs whole. The static decoder only."""

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.decode not in ("auto", "static", "hf"):
            raise ValueError(f"decode must be 'auto', 'static' or 'hf', got {self.decode!r}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0 = off), got {self.prefix_cache_bytes}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        device = self.torch_device()
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs of the distribution ``params`` samples from, one row per sequence (``-inf`` = filtered out).

    Temperature scaling, then top-k, then top-p (nucleus: the smallest set of most likely tokens whose
    probability reaches ``top_p``), then renormalization -- the order of vLLM and HF's logits processors.
    Greedy (temperature 0) returns the unscaled log-softmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly before it already reach top_p (the first one always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sampling_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """``[rows, steps]`` float64 uniforms in [0, 1): row ``i``'s ``k``-th is the ``k``-th double drawn by a torch
    generator seeded ``seeds[i]``, so the token a row samples at step ``k`` (``inverse_cdf_sample``) is a function of
    its seed, its step and its distribution alone -- not of the batch it shares, nor of the call's budget."""
    out = torch.empty((len(seeds), steps), dtype=torch.float64)
    for row, seed in enumerate(seeds):
        torch.rand(steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64, out=out[row])
    return out


_CDF_BLOCK = 64
"""Tokens per block of ``inverse_cdf_sample``'s two-level CDF."""


def inverse_cdf_sample(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logprobs`` (``[rows, vocab]``, ``-inf`` = excluded), drawn by inverting the row's CDF
    at ``uniforms`` (``[rows]``, in [0, 1)): the first token whose cumulative probability exceeds ``u`` times the
    row's total. Token ``t`` is drawn with probability ``p_t / sum(p)`` (float64 sums), never one of probability 0.

    The CDF is two-level -- float64 sums of blocks of ``_CDF_BLOCK`` tokens, then the cumulative sum inside the
    chosen block only -- because a float64 cumulative sum over the whole vocabulary is a serial scan that costs
    more than the rest of the sampling step."""
    probs = logprobs.exp()
    rows, vocab = probs.shape
    if vocab % _CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, -vocab % _CDF_BLOCK))
    blocks = probs.view(rows, -1, _CDF_BLOCK)
    outer = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    target = uniforms[:, None].to(torch.float64) * outer[:, -1:]
    block = _first_above(outer, target)
    before = torch.where(block > 0, outer.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), block[:, 0]].cumsum(-1, dtype=torch.float64)
    return (block * _CDF_BLOCK + _first_above(inner, target - before))[:, 0]


def _first_above(cdf: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, the first index where ``cdf`` exceeds ``values`` (``[rows, 1]``); where none does (``values``
    rounded up to the row's total), the first index that reaches the total: the last one of non-zero mass."""
    above = torch.searchsorted(cdf, values.contiguous(), right=True)
    return torch.minimum(above, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))


def stop_string_candidates(tokenizer: Any, vocab: int, stop_strings: Sequence[str]) -> frozenset[int]:
    """The token ids (below ``vocab``) after which a row's decoded text may newly contain one of ``stop_strings``.

    A stop string first appears when the newest token writes its last character, so a token can complete ``s``
    only if its text contains ``s[-1]`` -- decoded alone, or after another token (tokenizers that drop the
    leading space of a text's first token) -- or holds a replacement character (a piece of a multi-byte
    character). Ids past the tokenizer's vocabulary are candidates, and every id is when a stop string is empty
    or ends in the replacement character.
    """
    lasts = {s[-1] if s else "" for s in stop_strings}
    if lasts & {"", "\ufffd"}:
        return frozenset(range(vocab))
    known = min(vocab, len(tokenizer))
    alone = tokenizer.batch_decode([[t] for t in range(known)], skip_special_tokens=False)
    anchor = tokenizer.encode("a", add_special_tokens=False)[:1]
    head = tokenizer.decode(anchor, skip_special_tokens=False)
    after = tokenizer.batch_decode([[*anchor, t] for t in range(known)], skip_special_tokens=False)
    after = [text[len(head) :] if text.startswith(head) else text for text in after]
    ids = {t for t in range(known) if any(c in alone[t] or c in after[t] for c in (*lasts, "\ufffd"))}
    return frozenset(ids | set(range(known, vocab)))


class HFForwardDecoder:
    """Prefill and decode steps through the model's own forward and a transformers ``DynamicCache``: any causal
    LM. Prompts are left-padded with explicit position ids ``cumsum(attention_mask) - 1`` (docs/platform.md §2).
    The interface of ``StaticCacheDecoder`` (``prefill``, ``step``, ``keep``)."""

    def __init__(self, model: Any, pad_token_id: int, device: torch.device) -> None:
        from transformers import DynamicCache

        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.cache = DynamicCache()

    def prefill(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> torch.Tensor:
        """Run ``prompts``; return the logits after each, ``[rows, vocab]``."""
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        self.mask = mask.to(self.device)
        positions = position_ids_from_mask(self.mask)
        self.last_pos = positions[:, -1]
        return self.model(
            input_ids=ids.to(self.device),
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (one per row); return the logits after them."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self.last_pos = self.last_pos + 1
        return self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=self.last_pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows, in the order given)."""
        self.cache.batch_select_indices(rows)
        self.mask, self.last_pos = self.mask[rows], self.last_pos[rows]


def read_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of every ``*.safetensors`` file in ``directory`` (as ``save_pretrained`` writes them), by
    name, on the CPU."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def load_weights(model: Any, directory: str | os.PathLike[str]) -> None:
    """Load the full model weights saved in ``directory`` (``read_weights``) into ``model`` in place: how a
    served model takes a fully fine-tuned policy. ``ValueError`` when they do not fit it (a tied
    ``lm_head.weight``, not saved twice, may be missing)."""
    missing, unexpected = model.load_state_dict(read_weights(directory), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{directory}: weights do not fit the served model (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )


def _is_peft_model(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


class HFBackend:
    """Generation and scoring with a transformers causal LM; LoRA adapters by version (see module doc)."""

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        *,
        tokenizer: Any = None,
        config: HFBackendConfig | None = None,
    ) -> None:
        """``model``: a registry name (``"tiny"``, ``"smollm2-135m"``), a local HF directory, or an already
        loaded ``PreTrainedModel`` / ``PeftModel`` (then ``tokenizer`` is required and the model is served as
        is, its active adapter included; see the module doc for what ``set_adapter`` does to it)."""
        self.config = config or HFBackendConfig()
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype()
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            path = resolve_model(model)
            self.model_path: str | None = str(path)
            self._model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype).to(self.device)  # type: ignore[arg-type]
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        else:
            if tokenizer is None:
                raise ValueError("HFBackend(model=<loaded model>) needs tokenizer=...")
            self.model_path = None
            self._model = model
            self.tokenizer = tokenizer
            self.device = next(model.parameters()).device
        # A PeftModel handed over is the caller's: its adapters are not the backend's to delete or switch.
        self._callers_model = self.model_path is None and _is_peft_model(self._model)
        self._model.eval()
        self._lock = threading.RLock()
        self._seeds = random.Random(self.config.seed)
        self._version = 0
        self._adapter_name: str | None = None  # the backend's own adapter being served
        self._base_weights = False  # set_adapter(None, v): serve with every adapter disabled
        self._loaded: list[str] = []  # adapter names this backend loaded (the only ones it deletes)
        self._loads = 0  # adapters loaded so far (each gets a fresh peft adapter name)
        self._closed = False
        self._string_ends: dict[tuple[int, tuple[str, ...]], frozenset[int]] = {}
        self.prefix_cache = PrefixCache(self.config.prefix_cache_bytes)
        self.pad_token_id = int(
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.eos_token_ids = self._eos_ids()
        self.max_positions = int(getattr(self._model.config, "max_position_embeddings", 1 << 30))

    # -- properties -------------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """The served model (a ``PeftModel`` once an adapter has been loaded)."""
        return self._model

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HFBackend is closed (close() dropped its model); create a new HFBackend")

    @property
    def adapter_version(self) -> int:
        return self._version

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # -- adapters -----------------------------------------------------------------------------------------

    def set_adapter(self, path: str | os.PathLike[str] | None, version: int) -> None:
        """Serve the peft adapter saved at ``path`` as ``version``; ``None`` = the base weights (module doc)."""
        if version < 0:
            raise ValueError(f"adapter version must be >= 0, got {version}")
        with self._lock:
            self._check_open()
            self.prefix_cache.clear()  # computed with the weights served until now
            if path is None:
                self._adapter_name, self._base_weights, self._version = None, True, version
                return
            from peft import PeftModel

            path = os.fspath(path)
            if not os.path.isfile(os.path.join(path, "adapter_config.json")):
                raise FileNotFoundError(f"{path} is not a peft adapter directory (no adapter_config.json)")
            # A fresh name per load: the new weights are loaded next to the served ones, switched to, and only
            # then are the backend's earlier loads dropped (re-publishing a version number, or going back to an
            # adapter after serving the base weights, needs no special case).
            self._loads += 1
            name = f"streamrl-v{version}-load{self._loads}"
            if isinstance(self._model, PeftModel):
                with self._callers_state_kept():
                    self._model.load_adapter(path, adapter_name=name, is_trainable=False)
                    if not self._callers_model:
                        self._model.set_adapter(name, inference_mode=True)
                    for old in self._loaded:
                        self._model.delete_adapter(old)
            else:
                self._model = PeftModel.from_pretrained(
                    self._model, path, adapter_name=name, is_trainable=False
                )
                self._model.to(self.device)
            self._model.eval()
            self._loaded = [name]
            self._adapter_name, self._base_weights, self._version = name, False, version

    @contextmanager
    def _callers_state_kept(self) -> Iterator[None]:
        """Restore a caller's model's active adapter and ``requires_grad`` flags on exit (peft's
        ``set_adapter``, ``load_adapter`` and ``disable_adapter`` change them); a no-op on the backend's own."""
        if not self._callers_model:
            yield
            return
        model = self._model
        active = model.active_adapter
        flags = {id(p): p.requires_grad for p in model.parameters()}
        try:
            yield
        finally:
            if model.active_adapter != active:
                model.set_adapter(active)
            for p in model.parameters():  # an adapter loaded meanwhile is the backend's: never trained
                p.requires_grad_(flags.get(id(p), False))

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """Forward passes run under this: the selected weights, whatever the model's own active adapter."""
        from peft import PeftModel

        self._check_open()
        model = self._model
        with torch.inference_mode():
            if not isinstance(model, PeftModel):
                yield
            elif self._base_weights:
                with self._callers_state_kept(), model.disable_adapter():
                    yield
            elif self._adapter_name is not None and self._adapter_name != model.active_adapter:
                with self._callers_state_kept():  # the backend's adapter in the caller's model
                    model.set_adapter(self._adapter_name, inference_mode=True)
                    yield
            else:
                yield  # the model's active adapter is the one to serve

    # -- scoring ------------------------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        """Log-probs (temperature 1, no filtering) of ``sequences[i][prompt_lengths[i]:]`` given what precedes."""
        check_score_inputs(sequences, prompt_lengths)
        results: list[list[float]] = []
        with self._lock, self._serving():
            for start in range(0, len(sequences), self.config.max_batch_size):
                chunk = sequences[start : start + self.config.max_batch_size]
                ids, mask = pad_right(chunk, self.pad_token_id)
                lp = token_logprobs(self._model, ids.to(self.device), mask.to(self.device)).cpu()
                for row, seq in enumerate(chunk):
                    p = prompt_lengths[start + row]
                    results.append(lp[row, p - 1 : len(seq) - 1].tolist())
        return results

    # -- generation ---------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
        keep: Sequence[int | None] | None = None,
    ) -> list[Generation]:
        """Complete every prompt; see the module doc for what the log-probs and seeds mean, and
        ``GenerationBackend.generate`` for ``choices`` (completions constrained to token id sequences).

        ``keep[i]`` (static decoder, prefix cache on) says what of prompt ``i`` later prompts will start with:
        ``None`` (the default): the prompt and its generated tokens (the next turn of a growing episode); an
        int ``n``: only the prompt's first ``n`` tokens (``0 <= n <= len(prompts[i])``; a windowed episode's
        fixed head), kept unless the prompt already started from a kept sequence at least that long."""
        self._check_open()
        if not prompts:
            return []
        options = check_choices(len(prompts), choices)
        heads: list[int | None] = [None] * len(prompts) if keep is None else list(keep)
        if len(heads) != len(prompts):
            raise ValueError(f"keep has {len(heads)} entries for {len(prompts)} prompts")
        for i, n in enumerate(heads):
            if n is not None and not 0 <= n <= len(prompts[i]):
                raise ValueError(f"keep[{i}]={n} is outside [0, {len(prompts[i])}] (prompt {i}'s length)")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token")
            if len(prompt) >= self.max_positions:
                raise ValueError(
                    f"prompts[{i}] has {len(prompt)} tokens; the model's context is {self.max_positions} tokens"
                )
        with self._lock:
            row_seeds = request_seeds(len(prompts), params, self._seeds, seeds)
            out: list[Generation] = []
            for start in range(0, len(prompts), self.config.max_batch_size):
                stop = start + self.config.max_batch_size
                out.extend(
                    self._generate_chunk(
                        prompts[start:stop],
                        row_seeds[start:stop],
                        params,
                        options[start:stop],
                        heads[start:stop],
                    )
                )
            return out

    def _decoder(self) -> StaticCacheDecoder | HFForwardDecoder:
        """The decoder of a batch (built under ``_serving``, whose adapter state the static decoder reads)."""
        if self.config.decode == "hf":
            return HFForwardDecoder(self._model, self.pad_token_id, self.device)
        try:
            return StaticCacheDecoder(self._model)
        except ValueError:
            if self.config.decode == "static":
                raise
            return HFForwardDecoder(self._model, self.pad_token_id, self.device)

    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        params: SamplingParams,
        choices: Sequence[list[list[int]] | None],
        heads: Sequence[int | None],
    ) -> list[Generation]:
        """One batch: prefill, then a step per token; the whole batch is sampled and recorded in tensor ops, and
        only the rows a token may end (or that are constrained) are looked at in Python."""
        n = len(prompts)
        budgets = [min(params.max_new_tokens, self.max_positions - len(p)) for p in prompts]
        steps = max(budgets)
        uniforms = None if params.greedy else sampling_uniforms(seeds, steps).to(self.device)
        stop_ids = self.eos_token_ids | set(params.stop_token_ids)
        stop_tail = max((len(s.encode()) for s in params.stop_strings), default=0) + 1
        tokens = torch.zeros((n, steps), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((n, steps), dtype=torch.float32, device=self.device)
        # Per row: why it ended and after how many tokens; the tokens so far of a constrained row.
        ends: list[tuple[FinishReason, Any] | None] = [None] * n
        lengths = [0] * n
        prefixes: dict[int, list[int]] = {row: [] for row in range(n) if choices[row] is not None}
        rows = list(range(n))  # original row of each row in the batch (finished rows stay until compacted)
        index = torch.arange(n, device=self.device)
        budget = torch.as_tensor(budgets, device=self.device)
        live = n
        with self._serving():
            decoder = self._decoder()
            found: list[CachedPrefix | None] | None = None
            if isinstance(decoder, StaticCacheDecoder) and self.config.prefix_cache_bytes:
                self.prefix_cache.sync(self._weights_state())
                found = [self.prefix_cache.lookup(p) for p in prompts]
                logits = decoder.prefill(prompts, steps, found)
            else:
                logits = decoder.prefill(prompts, steps)
            table, string_ends = self._stop_table(logits.shape[-1], stop_ids, params.stop_strings)
            for step in range(steps):
                constrained = [(j, r) for j, r in enumerate(rows) if r in prefixes and ends[r] is None]
                if constrained:
                    logits = self._constrain(logits, [(j, choices[r], prefixes[r]) for j, r in constrained])
                lp = sampling_logprobs(logits, params)
                if uniforms is None:
                    chosen = lp.argmax(-1)
                else:
                    chosen = inverse_cdf_sample(lp, uniforms[index, step])
                tokens[index, step] = chosen
                logprobs[index, step] = lp.gather(-1, chosen[:, None]).squeeze(-1)
                # Only rows whose token may end them are looked at in Python: a stop id, a token that may
                # complete a stop string, the budget reached, or a constrained row.
                flagged = torch.nonzero(table[chosen] | (budget[index] <= step + 1)).flatten().tolist()
                looked_at = sorted(set(flagged).union(j for j, _ in constrained))
                chosen_ids = chosen.tolist() if looked_at else []
                for j in looked_at:
                    row, token = rows[j], chosen_ids[j]
                    if ends[row] is not None:
                        continue
                    end: tuple[FinishReason, Any] | None = None
                    if token in stop_ids:
                        end = ("stop", token)
                    elif token in string_ends:
                        tail = tokens[row, max(0, step + 1 - stop_tail) : step + 1].tolist()
                        end = self._stop_string(tail, params.stop_strings)
                    if end is None and step + 1 >= budgets[row]:
                        end = ("length", None)
                    if row in prefixes:
                        prefixes[row].append(token)
                        if (end is None or end[0] != "stop") and not allowed_next_tokens(
                            choices[row], prefixes[row]
                        ):
                            end = ("stop", "choice")  # a whole choice, no stop id
                    if end is not None:
                        ends[row], lengths[row] = end, step + 1
                        live -= 1
                if live == 0:
                    break
                if 4 * (len(rows) - live) >= len(rows):  # finished rows are a quarter of the batch: drop them
                    if found is not None:
                        self._keep_prefixes(decoder, prompts, rows, ends, lengths, tokens, found, heads)
                    keep = [j for j, r in enumerate(rows) if ends[r] is None]
                    kept = torch.as_tensor(keep, device=self.device)
                    decoder.keep(kept)
                    rows = [rows[j] for j in keep]
                    index, chosen = index[kept], chosen[kept]
                logits = decoder.step(chosen)
            if found is not None:
                self._keep_prefixes(decoder, prompts, rows, ends, lengths, tokens, found, heads)
        ids, lps = tokens.tolist(), logprobs.tolist()
        out = []
        for row, end in enumerate(ends):
            assert end is not None
            reason, what = end
            out.append(
                Generation(
                    token_ids=ids[row][: lengths[row]],
                    logprobs=lps[row][: lengths[row]],
                    finish_reason=reason,
                    adapter_version=self._version,
                    extra={"stop": what} if what is not None else {},
                )
            )
        return out

    def _weights_state(self) -> tuple[Any, ...]:
        """What the served weights are: the version and adapter served, and every parameter tensor's version
        counter (bumped by any in-place write: a loaded checkpoint, an optimizer step on a shared model)."""
        active = getattr(self._model, "active_adapter", None)
        return (
            self._version,
            self._adapter_name,
            self._base_weights,
            str(active),
            tuple(p._version for p in self._model.parameters()),
        )

    def _keep_prefixes(
        self,
        decoder: StaticCacheDecoder,
        prompts: Sequence[Sequence[int]],
        rows: list[int],
        ends: list[tuple[FinishReason, Any] | None],
        lengths: list[int],
        tokens: torch.Tensor,
        found: list[CachedPrefix | None],
        heads: Sequence[int | None],
    ) -> None:
        """Put the finished rows still in ``decoder`` into the prefix cache: prompt + generated tokens but the
        last (never fed), each superseding the entry its prompt started with; or, for a row with a head length
        ``heads[row]``, the prompt's first that many tokens, unless its prompt started from one that long."""
        done = [(j, row) for j, row in enumerate(rows) if ends[row] is not None]
        whole = [(j, row) for j, row in done if heads[row] is None]
        for j, row in done:
            head = heads[row]
            if head is None or head == 0:
                continue
            start = found[row]
            if start is None or start.length < head:
                self.prefix_cache.store(decoder.export(j, prompts[row][:head]))
        if not whole:
            return
        generated = tokens[[row for _, row in whole]].tolist()  # one transfer for the rows kept
        for (j, row), ids in zip(whole, generated, strict=True):
            fed = [*prompts[row], *ids[: lengths[row] - 1]]
            self.prefix_cache.store(decoder.export(j, fed), continues=found[row])

    @staticmethod
    def _constrain(
        logits: torch.Tensor, rows: Sequence[tuple[int, list[list[int]] | None, list[int]]]
    ) -> torch.Tensor:
        """``logits`` with ``-inf`` outside each constrained row's ``allowed_next_tokens`` (``rows``: batch
        position, choices, tokens so far), so that sampling, greedy and the reported log-probs all follow the
        renormalized distribution. A row has always at least one allowed token here: a generation stops as soon
        as its prefix is a whole choice."""
        allow = torch.ones_like(logits, dtype=torch.bool)
        for j, options, prefix in rows:
            if options is not None:
                allow[j] = False
                allow[j, allowed_next_tokens(options, prefix)] = True
        return logits.masked_fill(~allow, float("-inf"))

    def _stop_string(self, tail: list[int], stop_strings: Sequence[str]) -> tuple[FinishReason, str] | None:
        """``("stop", s)`` for the first of ``stop_strings`` in the decoded ``tail`` (a row's last tokens)."""
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        for s in stop_strings:
            if s in text:
                return "stop", s
        return None

    def _stop_table(
        self, vocab: int, stop_ids: set[int] | frozenset[int], stop_strings: Sequence[str]
    ) -> tuple[torch.Tensor, frozenset[int]]:
        """A bool per token id, true for the stop ids and the tokens that may complete one of ``stop_strings``
        (``stop_string_candidates``), and the set of the latter: the decode loop looks at a row in Python only
        after such a token (or at its budget, or when it is constrained)."""
        ends: frozenset[int] = frozenset()
        if stop_strings:
            key = (vocab, tuple(stop_strings))
            if key not in self._string_ends:
                self._string_ends[key] = stop_string_candidates(self.tokenizer, vocab, stop_strings)
            ends = self._string_ends[key]
        table = torch.zeros(vocab, dtype=torch.bool)
        table[[t for t in (*stop_ids, *ends) if 0 <= t < vocab]] = True
        return table.to(self.device), ends

    def cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters since this backend started (the trainer logs them as ``generation/*``):
        prompts that continued a kept sequence (``prefix_hits``) or ran whole (``prefix_misses``), the prompt
        tokens the hits did not run again, and the bytes kept now."""
        cache = self.prefix_cache
        return {
            "prefix_hits": cache.hits,
            "prefix_misses": cache.misses,
            "prefix_reused_tokens": cache.reused_tokens,
            "prefix_kept_bytes": cache.bytes,
        }

    def close(self) -> None:
        """Drop the model (frees its memory once no one else holds a reference); idempotent. Later calls
        raise ``RuntimeError``."""
        with self._lock:
            self._model = None
            self._closed = True
            self.prefix_cache.clear()
