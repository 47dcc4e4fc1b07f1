"""Scripted ALFWorld agents: two experts and a uniform random agent.

- ``ALFWorldExpertAgent`` replays the game's walkthrough: the shortest win, but omniscient (it walks straight
  to the hidden object), so its moves cannot be inferred from what an agent sees.
- ``ALFWorldSearchAgent`` searches the room in a fixed order and decides every action from the task, the room
  description, the current observation and the admissible commands: slower, but imitable, and it recovers
  from any state (the SFT cold start clones it, ``streamrl.agents.teacher_forcing``).
- ``ALFWorldRandomAgent`` picks among the admissible commands.

All read only what ``streamrl.envs.alfworld.ALFWorldEnv`` puts in ``info`` (``walkthrough``,
``admissible_commands``) and the observations, so they also work through vector envs. They keep no token
records (``end_episode`` returns ``None``): they are baselines and data sources, not policies to train.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamrl.agents.base import EpisodeId
from streamrl.envs.alfworld_text import go_to_frontier, task_goal

__all__ = ["ALFWorldExpertAgent", "ALFWorldRandomAgent", "ALFWorldSearchAgent", "ALFWorldTask"]


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


_TASK_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        # ALFWorld's goal templates (alfworld.gen.goal_library), the state-change ones before the plain one.
        ("heat", r"^put a hot (?P<obj>\S+) in (?P<dest>\S+)$"),
        ("heat", r"^heat some (?P<obj>\S+) and put it in (?P<dest>\S+)$"),
        ("cool", r"^put a cool (?P<obj>\S+) in (?P<dest>\S+)$"),
        ("cool", r"^cool some (?P<obj>\S+) and put it in (?P<dest>\S+)$"),
        ("clean", r"^put a clean (?P<obj>\S+) in (?P<dest>\S+)$"),
        ("clean", r"^clean some (?P<obj>\S+) and put it in (?P<dest>\S+)$"),
        ("two", r"^put two (?P<obj>\S+) in (?P<dest>\S+)$"),
        ("two", r"^find two (?P<obj>\S+) and put them in (?P<dest>\S+)$"),
        ("light", r"^look at (?P<obj>\S+) under the (?P<lamp>\S+)$"),
        ("light", r"^examine the (?P<obj>\S+) with the (?P<lamp>\S+)$"),
        ("place", r"^put (?:a|an|some) (?P<obj>\S+) (?:in|on) (?P<dest>\S+)$"),
    )
)
# The receptacle type that performs each state change (ALFWorld's heat / cool / clean preconditions).
_TOOLS: dict[str, str] = {"heat": "microwave", "cool": "fridge", "clean": "sinkbasin"}
_ROOM_RE = re.compile(r"Looking quickly around you, you see (.+?)\.\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ALFWorldTask:
    """A parsed ALFWorld goal: ``kind`` in ``place``, ``two``, ``heat``, ``cool``, ``clean``, ``light``;
    ``obj`` the target object type; ``dest`` the destination receptacle type (``""`` for ``light``);
    ``lamp`` the lamp type (``light`` only)."""

    kind: str
    obj: str
    dest: str = ""
    lamp: str = ""

    @classmethod
    def parse(cls, text: str) -> ALFWorldTask:
        """Parse a goal sentence such as ``"put a hot apple in fridge"`` (ValueError if no template matches)."""
        goal = text.strip().rstrip(".").strip().lower()
        for kind, pattern in _TASK_PATTERNS:
            match = pattern.match(goal)
            if match:
                return cls(kind, **match.groupdict())
        raise ValueError(
            f"task {text!r} matches none of ALFWorld's goal templates (put a/some X in/on Y, put a "
            "hot/cool/clean X in Y, heat/cool/clean some X and put it in Y, put/find two X ..., "
            "look at X under the LAMP, examine the X with the LAMP)"
        )


def _kind_of(name: str) -> str:
    """``"cabinet 3"`` -> ``"cabinet"``."""
    return name.rsplit(" ", 1)[0]


class ALFWorldSearchAgent:
    """An expert that *searches*: every action is a function of what the agent sees.

    Unlike ``ALFWorldExpertAgent`` (which replays the omniscient walkthrough and walks straight to the
    hidden object), this agent decides from the task sentence and the receptacle list of the first
    observation (both always in an ``LLMAgent``'s context), the current observation and the admissible
    commands -- no hidden state, no memory of past turns -- so a policy that sees the same can imitate it,
    and it recovers from any state another agent left it in (DART-style noise, arXiv:1703.09327). Rules,
    first match wins (``O`` the target object type, ``D`` the destination type, ``T`` the tool of a
    heat/cool/clean task, ``R`` the current receptacle, read from ``examine R`` in the admissible commands;
    the held object is the other ``examine X``):

    1. Holding something that is not an ``O``: put it down here (open ``R`` first if closed).
    2. ``light`` task, holding an ``O``: ``use`` the lamp if it is here, else go to the next receptacle.
    3. Holding an ``O`` that needs heat/cool/clean: process it if ``R`` is a ``T`` (unless the observation
       says it was just processed), else go to ``T 1`` if it was just picked up (the observation says so;
       otherwise it counts as processed).
    4. Holding an ``O``: at ``D 1`` put it (open it first if closed); else go to ``D 1``.
    5. An ``O`` is here (``take`` admissible): take the first -- except at ``D 1`` in place/two tasks, where
       ``O`` is already where it belongs.
    6. ``R`` is closed: open it.
    7. Search on: with ``search="room_order"`` (default), go to the receptacle after ``R`` in the order the
       room description lists them (wrapping; the first one from the middle of the room); with
       ``search="random"``, go to a uniformly random receptacle other than ``R`` (the agent's own seeded
       generator) -- memoryless, so a policy can imitate it without finding ``R`` in the room description;
       with ``search="frontier"``, go to the first receptacle not visited yet, in the order the admissible
       commands list them (``streamrl.envs.alfworld_text.go_to_frontier`` of ``info["visited"]``), which
       ``ALFWorldPrompt(list_go_to="frontier")`` shows the policy: the search step is a copy of its first line.

    Without the walkthrough it wins every generated game (``streamrl.envs.alfworld_gen``) given enough steps;
    kitchens with many closed cabinets take longest (its win counts and step means: docs/sft.md, How it works).
    """

    SEARCHES = ("room_order", "random", "frontier")

    def __init__(self, search: str = "room_order", seed: int | None = None) -> None:
        if search not in self.SEARCHES:
            raise ValueError(f"search must be one of {self.SEARCHES}, got {search!r}")
        self.search = search
        self._rng = random.Random(seed) if search == "random" else None
        self._episodes: dict[EpisodeId, tuple[ALFWorldTask, list[str]]] = {}

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = []
        for obs, info, eid in zip(observations, infos, episode_ids, strict=True):
            if eid not in self._episodes:
                self._episodes[eid] = self._read_first_observation(obs, eid)
            task, receptacles = self._episodes[eid]
            commands = [str(c) for c in info.get("admissible_commands") or []]
            if not commands:
                raise ValueError(f"episode {eid!r}: info has no admissible_commands")
            visited = [str(r) for r in info.get("visited") or []] if self.search == "frontier" else None
            actions.append(self.decide(task, receptacles, obs, commands, rng=self._rng, visited=visited))
        return actions

    @staticmethod
    def _read_first_observation(obs: str, eid: EpisodeId) -> tuple[ALFWorldTask, list[str]]:
        goal, room_match = task_goal(obs), _ROOM_RE.search(obs)
        if goal is None or room_match is None:
            raise ValueError(
                f"episode {eid!r}: the first observation must contain the room description ('Looking "
                f"quickly around you, you see ...') and 'Your task is to: ...'; got {obs[:200]!r}"
            )
        items = re.split(r",\s*(?:and\s+)?|\s+and\s+", room_match.group(1))
        receptacles = [re.sub(r"^(?:a|an)\s+", "", item.strip()) for item in items if item.strip()]
        return ALFWorldTask.parse(goal), receptacles

    @staticmethod
    def decide(
        task: ALFWorldTask,
        receptacles: Sequence[str],
        observation: str,
        commands: Sequence[str],
        rng: random.Random | None = None,
        visited: Sequence[str] | None = None,
    ) -> str:
        """The action for one state (rules in the class doc); ``receptacles`` in room-description order.
        Search steps follow that order, or go to a random other receptacle when ``rng`` is given, or to the
        first of ``go_to_frontier(commands, visited)`` when ``visited`` is given (``info["visited"]``)."""
        admissible = set(commands)
        known = set(receptacles)
        examined = [c[len("examine ") :] for c in commands if c.startswith("examine ")]
        here = next((x for x in examined if x in known), None)
        held = next((x for x in examined if x not in known), None)
        obs = observation.strip()

        def go_next() -> str:
            frontier = go_to_frontier(commands, visited) if visited is not None else []
            if frontier:
                return frontier[0]
            if rng is not None:
                return f"go to {rng.choice([r for r in receptacles if r != here] or list(receptacles))}"
            i = receptacles.index(here) + 1 if here in known else 0
            return f"go to {receptacles[i % len(receptacles)]}"

        def go_or_act(target: str, act: str) -> str:
            # At ``target``: ``act`` (opening it first if needed); elsewhere: walk there.
            if here != target:
                return f"go to {target}"
            if act in admissible:
                return act
            return f"open {here}" if f"open {here}" in admissible else go_next()

        if held is not None and _kind_of(held) != task.obj:  # 1: drop what is not ours
            put = f"move {held} to {here}"
            if put in admissible:
                return put
            return f"open {here}" if f"open {here}" in admissible else go_next()
        if held is not None and task.kind == "light":  # 2
            use = next((c for c in commands if c.startswith(f"use {task.lamp} ")), None)
            return use or go_next()
        if held is not None and task.kind in _TOOLS:  # 3
            verb, tool = task.kind, _TOOLS[task.kind]
            just_done = obs.startswith(f"You {verb} the {held}")
            process = f"{verb} {held} with {here}"
            if process in admissible and not just_done:
                return process
            if obs.startswith(f"You pick up the {held}"):
                return f"go to {tool} 1"
        if held is not None:  # 4
            return go_or_act(f"{task.dest} 1", f"move {held} to {here}")
        placed = here == f"{task.dest} 1" and task.kind in ("place", "two")
        take = next(
            (c for c in commands if c.startswith("take ") and _kind_of(c[5:].split(" from ")[0]) == task.obj),
            None,
        )
        if take is not None and not placed:  # 5
            return take
        if here is not None and f"open {here}" in admissible:  # 6
            return f"open {here}"
        return go_next()  # 7

    def end_episode(self, episode_id: EpisodeId) -> None:
        self._episodes.pop(episode_id, None)
        return None
