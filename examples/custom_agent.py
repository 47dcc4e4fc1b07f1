"""Write your own agent: anything with ``act`` and ``end_episode`` plays every streamrl env.

An agent serves many episodes at once. ``act(observations, infos, episode_ids)`` gets the latest observation
and info of each episode (the reset observation on an episode's first call) and returns one action string per
episode; ``end_episode(episode_id)`` closes one and returns its token record (``None`` for agents without
one). Episode ids are chosen by the caller -- a counter, a vector env's slot -- so keep per-episode state in a
dict keyed by them.

This example is a small hand-written ALFWorld policy ("explore, pick up what the task names, put it where the
task says") next to the trained ``LLMAgent`` on the same tasks, and shows how to plug the LLM agent's prompt
format and backend together. Run it with::

    python examples/custom_agent.py --episodes 8
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import streamrl.envs  # noqa: F401  (registers streamrl/ALFWorld-v0 and streamrl/MathTIR-v0)
import torch
from streamrl.agents.base import Agent, EpisodeId, SamplingParams
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.llm_agent import LLMAgent
from streamrl.agents.prompts import ALFWorldPrompt
from streamrl.agents.rollout import play_episode

_TASK = re.compile(
    r"Your task is to: (?:put|place) (?:a|an|some|two) (?:clean |hot |cool )?(\w+) (?:in|on)\w* (\w+)"
)


class PickAndPlaceAgent:
    """A scripted policy for "put some X in/on Y" tasks, using only the admissible commands.

    Per episode it remembers the target object and receptacle parsed from the first observation; then it
    takes the object when a ``take X ...`` command is admissible, puts it when ``move X ... to Y ...`` is, and
    otherwise visits receptacles it has not seen yet. Other task types get the same exploration (and
    usually fail): a baseline, not an expert.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._state: dict[EpisodeId, dict[str, Any]] = {}

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = []
        for obs, info, eid in zip(observations, infos, episode_ids, strict=True):
            state = self._state.get(eid)
            if state is None:  # first call for this episode: parse the task
                match = _TASK.search(obs)
                state = self._state[eid] = {
                    "object": match.group(1) if match else None,
                    "target": match.group(2) if match else None,
                    "visited": set(),
                    "rng": random.Random(f"{self.seed}-{eid}"),
                }
            commands: list[str] = list(info.get("admissible_commands") or ["look"])
            actions.append(self._choose(state, commands))
        return actions

    def _choose(self, state: dict[str, Any], commands: list[str]) -> str:
        obj, target = state["object"], state["target"]
        for command in commands:
            if obj and target and command.startswith(f"move {obj}") and f" to {target}" in command:
                return command
        for command in commands:
            if obj and command.startswith(f"take {obj} "):
                return command
        holding = any(c.startswith(f"move {obj}") for c in commands) if obj else False
        if holding and target:
            for command in commands:
                if command.startswith(f"go to {target}"):
                    return command
        unvisited = [c for c in commands if c.startswith("go to ") and c not in state["visited"]]
        choice = state["rng"].choice(unvisited or commands)
        state["visited"].add(choice)
        return str(choice)

    def end_episode(self, episode_id: EpisodeId) -> None:
        self._state.pop(episode_id, None)
        return None


def success_rate(env: gym.Env, agent: Agent, task_ids: Sequence[str]) -> float:
    wins = [play_episode(env, agent, options={"task_id": t}).won for t in task_ids]
    return sum(wins) / len(wins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--model", default="tiny", help="model of the LLM agent (registry name or HF dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = gym.make("streamrl/ALFWorld-v0", split="train", max_steps=20)
    task_ids = list(env.unwrapped.task_ids)[: args.episodes]  # type: ignore[attr-defined]

    custom = PickAndPlaceAgent(seed=0)
    assert isinstance(custom, Agent)  # the protocol is structural: no base class needed
    print(f"PickAndPlaceAgent: success {success_rate(env, custom, task_ids):.2f}")

    llm = LLMAgent(
        HFBackend(args.model), prompt_format=ALFWorldPrompt(), sampling=SamplingParams(max_new_tokens=16)
    )
    print(f"LLMAgent({args.model}): success {success_rate(env, llm, task_ids):.2f}")
    env.close()


if __name__ == "__main__":
    main()
