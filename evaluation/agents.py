"""The agents an evaluation plays: the spec that names one, and loading it.

An agent is named by a short spec (``AgentSpec.parse``; the forms are in :mod:`streamrl.evaluation.harness`'s
doc): a run's published policy version, a model with an optional policy over it, an env's SFT checkpoint, or
the env's scripted expert. :func:`load_agent` turns a spec into a :class:`LoadedAgent`: a generation backend
(HF transformers or vLLM) serving those weights, or no backend for the expert. ``streamrl eval``
(:func:`streamrl.evaluation.harness.run_evaluation`) loads its agents here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamrl.agents.base import GenerationBackend
from streamrl.algorithms.run_dir import RunDir

__all__ = [
    "AGENT_FORMS",
    "DEFAULT_MODEL",
    "AgentKind",
    "AgentSpec",
    "LoadedAgent",
    "load_agent",
    "policy_version",
    "read_run_config",
    "run_versions",
]

AgentKind = Literal["run", "model", "sft", "expert"]
AGENT_FORMS = "run:DIR[@K|@average], model:NAME[@POLICY_DIR], sft[:NAME][@POLICY_DIR], expert"
DEFAULT_MODEL = "tiny"


@dataclass(frozen=True)
class AgentSpec:
    """An agent to evaluate (module doc): ``AgentSpec.parse("run:runs/x@4")``."""

    kind: AgentKind
    name: str = ""
    """The run directory (``run``), or the model's registry name or directory (``model``, ``sft``)."""
    version: int | None = None
    """``run``: the published version to load; ``None`` = the latest on disk."""
    policy: str | None = None
    """``model`` / ``sft``: a published policy directory (adapter or full weights) over the model; ``run``:
    ``"average"`` for the run's averaged policy (``TrainConfig.average_last``) instead of a version."""

    @classmethod
    def parse(cls, text: str) -> AgentSpec:
        """The spec written as ``text`` (forms: ``AGENT_FORMS``); ``ValueError`` naming them otherwise."""
        text = text.strip()
        kind, _, rest = text.partition(":")
        if text == "expert":
            return cls("expert")
        if text.startswith("sft@"):  # the default model's SFT checkpoint with a policy over it
            if text == "sft@":
                raise ValueError(f"agent {text!r} names no policy directory after '@'; forms: {AGENT_FORMS}")
            return cls("sft", DEFAULT_MODEL, policy=text[len("sft@") :])
        if kind == "sft" and not rest:
            return cls("sft", DEFAULT_MODEL)
        if kind not in ("run", "model", "sft") or not rest:
            raise ValueError(f"unknown agent {text!r}; valid forms: {AGENT_FORMS}")
        name, at, suffix = rest.rpartition("@") if "@" in rest else (rest, "", "")
        if not name:
            raise ValueError(f"agent {text!r} names no {'run directory' if kind == 'run' else 'model'}")
        if kind == "run":
            version = None
            if at and suffix == "average":
                return cls("run", name, policy="average")
            if at and suffix != "latest":
                if not suffix.isdigit():
                    raise ValueError(
                        f"agent {text!r}: version {suffix!r} must be a number K (v K), 'latest' or 'average'"
                    )
                version = int(suffix)
            return cls("run", name, version=version)
        return cls("sft" if kind == "sft" else "model", name, policy=suffix if at else None)

    def __str__(self) -> str:
        if self.kind == "expert":
            return "expert"
        if self.kind == "run":
            at = self.policy if self.policy is not None else self.version
            return f"run:{self.name}" + ("" if at is None else f"@{at}")
        return f"{self.kind}:{self.name}" + ("" if self.policy is None else f"@{self.policy}")


def run_versions(run: str | Path) -> list[int]:
    """The policy versions run ``run`` has on disk (``policy/v<K>``), ascending; 0 (its initial model) first."""
    return [0, *RunDir(run).policy_versions()]


def policy_version(run: str | Path, version: int | None) -> int:
    """``version`` of run ``run`` (``None``: its latest on disk), checked to be on disk: ``ValueError`` naming
    the versions that are otherwise."""
    versions = run_versions(run)
    if version is None:
        return versions[-1]
    if version not in versions:
        raise ValueError(
            f"run {str(run)!r} has no policy version {version} on disk; available: {versions} (0 is the model "
            "it started from; older versions are deleted as the run goes on, keep_versions)"
        )
    return version


