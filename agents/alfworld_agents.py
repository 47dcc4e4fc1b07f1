"""Scripted ALFWorld agents: an expert that replays the game's walkthrough and a uniform random agent.

Both read only what ``streamrl.envs.alfworld.ALFWorldEnv`` puts in ``info`` (``walkthrough``,
``admissible_commands``), so they also work through vector envs. They keep no token records
(``end_episode`` returns ``None``): they are baselines and data sources, not policies to train.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.agents.base import EpisodeId

__all__ = ["ALFWorldExpertAgent", "ALFWorldRandomAgent"]


class ALFWorldExpertAgent:
    """Plays ``info["walkthrough"]`` command by command (the generator verified that it wins).

    The walkthrough is read from the episode's first info and followed blindly; it is a plan from the
    reset state, so it is only valid if this agent chose every action of the episode.
    """

    def __init__(self) -> None:
        self._plans: dict[EpisodeId, list[str]] = {}
        self._next: dict[EpisodeId, int] = {}

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = []
        for info, eid in zip(infos, episode_ids, strict=True):
            if eid not in self._plans:
                plan = list(info.get("walkthrough") or [])
                if not plan:
                    raise ValueError(
                        f"episode {eid!r} (task {info.get('task_id')!r}) has no walkthrough; the expert needs "
                        "games with a stored walkthrough or ALFWorldEnv(planner_walkthrough=True)"
                    )
                self._plans[eid], self._next[eid] = plan, 0
            k = self._next[eid]
            if k >= len(self._plans[eid]):
                raise RuntimeError(
                    f"episode {eid!r} (task {info.get('task_id')!r}) is still running after the whole "
                    f"{len(self._plans[eid])}-step walkthrough; was an action taken by someone else?"
                )
            actions.append(self._plans[eid][k])
            self._next[eid] = k + 1
        return actions

    def end_episode(self, episode_id: EpisodeId) -> None:
        self._plans.pop(episode_id, None)
        self._next.pop(episode_id, None)
        return None


class ALFWorldRandomAgent:
    """Picks uniformly among ``info["admissible_commands"]`` with its own seeded generator.

    Args:
        seed: seed of the agent's ``random.Random`` (same seed and same calls -> same actions).
        exclude: commands never picked while another is admissible (e.g. ``("help",)``).
    """

    def __init__(self, seed: int | None = None, exclude: Sequence[str] = ()) -> None:
        self._rng = random.Random(seed)
        self._exclude = frozenset(exclude)

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = []
        for info, eid in zip(infos, episode_ids, strict=True):
            commands = sorted(info.get("admissible_commands") or [])
            if not commands:
                raise ValueError(f"episode {eid!r}: info has no admissible_commands to choose from")
            allowed = [c for c in commands if c not in self._exclude] or commands
            actions.append(self._rng.choice(allowed))
        return actions

    def end_episode(self, episode_id: EpisodeId) -> None:
        return None
