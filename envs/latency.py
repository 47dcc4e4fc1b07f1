"""``streamrl/Latency-v0``: a text env that only takes time -- a simulator for benchmarking the runtime.

What makes single-stream RL worth having is the spread of episode lengths: a synchronous group waits for its
slowest member. This env reproduces that spread and nothing else, so a benchmark of the trainer's scheduler
measures the scheduler, not a game engine:

* every episode lasts a number of turns drawn from a histogram (default :data:`ALFWORLD_TURNS`, the measured
  episode lengths of an ALFWorld agent), independently per episode, deterministically from the task id and the
  reset seed -- so the G rollouts of one task (GRPO's group) differ in length, as real rollouts do;
* each ``step`` sleeps ``step_latency_s`` (and ``reset`` ``reset_latency_s``): the env's own latency; a
  sleeping env releases the GIL and its CPU, like an env waiting on a game engine or a tool process;
* the last step ends the episode with reward 1.0 with the task's success probability (fixed per task id and
  ``task_seed``, uniform in ``success_range``), else 0.0; ``terminated`` is set either way.

Actions are free text; an empty (whitespace) action is invalid (``info["action_valid"] = False``) but still
takes its turn. A ``TextEnv`` (``streamrl.envs.base``): ``info`` carries ``task_id``, ``won``, ``action_valid``,
plus ``turn``.
The agents-side half (a latency generation backend, the prompt format and the env spec for the trainer) is
``streamrl.agents.latency``; ``benchmarks/bench_runtime.py`` uses both.

    import gymnasium as gym
    import streamrl.envs
    env = gym.make("streamrl/Latency-v0", step_latency_s=0.01)
    obs, info = env.reset(seed=3, options={"task_id": "latency/train/0007"})
"""

from __future__ import annotations

import hashlib
import string
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from streamrl.envs.base import TextEnv

__all__ = ["ALFWORLD_TURNS", "SPLITS", "LatencyEnv", "turn_distribution"]

SPLITS: tuple[str, ...] = ("train", "test")

ALFWORLD_TURNS: Mapping[int, int] = {
    3: 1,
    4: 5,
    5: 11,
    6: 26,
    7: 21,
    8: 25,
    9: 17,
    10: 12,
    11: 14,
    12: 14,
    13: 16,
    14: 18,
    15: 18,
    16: 24,
    17: 13,
    18: 14,
    19: 17,
    20: 7,
    21: 13,
    22: 12,
    23: 10,
    24: 6,
    25: 10,
    26: 10,
    27: 10,
    28: 9,
    29: 5,
    30: 5,
    31: 5,
    32: 7,
    33: 5,
    34: 8,
    35: 3,
    36: 7,
    37: 4,
    38: 5,
    39: 5,
    40: 3,
    41: 3,
    42: 4,
    43: 2,
    44: 5,
    46: 6,
    47: 3,
    48: 2,
    49: 2,
    50: 70,
}
"""Histogram ``{turns: episodes}`` of ALFWorld episode lengths: ``ALFWorldSearchAgent(search="random")`` (the
searching expert with a memoryless random search, so each rollout of a game has its own length, as a sampled
policy's would) on the 128 generated training games, four agent seeds, ALFWorld's 50-step limit (episodes
that hit it end at 50). Re-measure with ``python benchmarks/bench_runtime.py --measure-turns``."""