def read_run_config(run: str | Path) -> dict[str, Any]:
    """Run ``run``'s ``config.json``; ``FileNotFoundError`` naming the path if it is not a run directory."""
    return RunDir(run).read_config()


@dataclass
class LoadedAgent:
    """An agent ready to play: an LLM backend (``backend``) or a scripted expert (``backend is None``)."""

    spec: AgentSpec
    description: str
    backend: GenerationBackend | None = None

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


def load_agent(
    spec: AgentSpec,
    env: str,
    *,
    device: str = "auto",
    backend: str = "hf",
    log: Callable[[str], None] = print,
) -> LoadedAgent:
    """The backend ``spec`` names for ``env`` (``sft`` resolves the env's SFT checkpoint, a ``run`` its
    starting model and published version; both as ``algorithms.train.initial_model_dir`` does), on the
    ``backend`` engine (``hf`` or ``vllm``)."""
    from streamrl.algorithms.train import initial_model_dir

    if spec.kind == "expert":
        return LoadedAgent(spec, f"the {env} scripted expert")
    if spec.kind == "run":
        config = read_run_config(spec.name)
        model_dir = initial_model_dir(
            str(config["model"]), config["init"], str(config["env"]), log=log, sft=config.get("sft")
        )
        if spec.policy == "average":
            from streamrl.algorithms.averaging import AVERAGE_DIR, AVERAGE_FILE

            policy = RunDir(spec.name).policies / AVERAGE_DIR
            if not (policy / AVERAGE_FILE).is_file():
                raise FileNotFoundError(
                    f"run {spec.name!r} has no averaged policy ({policy}): train it with average_last=K, or write "
                    f"one with `streamrl average --run {spec.name} --last K --out {policy}`"
                )
            versions = json.loads((policy / AVERAGE_FILE).read_text())["versions"]
            what = f"run {spec.name}, the mean of versions {versions[0]}-{versions[-1]} ({config['model']})"
            return LoadedAgent(spec, what, _backend(model_dir, policy, versions[-1], device, backend))
        version = policy_version(spec.name, spec.version)
        policy = None if version == 0 else RunDir(spec.name).policy(version)
        what = f"run {spec.name} at version {version} ({config['model']}, init {config['init']})"
        return LoadedAgent(spec, what, _backend(model_dir, policy, version, device, backend))
    if spec.kind == "sft":
        model_dir = initial_model_dir(spec.name, "sft", env, log=log)
    else:
        model_dir = initial_model_dir(spec.name, "base", env, log=log)
    policy = None
    if spec.policy is not None:
        policy = Path(spec.policy)
        if not policy.is_dir():
            raise FileNotFoundError(f"agent {spec}: policy directory {spec.policy!r} does not exist")
    what = (
        f"{spec.name}"
        + (f"'s SFT checkpoint for {env}" if spec.kind == "sft" else "")
        + (f" with the policy {policy}" if policy is not None else "")
    )
    return LoadedAgent(spec, what, _backend(model_dir, policy, 1, device, backend))


def _backend(
    model_dir: Path, policy: Path | None, version: int, device: str, backend: str = "hf"
) -> GenerationBackend:
    """A backend serving ``model_dir``, or the published ``policy`` over it: a peft adapter is loaded onto
    the model, full fine-tuned weights (what the trainer publishes for small models) replace it. vLLM serves
    adapters only (as the trainer's vLLM engines do): full weights are refused with what to use instead."""
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.models import load_tokenizer

    adapter = policy is not None and (policy / "adapter_config.json").is_file()
    if backend == "vllm":
        from streamrl.agents.vllm_backend import VLLMBackend

        if policy is not None and not adapter:
            raise ValueError(
                f"{policy} holds full fine-tuned weights; the vLLM backend serves a base model or a peft adapter "
                "over it: evaluate it with backend='hf' (--backend hf)"
            )
        engine = VLLMBackend(model_dir)
        if policy is not None:
            engine.set_adapter(str(policy), version)
        return engine
    config = HFBackendConfig(device=device)
    if policy is None:
        return HFBackend(model_dir, config=config)
    if adapter:
        hf = HFBackend(model_dir, config=config)
        hf.set_adapter(str(policy), version)
        return hf
    if not any(policy.glob("*.safetensors")):
        raise FileNotFoundError(f"{policy} holds neither a peft adapter nor model weights (*.safetensors)")
    return HFBackend(policy, tokenizer=load_tokenizer(model_dir), config=config)
