"""The text of ALFWorld observations that agents read: the task line of the first observation, and the
receptacles left to search.

ALFWorld's grammar (``alfred.twl2``) ends the first observation with ``Your task is to: <goal>.``; the goal is
one of the templates of ``alfworld.gen.goal_library`` ("put a clean mug in coffeemachine"). This module has no
dependencies, so prompts and scripted agents can read observations without the ALFWorld engine installed
(e.g. when the env runs in another process).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["TASK_LINE", "go_to_frontier", "task_goal"]

TASK_LINE = re.compile(r"Your task is to:\s*(.+?)\.?\s*$", re.MULTILINE)
"""The task line; group 1 is the goal without the final period."""


def task_goal(observation: str) -> str | None:
    """The goal the observation's task line states (``"put a clean mug in coffeemachine"``, no final
    period), or ``None`` when it has no task line."""
    match = TASK_LINE.search(observation)
    return match.group(1) if match else None


def go_to_frontier(commands: Sequence[str], visited: Sequence[str]) -> list[str]:
    """The ``go to`` commands of a search, next first: those among ``commands`` to receptacles not in
    ``visited`` (``info["visited"]`` of ``ALFWorldEnv``), in the order ``commands`` lists them; once every
    receptacle has been visited, the others again, least recently visited first (the search starts over
    where it began). The current receptacle (the last visited) is never in it.

    The prompt (``ALFWorldPrompt(list_go_to="frontier")``) shows this list and the search expert
    (``ALFWorldSearchAgent(search="frontier")``) takes its first entry, so that expert's search step is a copy
    of a line the policy sees, not a lookup of the current receptacle in the room description."""
    go_to = [str(c) for c in commands if str(c).startswith("go to ")]
    seen = set(visited)
    fresh = [c for c in go_to if c[len("go to ") :] not in seen]
    if fresh:
        return fresh
    listed = set(go_to)
    here = visited[-1] if visited else None
    return [f"go to {r}" for r in visited if r != here and f"go to {r}" in listed]