def turn_distribution(turns: Mapping[int, float] | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(values, probabilities)`` of a turn histogram ``{turns: weight}`` or a list of observed turn counts."""
    if isinstance(turns, Mapping):
        items = sorted((int(k), float(v)) for k, v in turns.items())
    else:
        counts: dict[int, float] = {}
        for t in turns:
            counts[int(t)] = counts.get(int(t), 0.0) + 1.0
        items = sorted(counts.items())
    if not items:
        raise ValueError("the turn distribution is empty; give {turns: weight} or a list of turn counts")
    bad = [(k, w) for k, w in items if k < 1 or not w >= 0]
    if bad:
        raise ValueError(f"turn counts must be >= 1 with weights >= 0, got {bad[:3]}")
    values = np.array([k for k, _ in items], dtype=np.int64)
    weights = np.array([w for _, w in items], dtype=np.float64)
    if weights.sum() <= 0:
        raise ValueError("the turn distribution has zero total weight")
    return values, weights / weights.sum()


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts`` (independent of Python's hash salt)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class LatencyEnv(TextEnv):
    """Episodes of random length that take a set time per step (see the module doc).

    Args:
        split: ``"train"`` or ``"test"``; task ids are ``latency/<split>/<i:04d>``.
        num_tasks: tasks in the split.
        turns: the turn distribution, ``{turns: weight}`` or a list of observed turn counts
            (default :data:`ALFWORLD_TURNS`).
        step_latency_s: seconds each ``step`` sleeps.
        reset_latency_s: seconds each ``reset`` sleeps.
        success_range: ``(low, high)``: each task's success probability is uniform in it (per ``task_seed``).
        task_seed: seeds the tasks' success probabilities.
    """

    def __init__(
        self,
        split: str = "train",
        *,
        num_tasks: int = 128,
        turns: Mapping[int, float] | Sequence[int] | None = None,
        step_latency_s: float = 0.0,
        reset_latency_s: float = 0.0,
        success_range: tuple[float, float] = (0.0, 1.0),
        task_seed: int = 0,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        for name, value in (("step_latency_s", step_latency_s), ("reset_latency_s", reset_latency_s)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {value}")
        low, high = success_range
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"success_range must satisfy 0 <= low <= high <= 1, got {success_range}")
        super().__init__([f"latency/{split}/{i:04d}" for i in range(num_tasks)])
        self.split = split
        self.values, self.probabilities = turn_distribution(ALFWORLD_TURNS if turns is None else turns)
        self.step_latency_s, self.reset_latency_s = float(step_latency_s), float(reset_latency_s)
        self.success_range, self.task_seed = (float(low), float(high)), task_seed
        self.observation_space = spaces.Text(1024, min_length=0, charset=string.printable)
        self.action_space = spaces.Text(4096, min_length=0, charset=string.printable)
        self._current = ""
        self._turns = 0
        self._turn = 0
        self._won = False

    def success_probability(self, task_id: str) -> float:
        """The probability that an episode of ``task_id`` ends with reward 1."""
        low, high = self.success_range
        return low + (high - low) * _unit("success", self.task_seed, task_id)

    def _describe_tasks(self) -> str:
        return f"split={self.split!r}"

    def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
        # The episode's draws depend on the task and the reset seed only (np_random was just seeded by it; an
        # unseeded reset goes on with the env's generator), so a seeded run replays the same lengths and
        # outcomes whatever the order in which its episodes run.
        episode_seed = int(self.np_random.integers(2**32))
        rng = np.random.default_rng([int(_unit("episode", task_id) * 2**32), episode_seed])
        self._turns = int(rng.choice(self.values, p=self.probabilities))
        self._won = bool(rng.random() < self.success_probability(task_id))
        self._current, self._turn = task_id, 0
        if self.reset_latency_s:
            time.sleep(self.reset_latency_s)
        return self._observation(done=False), self._info(done=False, action_valid=True)

    def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}: {action!r}")
        if self.step_latency_s:
            time.sleep(self.step_latency_s)
        self._turn += 1
        done = self._turn >= self._turns
        reward = 1.0 if done and self._won else 0.0
        return (
            self._observation(done),
            reward,
            done,
            False,
            self._info(done, action_valid=bool(action.strip())),
        )

    def _observation(self, done: bool) -> str:
        # Short: every observation token costs the learner a forward and a backward pass.
        if done:
            return "Success." if self._won else "Failure."
        return f"Task {self._current}." if self._turn == 0 else f"Turn {self._turn + 1}."

    def _info(self, done: bool, action_valid: bool) -> dict[str, Any]:
        return {
            "task_id": self._current,
            "won": done and self._won,
            "action_valid": action_valid,
            "turn": self._turn,
        }
