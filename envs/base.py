"""``TextEnv``: the base of streamrl's text environments (``streamrl/MathTIR-v0``, ``streamrl/ALFWorld-v0``,
and yours).

A text env plays named tasks: ``reset`` starts one (``options={"task_id": ...}`` picks it, else it is drawn
uniformly with the env's seeded ``np_random``), each ``step`` takes the agent's text and returns the next
observation. The base class owns what every such env must do the same way, so that agents, vector envs and
trainers can rely on it without duck typing:

* ``task_ids``: the stable ids of the tasks the env can play, in a fixed order;
* ``reset`` validation: unknown option keys and unknown task ids are refused, naming the value and what is
  valid;
* the guards: ``step`` before ``reset``, after the episode ended, or after ``close`` raises a clear error;
* the contract on ``info``: every ``reset`` and ``step`` info holds ``task_id``, ``won`` and ``action_valid``.

A subclass builds its spaces and task list, calls ``super().__init__(task_ids, render_mode=...)``, and
implements two methods: ``_reset_task(task_id) -> (observation, info)`` and ``_step_task(action) ->
(observation, reward, terminated, truncated, info)``. Prompts and action parsing are policy concerns and stay
with the agent (``streamrl.agents.prompts``); an env only says which actions it accepts.

Registering a subclass needs nothing of streamrl: plain ``gymnasium.register(id=..., entry_point=...)`` works
(see ``examples/custom_env.py``). Leave out ``max_episode_steps`` when the env limits its episodes itself, as
streamrl's envs do.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import gymnasium as gym

__all__ = ["REQUIRED_INFO_KEYS", "TextEnv"]

REQUIRED_INFO_KEYS: tuple[str, ...] = ("task_id", "won", "action_valid")
"""Keys every ``info`` of a text env holds: the task being played, whether it is won, and whether the last
action was one the env accepts (``True`` after ``reset``)."""


class TextEnv(gym.Env[str, str]):
    """A Gymnasium env whose observations and actions are text and whose episodes play named tasks.

    Args:
        task_ids: the stable ids of the playable tasks (non-empty, distinct strings), in the order
            ``task_ids`` lists them.
        render_mode: ``None`` or one of ``metadata["render_modes"]``.

    See the module docstring for what a subclass implements.
    """

    metadata = {"render_modes": []}  # noqa: RUF012 (gymnasium declares it as a plain attribute)
    """Declare ``"ansi"`` here when the subclass implements ``render``."""
    reset_options: ClassVar[tuple[str, ...]] = ("task_id",)
    """The keys ``reset(options=...)`` accepts."""

    def __init__(self, task_ids: Sequence[str], *, render_mode: str | None = None) -> None:
        super().__init__()
        modes = list(self.metadata.get("render_modes", []))
        if render_mode is not None and render_mode not in modes:
            raise ValueError(f"render_mode={render_mode!r} is not supported; valid: None or one of {modes}")
        ids = list(task_ids)
        if not ids:
            raise ValueError(f"{type(self).__name__} needs at least one task; got no task ids")
        bad = [t for t in ids if not isinstance(t, str) or not t]
        if bad:
            raise TypeError(f"task ids must be non-empty strings, got {bad[:3]!r}")
        if len(set(ids)) != len(ids):
            repeated = [t for t, count in Counter(ids).items() if count > 1]
            raise ValueError(f"task ids must be distinct; repeated: {repeated[:3]}")
        self.render_mode = render_mode
        self._task_ids: tuple[str, ...] = tuple(ids)
        self._task_set = frozenset(ids)
        self._task_id: str | None = None  # the task of the episode in progress
        self._done = False
        self._closed = False

    # ---- what a subclass implements -------------------------------------------------------------------
    def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
        """Start an episode of ``task_id`` (a valid id): the first observation and info."""
        raise NotImplementedError

    def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play ``action`` in the episode in progress: ``(obs, reward, terminated, truncated, info)``."""
        raise NotImplementedError

    def _describe_tasks(self) -> str:
        """Where the tasks come from, for error messages (e.g. ``"split='test'"``); empty by default."""
        return ""

    # ---- the gym API ------------------------------------------------------------------------------------
    @property
    def task_ids(self) -> list[str]:
        """The stable ids of the tasks this env can play, in a fixed order."""
        return list(self._task_ids)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode: ``options={"task_id": ...}`` picks the task, else one is drawn with ``seed``."""
        super().reset(seed=seed)
        self._check_open()
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.reset_options))
        if unknown:
            raise ValueError(f"unknown reset option(s) {unknown}; valid: {list(self.reset_options)}")
        task_id = options.get("task_id")
        if task_id is None:
            task_id = self._task_ids[int(self.np_random.integers(len(self._task_ids)))]
        elif not isinstance(task_id, str) or task_id not in self._task_set:
            raise ValueError(self._unknown_task_message(task_id))
        self._task_id, self._done = None, False
        obs, info = self._reset_task(task_id)
        self._check_info(info, "_reset_task")
        self._task_id = task_id
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play one action of the episode in progress."""
        self._check_open()
        if self._task_id is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over (terminated or truncated); call reset() to start another")
        obs, reward, terminated, truncated, info = self._step_task(action)
        self._check_info(info, "_step_task")
        self._done = bool(terminated or truncated)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """Mark the env closed (later ``reset`` / ``step`` raise); subclasses release resources, then call
        ``super().close()``. Idempotent."""
        self._closed = True
        super().close()

    # ---- helpers ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; create a new one")

    def _check_info(self, info: dict[str, Any], method: str) -> None:
        missing = [k for k in REQUIRED_INFO_KEYS if k not in info]
        if missing:
            raise KeyError(
                f"{type(self).__name__}.{method} returned an info without {missing}; every text env info "
                f"holds {list(REQUIRED_INFO_KEYS)}"
            )

    def _unknown_task_message(self, task_id: Any) -> str:
        near = difflib.get_close_matches(str(task_id), self._task_ids, n=3) or list(self._task_ids[:3])
        where = self._describe_tasks()
        return (
            f"unknown task_id {task_id!r} for this {type(self).__name__} ({len(self._task_ids)} tasks"
            f"{'; ' + where if where else ''}; e.g. {near}); see env.unwrapped.task_ids"
        )
