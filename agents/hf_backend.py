"""The embedded generation backend: Hugging Face transformers, token ids in, token ids and log-probs out.

``HFBackend`` implements ``streamrl.agents.base.GenerationBackend`` with its own decoding loop over the
model's KV cache rather than ``model.generate``, because RL needs things ``generate`` does not give directly:

- the log-prob of every sampled token **under the distribution it was actually sampled from** -- softmax of
  ``logits / temperature`` restricted to the top-k / top-p set and renormalized (vLLM's
  ``logprobs_mode="processed_logprobs"``). With the SPO++ rollout setting (temperature 1, top-p 1, top-k off)
  this is exactly the model's log-prob, which ``score`` recomputes. Greedy decoding (temperature 0) reports the
  model's temperature-1 log-prob of the argmax token.
- per-request seeds that do not depend on the batch: row ``i`` of a call samples with its own generator seeded
  ``seeds[i]`` or ``seed + i`` (``streamrl.agents.base.request_seeds``; Gumbel-style ``argmax(p / Exp(1))``, as
  vLLM does for seeded requests), so a prompt's sample is reproducible whatever else shares its batch.
- stop strings checked on the decoded tail of each row; the token that completes a stop string is kept (a
  token cannot be cut), ``Generation.extra["stop"]`` names what stopped it.
- generation constrained to given token sequences (``choices``, e.g. an env's admissible commands): every
  step masks the logits outside the tokens that continue some choice, and a row that has written a whole
  choice stops (``extra["stop"] == "choice"`` when no stop id ended it).

Batches are left-padded with explicit position ids ``cumsum(attention_mask) - 1`` (docs/platform.md §2), and
rows that finish leave the batch (their KV-cache rows are dropped).

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

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

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


def load_weights(model: Any, directory: str | os.PathLike[str]) -> None:
    """Load the full model weights saved in ``directory`` (``*.safetensors``, as ``save_pretrained`` writes
    them) into ``model`` in place: how a served model takes a fully fine-tuned policy. ``ValueError`` when they
    do not fit it (a tied ``lm_head.weight``, not saved twice, may be missing)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
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
    ) -> list[Generation]:
        """Complete every prompt; see the module doc for what the log-probs and seeds mean, and
        ``GenerationBackend.generate`` for ``choices`` (completions constrained to token id sequences)."""
        self._check_open()
        if not prompts:
            return []
        options = check_choices(len(prompts), choices)
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
                        prompts[start:stop], row_seeds[start:stop], params, options[start:stop]
                    )
                )
            return out

    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        params: SamplingParams,
        choices: Sequence[list[list[int]] | None],
    ) -> list[Generation]:
        from transformers import DynamicCache

        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = position_ids_from_mask(mask)
        budgets = [min(params.max_new_tokens, self.max_positions - len(p)) for p in prompts]
        generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        stop_ids = self.eos_token_ids | set(params.stop_token_ids)
        stop_tail = max((len(s.encode()) for s in params.stop_strings), default=0) + 1

        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        results: list[Generation | None] = [None] * n
        active = list(range(n))  # original row of each row still in the batch
        cache = DynamicCache()
        with self._serving():
            logits = self._model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            last_pos = positions[:, -1]
            while True:
                if any(choices[r] is not None for r in active):
                    logits = self._constrain(
                        logits, [choices[r] for r in active], [tokens[r] for r in active]
                    )
                lp = sampling_logprobs(logits, params)
                if params.greedy:
                    chosen = lp.argmax(-1)
                else:
                    noise = torch.stack(
                        [
                            torch.empty(lp.shape[-1], device=lp.device).exponential_(generator=generators[r])
                            for r in active
                        ]
                    )
                    chosen = (lp.exp() / noise).argmax(-1)
                chosen_lp = lp.gather(-1, chosen[:, None]).squeeze(-1)
                keep: list[int] = []
                for j, row in enumerate(active):
                    token = int(chosen[j])
                    tokens[row].append(token)
                    logprobs[row].append(float(chosen_lp[j]))
                    reason, what = self._finished(
                        tokens[row], token, stop_ids, params, stop_tail, budgets[row]
                    )
                    if reason != "stop" and choices[row] is not None:
                        if not allowed_next_tokens(choices[row], tokens[row]):  # a whole choice, no stop id
                            reason, what = "stop", "choice"
                    if reason is None:
                        keep.append(j)
                    else:
                        results[row] = Generation(
                            token_ids=tokens[row],
                            logprobs=logprobs[row],
                            finish_reason=reason,
                            adapter_version=self._version,
                            extra={"stop": what} if what is not None else {},
                        )
                if not keep:
                    break
                if len(keep) < len(active):
                    index = torch.as_tensor(keep, device=self.device)
                    cache.batch_select_indices(index)
                    mask, last_pos, chosen = mask[index], last_pos[index], chosen[index]
                    active = [active[j] for j in keep]
                mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
                last_pos = last_pos + 1
                logits = self._model(
                    input_ids=chosen[:, None],
                    attention_mask=mask,
                    position_ids=last_pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]
        return [r for r in results if r is not None]

    @staticmethod
    def _constrain(
        logits: torch.Tensor, choices: Sequence[list[list[int]] | None], generated: Sequence[list[int]]
    ) -> torch.Tensor:
        """``logits`` with ``-inf`` outside each constrained row's ``allowed_next_tokens``, so that sampling,
        greedy and the reported log-probs all follow the renormalized distribution. A row has always at least
        one allowed token here: a generation stops as soon as its prefix is a whole choice (``_finished``)."""
        allow = torch.ones_like(logits, dtype=torch.bool)
        for j, (options, prefix) in enumerate(zip(choices, generated, strict=True)):
            if options is not None:
                allow[j] = False
                allow[j, allowed_next_tokens(options, prefix)] = True
        return logits.masked_fill(~allow, float("-inf"))

    def _finished(
        self,
        generated: list[int],
        token: int,
        stop_ids: set[int] | frozenset[int],
        params: SamplingParams,
        stop_tail: int,
        budget: int,
    ) -> tuple[FinishReason | None, Any]:
        if token in stop_ids:
            return "stop", token
        if params.stop_strings:
            tail = self.tokenizer.decode(generated[-stop_tail:], skip_special_tokens=False)
            for s in params.stop_strings:
                if s in tail:
                    return "stop", s
        if len(generated) >= budget:
            return "length", None
        return None, None

    def close(self) -> None:
        """Drop the model (frees its memory once no one else holds a reference); idempotent. Later calls
        raise ``RuntimeError``."""
        with self._lock:
            self._model = None
            self._closed = True
