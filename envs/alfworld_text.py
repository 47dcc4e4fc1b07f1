"""The text of ALFWorld observations that agents read: the task line of the first observation.

ALFWorld's grammar (``alfred.twl2``) ends the first observation with ``Your task is to: <goal>.``; the goal is
one of the templates of ``alfworld.gen.goal_library`` ("put a clean mug in coffeemachine"). This module has no
dependencies, so prompts and scripted agents can read observations without the ALFWorld engine installed
(e.g. when the env runs in another process).
"""

from __future__ import annotations

import re

__all__ = ["TASK_LINE", "task_goal"]

TASK_LINE = re.compile(r"Your task is to:\s*(.+?)\.?\s*$", re.MULTILINE)
"""The task line; group 1 is the goal without the final period."""


def task_goal(observation: str) -> str | None:
    """The goal the observation's task line states (``"put a clean mug in coffeemachine"``, no final
    period), or ``None`` when it has no task line."""
    match = TASK_LINE.search(observation)
    return match.group(1) if match else None
