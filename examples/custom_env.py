"""Write your own text env and train an LLM agent on it, in three steps.

1. **Subclass** ``streamrl.envs.base.TextEnv``. The base owns what every streamrl env does the same way: the list
   of task ids (``task_ids``), ``reset(options={"task_id": ...})`` with its checks and the seeded draw of a task,
   the guards (no ``step`` before ``reset``, after the episode ended or after ``close``) and the ``info`` keys
   agents rely on (``task_id``, ``won``, ``action_valid``). A new env builds its spaces and task list and
   implements two methods: ``_reset_task(task_id)`` and ``_step_task(action)``.
2. **Register** it with plain ``gymnasium.register`` (nothing of streamrl).
3. **Give it a prompt format** (``streamrl.agents.prompts.PromptFormat``: what the policy is told and how its
   text becomes an action; ``LinePrompt(system)`` is a ready-made one for an env whose action is a line of
   text) and register both under an env name:
   ``register_env_spec("guess_number", EnvSpec(gym_id=..., prompt=GuessPrompt))``. Everything else in
   ``EnvSpec`` has a default: one task set (the env takes no ``split=``; held-out evaluation plays the training
   tasks), the whole episode in one context, 64 new tokens a turn, no expert (so runs start from the model as
   it is: ``init="base"``; ``init="sft"`` needs an expert to clone).

The env here is a guessing game: the task ``guess/007`` hides the number 7, and after each guess the env says
"Higher." or "Lower.". The prompt format's parser calls the env's own ``parse_guess``, so the agent accepts
exactly the actions the env accepts. The registrations run when this file is imported, so that anything that
imports it knows the env. The script checks the env with gymnasium's ``check_env``, lets ``LLMAgent`` on the
tiny model (random weights) play a few games (expect mostly wrong guesses: this shows the plumbing, not a
trained policy), then trains it with SPO++ from Python for a few updates::

    python examples/custom_env.py --episodes 3 --updates 2 --out runs/guess

The same run from the command line: ``--env`` takes ``"module:name"`` or ``"path/file.py:name"``, as
``gymnasium.make`` takes ``"module:EnvName-v0"`` (and ``--algo`` takes ``file.py:Class``): ``streamrl`` imports
the module, whose import registers the env, then trains on it::

    streamrl train --env examples/custom_env.py:guess_number --init base --updates 2 --batch 4 \\
        --num-envs 2 --offline-rollouts 1 --eval-episodes 4 --out runs/guess-cli

(an installed package works the same way: ``--env my_pkg.my_env:guess_number``).
"""

from __future__ import annotations

import argparse
import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import torch
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env
from streamrl.agents.env_specs import EnvSpec, env_spec, register_env_spec
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.prompts import ParsedAction
from streamrl.agents.rollout import play_episode
from streamrl.envs.base import TextEnv

_GUESS = re.compile(r"\s*(\d{1,6})\s*\.?\s*")


def parse_guess(text: str) -> int | None:
    """The env's grammar: a turn is one whole number (surrounding spaces and a final period allowed)."""
    match = _GUESS.fullmatch(text)
    return int(match.group(1)) if match else None


