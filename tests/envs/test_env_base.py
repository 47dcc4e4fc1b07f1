"""``TextEnv``: what every streamrl text env does the same way -- task ids, reset options and the seeded draw,
the done / closed guards, the required info keys -- checked on a small env of its own and on gymnasium's
``check_env``."""

from __future__ import annotations

import string
import warnings
from typing import Any

import gymnasium as gym
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env
from streamrl.envs.base import REQUIRED_INFO_KEYS, TextEnv


class EchoEnv(TextEnv):
    """Task ``echo/<word>``: say the word back (two tries)."""

    def __init__(
        self, words: list[str] | None = None, info_keys: tuple[str, ...] = REQUIRED_INFO_KEYS
    ) -> None:
        super().__init__([f"echo/{w}" for w in (["apple", "apricot", "banana"] if words is None else words)])
        self.observation_space = spaces.Text(64, charset=string.printable)
        self.action_space = spaces.Text(64, min_length=0, charset=string.printable)
        self.info_keys = info_keys
        self._tries = 0

    def _info(self, task_id: str | None, won: bool) -> dict[str, Any]:
        info = {"task_id": task_id, "won": won, "action_valid": True}
        return {k: v for k, v in info.items() if k in self.info_keys}

    def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
        self._tries = 0
        return f"Say {task_id.removeprefix('echo/')}", self._info(task_id, False)

    def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        assert self._task_id is not None
        self._tries += 1
        won = action == self._task_id.removeprefix("echo/")
        return (
            ("Yes" if won else "No"),
            float(won),
            won,
            not won and self._tries >= 2,
            self._info(self._task_id, won),
        )


def test_task_ids_reset_and_the_seeded_draw() -> None:
    env = EchoEnv()
    assert env.task_ids == ["echo/apple", "echo/apricot", "echo/banana"]
    env.task_ids.append("echo/x")  # a copy: the env's own list is not changed
    assert len(env.task_ids) == 3
    assert env.reset(options={"task_id": "echo/banana"}) == (
        "Say banana",
        {"task_id": "echo/banana", "won": False, "action_valid": True},
    )
    drawn = [env.reset(seed=s)[1]["task_id"] for s in range(12)]
    assert drawn == [env.reset(seed=s)[1]["task_id"] for s in range(12)] and len(set(drawn)) == 3
    with pytest.raises(ValueError, match=r"unknown task_id \['echo/apple'\]"):
        env.reset(options={"task_id": ["echo/apple"]})
    with pytest.raises(ValueError, match=r"unknown reset option\(s\) \['level'\]; valid: \['task_id'\]"):
        env.reset(options={"level": 2})
    # The nearest ids are named, so a typo is easy to see.
    with pytest.raises(
        ValueError, match=r"unknown task_id 'echo/aple' for this EchoEnv \(3 tasks; e\.g\. \['echo/apple'"
    ):
        env.reset(options={"task_id": "echo/aple"})


def test_guards() -> None:
    env = EchoEnv()
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        env.step("apple")
    env.reset(options={"task_id": "echo/apple"})
    assert env.step("apple")[1:3] == (1.0, True)
    with pytest.raises(
        RuntimeError, match=r"the episode is over \(terminated or truncated\); call reset\(\)"
    ):
        env.step("apple")
    env.reset(options={"task_id": "echo/apple"})
    assert env.step("pear")[2:4] == (False, False) and env.step("pear")[2:4] == (False, True)  # truncated
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("apple")
    with pytest.raises(ValueError, match="unknown task_id"):
        env.reset(options={"task_id": "nope"})
    with pytest.raises(RuntimeError, match="call reset"):  # a failed reset starts no episode
        env.step("apple")
    env.close()
    env.close()  # idempotent
    for call in (env.reset, lambda: env.step("apple")):
        with pytest.raises(RuntimeError, match="this EchoEnv is closed; create a new one"):
            call()


def test_bad_task_lists_render_modes_and_infos_are_explained() -> None:
    with pytest.raises(ValueError, match="needs at least one task"):
        EchoEnv(words=[])
    with pytest.raises(ValueError, match=r"task ids must be distinct; repeated: \['echo/a'\]"):
        EchoEnv(words=["a", "b", "a"])
    with pytest.raises(ValueError, match=r"render_mode='ansi' is not supported; valid: None or one of \[\]"):
        TextEnv(["a"], render_mode="ansi")
    env = EchoEnv(info_keys=("task_id", "won"))
    with pytest.raises(KeyError, match=r"EchoEnv._reset_task returned an info without \['action_valid'\]"):
        env.reset()


def test_a_subclass_registered_with_plain_gym_register_passes_check_env() -> None:
    gym.register(id="test/Echo-v0", entry_point=EchoEnv)
    try:
        env = gym.make("test/Echo-v0")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(env.unwrapped)
        assert env.reset(seed=0)[1]["task_id"] in env.unwrapped.task_ids  # type: ignore[attr-defined]
        env.close()
    finally:
        del gym.registry["test/Echo-v0"]
