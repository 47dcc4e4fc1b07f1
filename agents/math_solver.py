"""A scripted Math-TIR expert: it runs each task's reference program through the env's real sandbox, reads
the ```output block that comes back, and answers with what the program printed in ``\\boxed{}``.

It is the Math-TIR counterpart of ALFWorld's handcoded expert: demos, smoke tests of the full tool path
(parsing, sandbox, output fences, answer checking) and a ceiling for the reward pipeline. It never looks at
the ground-truth answer; a wrong or failing program gives a wrong answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from streamrl.agents.base import EpisodeId
from streamrl.envs.math_tasks import MathTask

__all__ = ["MathSolverAgent", "read_tool_output"]

_OUTPUT_BLOCK = re.compile(r"```output\n(.*?)\n?```", re.DOTALL)


def read_tool_output(observation: str) -> str | None:
    """The content of the last ```output block of an observation (``None`` if there is none)."""
    blocks = _OUTPUT_BLOCK.findall(observation)
    return blocks[-1] if blocks else None


class MathSolverAgent:
    """Writes the task's reference solution as a ```python block, then boxes the last printed line.

    Args:
        tasks: the task records (an env's ``env.unwrapped.tasks``, or any :class:`MathTask` iterable or
            ``{task_id: MathTask}`` mapping); episodes are matched by ``info["task_id"]``.
        retries: how many more times to run the program when a call fails (e.g. a timeout on a loaded
            machine) before answering with what it has.
    """

    def __init__(self, tasks: Iterable[MathTask] | Mapping[str, MathTask], retries: int = 1) -> None:
        records: Iterable[MathTask] = tasks.values() if isinstance(tasks, Mapping) else tasks
        self.tasks: dict[str, MathTask] = {t.task_id: t for t in records}
        if not self.tasks:
            raise ValueError("MathSolverAgent needs at least one task")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.retries = retries
        self._attempts: dict[EpisodeId, int] = {}

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        return [
            self._act_one(obs, info, eid)
            for obs, info, eid in zip(observations, infos, episode_ids, strict=True)
        ]

    def _act_one(self, observation: str, info: Mapping[str, Any], episode_id: EpisodeId) -> str:
        task_id = info.get("task_id")
        if task_id not in self.tasks:
            raise KeyError(f"MathSolverAgent has no task {task_id!r}; build it with the env's tasks")
        task = self.tasks[str(task_id)]
        attempts = self._attempts.get(episode_id, 0)
        output = read_tool_output(observation) if attempts else None
        failed = info.get("tool_status", "ok") != "ok"
        if attempts == 0 or (failed and attempts <= self.retries):
            self._attempts[episode_id] = attempts + 1
            lead = (
                "Let me compute it with Python." if attempts == 0 else "That call failed; running it again."
            )
            return f"{lead}\n```python\n{task.solution.rstrip()}\n```"
        lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
        value = lines[-1] if lines and not failed else "no result"
        return f"The program printed {value}, so the answer is \\boxed{{{value}}}."

    def end_episode(self, episode_id: EpisodeId) -> None:
        self._attempts.pop(episode_id, None)
        return None
