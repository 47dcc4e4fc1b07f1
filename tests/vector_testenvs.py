"""Small Text-space envs for the vector-env tests, including the misbehaving ones a user never runs
(an env that hangs, raises, leaks memory or kills its own process).

``ScriptedTextEnv`` is a real, deterministic gym.Env: its observations are a pure function of
(task, seed, actions), so the results that come back through the vector env can be checked exactly
against a direct run. Faults are switched on by constructor arguments and fire at a given step.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import gymnasium as gym
from gymnasium import spaces

_CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 :=-"
TEXT = spaces.Text(max_length=256, charset=_CHARSET)


class ScriptedTextEnv(gym.Env[str, str]):
    """Episode of ``episode_len`` steps on task ``options["task_id"]`` (default: drawn from the seed).

    ``step(action)`` returns ``obs = "<task> t=<t> a=<action>"``, reward ``1.0`` on the final step when the
    action equals ``"win"``, else ``0.0``. Faults: ``latency`` seconds per step; at step ``fault_step``
    of every episode ``fault`` = ``"hang"`` sleeps forever, ``"raise"`` raises ``ValueError``, ``"die"``
    SIGKILLs its own process, ``"leak"`` keeps ``leak_mb`` MiB more each step from then on, ``"gate"``
    waits until the file ``gate_path`` exists (lets a test hold an env back without timing).
    """

    def __init__(
        self,
        episode_len: int = 3,
        latency: float = 0.0,
        fault: str | None = None,
        fault_step: int = 1,
        leak_mb: int = 64,
        gate_path: str | None = None,
    ) -> None:
        self.observation_space = TEXT
        self.action_space = TEXT
        self.episode_len, self.latency = episode_len, latency
        self.fault, self.fault_step, self.leak_mb, self.gate_path = fault, fault_step, leak_mb, gate_path
        self._task = "none"
        self._t = 0
        self._hoard: list[bytearray] = []

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options and "task_id" in options:
            self._task = str(options["task_id"])
        else:
            self._task = f"task{int(self.np_random.integers(1000))}"
        self._t = 0
        return f"{self._task} start", {"task_id": self._task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._t += 1
        if self.latency:
            time.sleep(self.latency)
        if self.fault is not None and self._t >= self.fault_step:
            if self.fault == "hang" and self._t == self.fault_step:
                time.sleep(3600)
            elif self.fault == "raise" and self._t == self.fault_step:
                raise ValueError(f"scripted failure at step {self._t} of {self._task}")
            elif self.fault == "die" and self._t == self.fault_step:
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.fault == "gate" and self._t == self.fault_step:
                while self.gate_path is not None and not os.path.exists(self.gate_path):
                    time.sleep(0.005)
            elif self.fault == "leak":
                self._hoard.append(bytearray(b"\x01") * (self.leak_mb * 2**20))  # touched pages count in RSS
        terminated = self._t >= self.episode_len
        reward = 1.0 if terminated and action == "win" else 0.0
        return (
            f"{self._task} t={self._t} a={action}",
            reward,
            terminated,
            False,
            {"task_id": self._task, "t": self._t},
        )


class PreparedTextEnv(ScriptedTextEnv):
    """A ``ScriptedTextEnv`` with first-use data, as ALFWorld's generated games: ``prepare_data(marker=...)`` writes
    the file ``marker`` (appending the preparing process's pid), and the constructor refuses to build without it.
    ``prepare`` is an instance method that is not the hook: it must never be called."""

    def __init__(self, marker: str, **kwargs: Any) -> None:
        if not os.path.exists(marker):
            raise FileNotFoundError(f"{marker}: prepare_data() has not run")
        super().__init__(**kwargs)

    @staticmethod
    def prepare_data(marker: str, **_: Any) -> None:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")

    def prepare(self) -> None:
        raise AssertionError("an instance method named prepare is not the first-use hook")
