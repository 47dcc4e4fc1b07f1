"""Evaluation: the success rate of an LLM agent on an env's split.

``evaluate`` plays the first tasks of a split with an ``LLMAgent`` built from the env's spec
(``streamrl.agents.env_specs``: prompt format, context policy, generation budget), many episodes at a time
so the backend generates for all of them in one call per turn, and reports the rates as a JSON-ready dict.
The episode loop itself is ``streamrl.agents.rollout.play_lockstep``, which SFT model selection also uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamrl.agents.base import GenerationBackend, SamplingParams
from streamrl.agents.env_specs import env_spec, play_tasks


def evaluate(
    backend: GenerationBackend,
    env_name: str,
    split: str,
    episodes: int,
    sampling: SamplingParams | None = None,
    batch_size: int = 16,
    env_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Success rate of an ``LLMAgent`` on ``backend`` on the first ``episodes`` tasks of ``split``.

    Episodes run ``batch_size`` at a time, each in its own env, so the backend generates for all of them in
    one call per turn. ``sampling`` defaults to temperature 1 with the env's generation budget;
    ``env_kwargs`` go to every env (e.g. ``tasks=`` for a generated task set). Returns ``env``, ``split``,
    ``episodes``, ``success_rate``, ``valid_action_rate`` (valid actions per step), ``mean_steps`` and
    ``seconds``.
    """
    agent = env_spec(env_name).llm_agent(backend, sampling)
    played = play_tasks(agent, env_name, split, episodes, batch_size, env_kwargs)
    return {
        "env": env_name,
        "split": split,
        "episodes": played.episodes,
        "success_rate": played.success_rate,
        "valid_action_rate": played.valid_steps / max(1, played.steps),
        "mean_steps": played.steps / max(1, played.episodes),
        "seconds": round(played.seconds, 1),
    }
