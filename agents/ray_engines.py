"""Rollout engines as Ray actors: one ``GenerationBackend`` in front of N engines, anywhere in a cluster.

``RayEngines(model, HFBackendConfig(...), engines=4)`` starts four Ray actors, each holding its own
``HFBackend`` (or ``VLLMBackend``, given a ``VLLMBackendConfig``) on the model, and is used exactly as one local
engine is (``LLMAgent``, the trainer)::

    backend = RayEngines("tiny", HFBackendConfig(device="cpu"), engines=2, actor_options={"num_cpus": 1})
    generations = backend.generate(prompts, SamplingParams(max_new_tokens=64), seeds=seeds)

- **Routing.** Each prompt of a ``generate`` call goes to the engine with the fewest prompts in flight (ties:
  the lower index), one remote call per engine; the calls run at once and the results come back in prompt
  order. Seeds are fixed here, before routing (``request_seeds``), so a prompt samples the same tokens
  whichever engine serves it; only the last float bits of its log-probs may differ, because an engine's
  arithmetic depends on the batch it computes (padding width, kernel choice). ``score`` goes to the least
  loaded engine whole.
- **Publication by version.** ``set_adapter(path, v)`` (a peft adapter), ``set_weights(path, v)`` (full
  weights, ``save_pretrained``) and ``set_adapter(None, v)`` put the directory's files into Ray's object store
  once; every engine loads them from there (no shared filesystem needed for policies) and answers with the
  version it serves and its log-probs on a probe sequence. Each answer is checked: the version must be ``v``
  and the log-probs those of ``streamrl_probe.json`` in the directory (``write_adapter_probe``; the trainer
  writes it with the learner's own log-probs), or without that file those of the first engine, within the
  mean tolerance ``probe_atol`` (the one probe check, ``streamrl.agents.probe``). Else
  ``AdapterMismatchError`` names the engine. ``adapter_version`` moves to ``v`` only when every engine
  confirmed it.
- **Failures.** An engine whose actor dies (killed, crashed, its node lost), or whose call runs past
  ``request_timeout_s``, is killed and replaced by a fresh actor that loads the model and the current policy
  and passes the same check before it serves. The prompts it held come back as ``Generation(error=...)``
  with no tokens -- never silently redrawn on another engine: ``LLMAgent`` ends those episodes and the
  runtime returns them as failed (``info["error"]``, ``error_kind="engine"``), as the vector env returns the
  episodes of a dead env worker, so the trainer's ledger counts them. ``score`` and publication calls are
  simply repeated on the replacement (nothing is sampled). A slot whose replacement fails to start
  ``max_start_failures`` times in a row raises ``EngineStartError``.

The model directory is read by each engine at the same path on its own node: on a cluster, put models (and
``$STREAMRL_CACHE``, where SFT checkpoints are built) on storage every node mounts. An engine reserves one CPU
and no GPU unless ``actor_options`` says otherwise (e.g. ``{"num_gpus": 1}``), and runs as many torch threads
(``OMP_NUM_THREADS``) as whole CPUs it reserves, at least one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

from streamrl.agents.base import Generation, SamplingParams, check_choices, request_seeds
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig, load_weights
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.probe import (
    PROBE_FILE,
    AdapterMismatchError,
    check_probe,
    probe_atol,
    probe_token_ids,
    read_adapter_probe,
)
from streamrl.agents.vllm_backend import VLLMBackendConfig
from streamrl.envs.ray_workers import DEFAULT_ACTOR_OPTIONS
from streamrl.utils.ray import node_address, require_ray

__all__ = ["EngineStartError", "RayEngines", "RolloutEngine"]

EngineConfig: TypeAlias = HFBackendConfig | VLLMBackendConfig
PolicyKind = Literal["base", "adapter", "weights"]


class EngineStartError(RuntimeError):
    """A rollout engine could not start (the model failed to load, or the cluster cannot place it)."""


@dataclass(frozen=True)
class Policy:
    """A published policy as it travels to the engines: what it is, its version, and its files' bytes."""

    kind: PolicyKind
    version: int
    files: Mapping[str, bytes] = field(default_factory=dict)
    """Relative path -> content: the whole policy directory (adapter or weights, and the probe file)."""

    @classmethod
    def read(cls, kind: PolicyKind, path: str | os.PathLike[str] | None, version: int) -> Policy:
        if version < 0:
            raise ValueError(f"adapter version must be >= 0, got {version}")
        if path is None:
            return cls("base", version)
        root = Path(path)
        marker = "adapter_config.json" if kind == "adapter" else "config.json"
        if not (root / marker).is_file():
            what = "a peft adapter" if kind == "adapter" else "a saved model (save_pretrained)"
            raise FileNotFoundError(f"{root} is not {what} directory (no {marker})")
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return cls(kind, version, files)