# -- step 1: the env ------------------------------------------------------------------------------------------
class GuessNumberEnv(TextEnv):
    """Guess the hidden number in ``1..high`` within ``max_turns`` guesses; reward 1 for a correct guess.

    Tasks ``guess/001`` .. ``guess/<high>``: task ``guess/007`` hides 7. ``info`` holds ``task_id``,
    ``won``, ``action_valid`` (False for a turn that is not one number: it costs a turn) and ``turn``.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 (gymnasium's plain attribute)

    def __init__(self, high: int = 16, max_turns: int = 6, render_mode: str | None = None) -> None:
        if high < 2:
            raise ValueError(f"high must be >= 2, got {high}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.high, self.max_turns = high, max_turns
        super().__init__([f"guess/{n:03d}" for n in range(1, high + 1)], render_mode=render_mode)
        self.observation_space = spaces.Text(256, charset=string.printable)
        self.action_space = spaces.Text(64, min_length=0, charset=string.printable)
        self._secret = 0
        self._turn = 0
        self._last_obs = ""

    def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
        self._secret, self._turn = int(task_id.removeprefix("guess/")), 0
        self._last_obs = f"I am thinking of a whole number from 1 to {self.high}. Guess it."
        return self._last_obs, {"task_id": task_id, "won": False, "action_valid": True, "turn": 0}

    def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._turn += 1
        guess = parse_guess(action)
        won = guess == self._secret
        if guess is None:
            obs = "Invalid guess: reply with one whole number, e.g. 7."
        else:
            obs = "Correct!" if won else ("Higher." if guess < self._secret else "Lower.")
        truncated = not won and self._turn >= self.max_turns
        self._last_obs = obs
        info = {"task_id": self._task_id, "won": won, "action_valid": guess is not None, "turn": self._turn}
        return obs, float(won), won, truncated, info

    def render(self) -> str | None:  # type: ignore[override]
        return self._last_obs if self.render_mode == "ansi" else None


# -- step 2: register it with gymnasium (no TimeLimit: max_turns is inside) ------------------------------------
gym.register(id="examples/GuessNumber-v0", entry_point=GuessNumberEnv)


# -- step 3: its prompt format, and the env name streamrl trains under ---------------------------------------------
@dataclass(frozen=True)
class GuessPrompt:
    """The agent side of the game (a ``streamrl.agents.prompts.PromptFormat``): every observation becomes one
    user message; the reply's first line, when it is a number the env accepts, is the action."""

    name: str = "guess_number"
    stop_strings: tuple[str, ...] = ("\n",)

    def system_prompt(self, first_observation: str, info: Mapping[str, Any]) -> str:
        return "You play a number guessing game. Reply with one whole number and nothing else."

    def user_message(self, observation: str, info: Mapping[str, Any], turn: int) -> str:
        return observation

    def parse_action(self, text: str, info: Mapping[str, Any]) -> ParsedAction:
        line = text.strip().split("\n", 1)[0]
        if parse_guess(line) is None:
            return ParsedAction(line, False, f"{line!r} is not one whole number")
        return ParsedAction(line, True)


register_env_spec(
    "guess_number",
    EnvSpec(gym_id="examples/GuessNumber-v0", prompt=GuessPrompt, env_kwargs={"max_turns": 4}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=3, help="games the untrained agent plays")
    parser.add_argument("--model", default="tiny", help="model of the LLM agent (registry name or HF dir)")
    parser.add_argument("--updates", type=int, default=2, help="SPO++ updates to train (0: play only)")
    parser.add_argument("--out", default="runs/guess_number", help="the training run's directory")
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = gym.make("examples/GuessNumber-v0", high=16, max_turns=4)
    check_env(env.unwrapped)  # gymnasium's own API checks (spaces, seeding, determinism, close)
    print(f"check_env: ok; {len(env.unwrapped.task_ids)} tasks")  # type: ignore[attr-defined]

    # the agent the trainer builds too: the spec's prompt format, context and turn budget on a backend
    agent = env_spec("guess_number").llm_agent(HFBackend(args.model))
    wins = 0
    for i in range(args.episodes):
        result = play_episode(env, agent, seed=i)  # the task is drawn with the env's seeded generator
        wins += result.won
        if i == 0:
            print(result.transcript())
        print(f"{result.task_id}: {'won' if result.won else 'lost'} in {result.steps} turns")
    print(f"LLMAgent({args.model}): won {wins} of {args.episodes}")
    env.close()
    if not args.updates:
        return

    from streamrl.algorithms.train import TrainConfig, train

    config = TrainConfig(
        out=args.out,
        env="guess_number",
        model=args.model,
        init="base",  # the env has no expert to clone, so no SFT cold start
        updates=args.updates,
        batch=4,
        num_envs=2,
        offline_rollouts=1,  # one episode per task values the tasks before the first update
        eval_episodes=4,  # held out: here the training tasks (the env has one task set)
        seed=0,
    )
    summary = train(config, progress=False)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
