"""streamrl.agents: who acts — the Agent protocol, LLM agents on Hugging Face transformers (embedded
default) or vLLM, prompt formats and parsers, LoRA adapters, the model registry, scripted agents, the env
specs that bind an env to its prompt format and expert, and teacher-forced expert data (the SFT cold
start's data; its training is ``streamrl.sft``).

Names are re-exported lazily, so ``import streamrl.agents`` does not import torch until a model-backed
name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Agent": "base",
    "EpisodeId": "base",
    "Generation": "base",
    "GenerationBackend": "base",
    "SamplingParams": "base",
    "EpisodeResult": "rollout",
    "Turn": "rollout",
    "play_episode": "rollout",
    "HFBackend": "hf_backend",
    "HFBackendConfig": "hf_backend",
    "VLLMBackend": "vllm_backend",
    "VLLMBackendConfig": "vllm_backend",
    "AdapterMismatchError": "vllm_backend",
    "LLMAgent": "llm_agent",
    "ContextPolicy": "llm_agent",
    "ALFWorldPrompt": "prompts",
    "MathTIRPrompt": "prompts",
    "LinePrompt": "prompts",
    "ParsedAction": "prompts",
    "PromptFormat": "prompts",
    "prompt_format": "prompts",
    "LoRAConfig": "lora",
    "wrap_lora": "lora",
    "save_adapter": "lora",
    "reference_logprobs": "lora",
    "resolve_model": "models",
    "load_model": "models",
    "load_tokenizer": "models",
    "Trajectory": "trajectory",
    "TokenSequence": "trajectory",
    "TurnRecord": "trajectory",
    "MathSolverAgent": "math_solver",
    "ALFWorldExpertAgent": "alfworld_agents",
    "ALFWorldRandomAgent": "alfworld_agents",
    "ALFWorldSearchAgent": "alfworld_agents",
    "RandomTextAgent": "random_agent",
    "EnvSpec": "env_specs",
    "ENV_SPECS": "env_specs",
    "register_env_spec": "env_specs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'streamrl.agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"streamrl.agents.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