# ---------------------------------------------------------------------------------------------------------
# The engine: one actor


class RolloutEngine:
    """The actor behind one engine of :class:`RayEngines`: a local backend in its own process."""

    def __init__(self, model_path: str, config: EngineConfig) -> None:
        if not os.path.isdir(model_path):
            raise FileNotFoundError(
                f"rollout engine on node {node_address()}: no model directory {model_path}; every node must see "
                "the model (and $STREAMRL_CACHE) at the same path, e.g. on shared storage"
            )
        self.backend: Any
        if isinstance(config, VLLMBackendConfig):
            from streamrl.agents.vllm_backend import VLLMBackend

            self.backend = VLLMBackend(model_path, config=config)
            self.dtype = str(self.backend.dtype)
        else:
            self.backend = HFBackend(model_path, config=config)
            self.dtype = str(self.backend.dtype).removeprefix("torch.")
        self._dirs: deque[str] = deque()  # policy directories written here, newest last

    def describe(self) -> dict[str, Any]:
        """Where it runs and in what precision (once up)."""
        return {"pid": os.getpid(), "node": node_address(), "dtype": self.dtype}

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> list[Generation]:
        if choices is None:
            return list(self.backend.generate(prompts, params, seeds))
        return list(self.backend.generate(prompts, params, seeds, choices=choices))

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        return list(self.backend.score(sequences, prompt_lengths))

    def serve(self, policy: Policy, probe: Sequence[int]) -> tuple[int, list[float]]:
        """Serve ``policy``; return the version now served and the log-probs of ``probe[1:]`` under it."""
        directory = None
        if policy.kind != "base":
            directory = tempfile.mkdtemp(prefix=f"streamrl-engine-v{policy.version}-")
            for name, content in policy.files.items():
                target = Path(directory) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            self._dirs.append(directory)
        if policy.kind == "adapter":
            self.backend.set_adapter(directory, policy.version)
        elif policy.kind == "weights":
            if not isinstance(self.backend, HFBackend):
                raise TypeError("vLLM engines load LoRA adapters only; publish an adapter (finetune='lora')")
            load_weights(self.backend.model, str(directory))
            self.backend.set_adapter(None, policy.version)
        else:
            self.backend.set_adapter(None, policy.version)
        while len(self._dirs) > 2:  # the served one and its predecessor (a vLLM request may still use it)
            shutil.rmtree(self._dirs.popleft(), ignore_errors=True)
        return int(self.backend.adapter_version), self.backend.score([list(probe)], [1])[0]

    def close(self) -> None:
        self.backend.close()
        for directory in self._dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self._dirs.clear()


@functools.cache
def _remote_engine_class() -> Any:
    return require_ray().remote(RolloutEngine)


# ---------------------------------------------------------------------------------------------------------
# The front: a GenerationBackend over the engines


@dataclass
class _Slot:
    index: int
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    load: int = 0
    """Prompts in flight on this engine."""


@dataclass
class _Published:
    policy_ref: Any  # the Policy in the object store
    version: int
    probe: list[int]
    expected: list[float] | None
    """The probe's log-probs under the policy: the probe file's, or the first engine's answer."""
    source: str


class RayEngines:
    """A ``GenerationBackend`` over ``engines`` Ray actors, each a local backend (see the module doc)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        config: EngineConfig | None = None,
        *,
        engines: int = 1,
        actor_options: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        seed: int = 0,
        probe_atol: float | None = None,
        request_timeout_s: float = 900.0,
        start_timeout_s: float = 600.0,
        max_start_failures: int = 3,
    ) -> None:
        """``model``: a registry name or a local Hugging Face directory (at that path on every node).
        ``config``: each engine's ``HFBackendConfig`` (default) or ``VLLMBackendConfig``. ``actor_options``:
        Ray's ``actor.options(**...)`` (resources, scheduling, runtime env), laid over one CPU (module doc).
        ``seed``: draws the request seeds of calls that name none. ``probe_atol``: the publication check's
        mean tolerance (``None``: by the engines' dtype, ``streamrl.agents.probe.probe_atol``)."""
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        for name, value in (("request_timeout_s", request_timeout_s), ("start_timeout_s", start_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if max_start_failures < 1:
            raise ValueError(f"max_start_failures must be >= 1, got {max_start_failures}")
        if probe_atol is not None and not probe_atol > 0:
            raise ValueError(f"probe_atol must be > 0 or None, got {probe_atol}")
        self._ray = require_ray()
        self.model_path = str(resolve_model(model))
        self.config: EngineConfig = config if config is not None else HFBackendConfig()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path)
        options = {**DEFAULT_ACTOR_OPTIONS, **(actor_options or {})}
        if "runtime_env" not in (actor_options or {}):  # a CPU engine computes on the cores it reserves
            threads = str(max(1, int(options["num_cpus"])))
            options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": threads}}
        self.actor_options = {
            **options,
            "max_restarts": 0,  # replacing an engine is ours to do: it must be served the current policy
            "max_task_retries": 0,  # and a lost request is returned marked, never re-run
        }
        self.probe_atol = probe_atol
        self.request_timeout_s = request_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_start_failures = max_start_failures
        self.restarts = 0
        """Engines replaced so far."""
        self._lock = threading.RLock()
        self._seeds = random.Random(seed)
        self._version = 0
        self._published: _Published | None = None
        self._closed = False
        self._slots: list[_Slot] = []
        actors: list[Any] = []
        try:
            for _ in range(engines):
                actors.append(self._spawn())
            infos = self._await_up(actors)
        except BaseException:
            for actor in actors:
                self._kill(actor)
            raise
        self._slots = [_Slot(i, a, info) for i, (a, info) in enumerate(zip(actors, infos, strict=True))]

    def __repr__(self) -> str:
        return f"RayEngines({self.model_path}, engines={len(self._slots)}, version={self._version})"

    # -- queries ------------------------------------------------------------------------------------------
    @property
    def adapter_version(self) -> int:
        """The version every engine confirmed it serves (0 = the model as loaded)."""
        return self._version

    @property
    def actors(self) -> list[Any]:
        """The engines' actor handles, by index (e.g. for ``ray.kill`` in a chaos test)."""
        return [slot.actor for slot in self._slots]

    def engine_info(self) -> list[dict[str, Any]]:
        """Each engine's pid, node, dtype and prompts in flight."""
        return [{**slot.info, "load": slot.load} for slot in self._slots]

    # -- starting and replacing engines --------------------------------------------------------------------
    def _spawn(self) -> Any:
        return _remote_engine_class().options(**self.actor_options).remote(self.model_path, self.config)

    def _await_up(self, actors: Sequence[Any]) -> list[dict[str, Any]]:
        ray = self._ray
        calls = [actor.describe.remote() for actor in actors]
        try:
            return list(ray.get(calls, timeout=self.start_timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise EngineStartError(
                f"rollout engines were not up within start_timeout_s={self.start_timeout_s} s: the cluster may "
                f"lack the resources each asks for ({_resources(self.actor_options)}; see `ray status`)"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise EngineStartError(f"a rollout engine could not start: {_reason(exc)}") from exc

    def _kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):  # already dead, or Ray already shut down
            self._ray.kill(actor, no_restart=True)

    def _replace(self, slot: _Slot, dead: Any, why: str) -> str:
        """Replace ``slot``'s engine ``dead`` (unless another caller already did); returns the error text for
        the requests it held."""
        message = (
            f"rollout engine {slot.index} (pid {slot.info.get('pid')}, node {slot.info.get('node')}) {why}"
        )
        with self._lock:
            if slot.actor is not dead or self._closed:
                return message
            self._kill(dead)
            self.restarts += 1
            for attempt in range(1, self.max_start_failures + 1):
                actor = self._spawn()
                try:
                    (slot.info,) = self._await_up([actor])
                    if self._published is not None:
                        self._serve_one(slot, actor, self._published)
                except (EngineStartError, AdapterMismatchError, self._ray.exceptions.RayError) as exc:
                    self._kill(actor)
                    if attempt == self.max_start_failures:
                        raise EngineStartError(
                            f"rollout engine {slot.index} was replaced after it {why}, but the replacement failed "
                            f"{attempt} times in a row (last: {exc}); giving up"
                        ) from exc
                    continue
                slot.actor = actor
                break
        return f"{message}; replaced"

    # -- generation ---------------------------------------------------------------------------------------
    def _route(self, count: int) -> list[tuple[_Slot, list[int]]]:
        """Prompt indices per engine: each prompt to the engine with the fewest prompts in flight."""
        shares: dict[int, list[int]] = {}
        load = [slot.load for slot in self._slots]
        for i in range(count):
            k = min(range(len(load)), key=lambda j: (load[j], j))
            shares.setdefault(k, []).append(i)
            load[k] += 1
        return [(self._slots[k], rows) for k, rows in sorted(shares.items())]

    def _get(self, slot: _Slot, actor: Any, call: Any) -> tuple[Any, str | None]:
        """``ray.get(call)``, or ``(None, why)`` after replacing the engine when it died or timed out."""
        ray = self._ray
        try:
            return ray.get(call, timeout=self.request_timeout_s), None
        except ray.exceptions.RayActorError as exc:
            return None, self._replace(slot, actor, f"died: {_reason(exc)}")
        except ray.exceptions.GetTimeoutError:
            why = f"ran past request_timeout_s={self.request_timeout_s} s"
            return None, self._replace(slot, actor, why)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> list[Generation]:
        """Complete every prompt on the least loaded engines; lost requests come back marked (module doc).
        ``choices`` constrain prompts as ``GenerationBackend.generate`` says (HF engines only)."""
        self._check_open()
        if not prompts:
            return []
        options = check_choices(len(prompts), choices)
        with self._lock:
            row_seeds = request_seeds(len(prompts), params, self._seeds, seeds)
            calls = []
            for slot, rows in self._route(len(prompts)):
                sub_prompts = [list(prompts[i]) for i in rows]
                sub_seeds = [row_seeds[i] for i in rows]
                if choices is None:
                    call = slot.actor.generate.remote(sub_prompts, params, sub_seeds)
                else:
                    call = slot.actor.generate.remote(
                        sub_prompts, params, sub_seeds, [options[i] for i in rows]
                    )
                slot.load += len(rows)
                calls.append((slot, slot.actor, rows, call))
        out: list[Generation | None] = [None] * len(prompts)
        try:
            for slot, actor, rows, call in calls:
                generations, lost = self._get(slot, actor, call)
                if lost is not None:
                    version = self._version
                    generations = [
                        Generation([], [], "length", adapter_version=version, error=lost) for _ in rows
                    ]
                for i, generation in zip(rows, generations, strict=True):
                    out[i] = generation
        finally:
            with self._lock:
                for slot, _, rows, _ in calls:
                    slot.load -= len(rows)
        assert all(g is not None for g in out)
        return out  # type: ignore[return-value]

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        """Log-probs of ``sequences[i][prompt_lengths[i]:]`` on the least loaded engine (repeated on its
        replacement if it dies)."""
        self._check_open()
        for _ in range(self.max_start_failures + 1):
            with self._lock:
                slot = min(self._slots, key=lambda s: (s.load, s.index))
                actor = slot.actor
                call = actor.score.remote([list(s) for s in sequences], list(prompt_lengths))
                slot.load += len(sequences)
            try:
                result, lost = self._get(slot, actor, call)
            finally:
                with self._lock:
                    slot.load -= len(sequences)
            if lost is None:
                return list(result)
        raise RuntimeError(f"score failed on {self.max_start_failures + 1} engines in a row: {lost}")

    # -- publication ----------------------------------------------------------------------------------------
    def set_adapter(self, path: str | os.PathLike[str] | None, version: int) -> None:
        """Serve the peft adapter at ``path`` (``None``: the model as loaded) as ``version`` on every engine;
        checked on each (module doc)."""
        self._publish(Policy.read("adapter", path, version), path)

    def set_weights(self, path: str | os.PathLike[str], version: int) -> None:
        """Serve the full weights saved at ``path`` (``save_pretrained``) as ``version`` on every engine
        (HF engines); checked on each (module doc)."""
        self._publish(Policy.read("weights", path, version), path)

    def _publish(self, policy: Policy, path: str | os.PathLike[str] | None) -> None:
        self._check_open()
        stored = read_adapter_probe(path) if path is not None else None
        if stored is not None:
            probe, expected, source = stored[0], stored[1], f"{Path(path or '') / PROBE_FILE}"
        else:
            probe, expected, source = probe_token_ids(self._vocab_size()), None, "engine 0's"
        published = _Published(self._ray.put(policy), policy.version, probe, expected, source)
        with self._lock:
            self._published = published  # a replacement started from now on serves this policy
            calls = [
                (slot, slot.actor, slot.actor.serve.remote(published.policy_ref, probe))
                for slot in self._slots
            ]
        for slot, actor, call in calls:
            answer, lost = self._get(slot, actor, call)
            if lost is None:  # (a replacement was checked as it started)
                self._check_served(slot, published, *answer)
        self._version = policy.version

    def _serve_one(self, slot: _Slot, actor: Any, published: _Published) -> None:
        """Serve ``published`` on a (new) engine and check it."""
        answer = self._ray.get(
            actor.serve.remote(published.policy_ref, published.probe), timeout=self.request_timeout_s
        )
        self._check_served(slot, published, *answer)

    def _check_served(self, slot: _Slot, published: _Published, version: int, served: list[float]) -> None:
        if version != published.version:
            raise AdapterMismatchError(
                f"rollout engine {slot.index} serves version {version} after being published version "
                f"{published.version}"
            )
        if published.expected is None:  # no probe file: the engines must agree with the first one
            published.expected = served
            return
        atol = self.probe_atol if self.probe_atol is not None else probe_atol(str(slot.info.get("dtype")))
        mismatch = check_probe(served, published.expected, atol=atol)
        if mismatch is not None:
            raise AdapterMismatchError(
                f"rollout engine {slot.index} (node {slot.info.get('node')}) does not serve the published policy "
                f"v{published.version}: on a {len(published.probe)}-token probe its log-probs differ from "
                f"{published.source} by {mismatch.mean:.4g} nats/token on average (at most {mismatch.worst:.4g}; "
                f"allowed mean {atol:.3g})"
            )

    def _vocab_size(self) -> int:
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        return int(config["vocab_size"])

    # -- lifetime -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RayEngines is closed (close() stopped its engines); create a new RayEngines")

    def close(self) -> None:
        """Stop every engine (their actors are killed); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots:
                self._kill(slot.actor)
            self._published = None

    def __enter__(self) -> RayEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reason(exc: BaseException) -> str:
    """The last meaningful line of a Ray error (why the actor died)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].rstrip(".") if lines else type(exc).__name__


def _resources(options: Mapping[str, Any]) -> str:
    keys = ("num_cpus", "num_gpus", "memory", "resources")
    return ", ".join(f"{k}={options[k]!r}" for k in keys if k in options) or "defaults"
