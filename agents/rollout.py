"""Play whole episodes of a text env with an agent: one at a time, or a batch of envs in lock-step.

These are the plain loops (demos, tests, expert data, evaluation on one process). Streaming,
many-episode rollouts go through ``streamrl.envs.vector`` and the runtime in ``streamrl.algorithms``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
from streamrl.agents.base import Agent, EpisodeId
from streamrl.agents.trajectory import Trajectory

_episode_counter = itertools.count()


@dataclass
class Turn:
    """One env step: the action sent and what came back."""

    action: str
    observation: str
    reward: float
    action_valid: bool


@dataclass
class EpisodeResult:
    """Outcome of one episode, with the full text transcript and the agent's token record (if any), whose
    outcome fields (reward, won, terminated, truncated, final info, the last turn's reply) are filled. Apart
    from the ``Trajectory``: an agent may keep no record (a scripted one), and the transcript starts with the
    reset observation, which a record does not hold."""

    task_id: str
    initial_observation: str
    turns: list[Turn]
    reward: float
    won: bool
    terminated: bool
    truncated: bool
    final_info: dict[str, Any]
    record: Trajectory | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.turns)

    def transcript(self) -> str:
        """Human-readable transcript: the first observation, then ``> action`` / observation pairs."""
        lines = [self.initial_observation]
        for turn in self.turns:
            lines.append(f"> {turn.action}")
            lines.append(turn.observation)
        return "\n".join(lines)


def play_episode(
    env: gym.Env,
    agent: Agent,
    *,
    seed: int | None = None,
    options: Mapping[str, Any] | None = None,
    episode_id: EpisodeId | None = None,
    max_steps: int = 10_000,
) -> EpisodeResult:
    """Reset ``env`` (with ``seed`` / ``options``, e.g. ``{"task_id": ...}``) and let ``agent`` act until
    the episode terminates or is truncated. ``max_steps`` is a safety net on top of the env's own limit.

    The agent's record (``end_episode``), if it keeps one, comes back complete: its outcome is filled with
    ``Trajectory.set_outcome`` from the episode's return, flags and final info."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    eid: EpisodeId = next(_episode_counter) if episode_id is None else episode_id
    start = time.perf_counter()
    obs, info = env.reset(seed=seed, options=dict(options) if options is not None else None)
    first_obs = obs
    turns: list[Turn] = []
    total, terminated, truncated = 0.0, False, False
    while not (terminated or truncated):
        if len(turns) >= max_steps:
            truncated = True
            info = {**info, "error": f"play_episode stopped after max_steps={max_steps}"}
            break
        (action,) = agent.act([obs], [info], [eid])
        obs, reward, terminated, truncated, info = env.step(action)
        total += float(reward)
        turns.append(Turn(action, obs, float(reward), bool(info.get("action_valid", True))))
    record = agent.end_episode(eid)
    won = bool(info.get("won", False))
    if record is not None:
        record.set_outcome(
            total,
            won,
            terminated,
            truncated,
            info,
            last_observation=obs if turns else None,
            last_action_valid=turns[-1].action_valid if turns else None,
        )
    return EpisodeResult(
        task_id=str(info.get("task_id", "")),
        initial_observation=first_obs,
        turns=turns,
        reward=total,
        won=won,
        terminated=terminated,
        truncated=truncated,
        final_info=dict(info),
        record=record,
        seconds=time.perf_counter() - start,
    )


@dataclass(frozen=True)
class LockstepResult:
    """What ``play_lockstep`` counted: episodes played and won, env steps, steps whose action was valid
    (``info["action_valid"]``, true when the env does not say), and the seconds the play took."""

    episodes: int
    wins: int
    steps: int
    valid_steps: int
    seconds: float

    @property
    def success_rate(self) -> float:
        """Wins per episode (0 when nothing was played)."""
        return self.wins / max(1, self.episodes)


def play_lockstep(agent: Agent, envs: Sequence[gym.Env], task_ids: Sequence[str]) -> LockstepResult:
    """Play ``task_ids`` in order, ``len(envs)`` episodes at a time in lock-step, and count the wins.

    Each round resets one env per task (``options={"task_id": ...}``), then asks ``agent`` for the actions
    of all live episodes in one ``act`` call per turn (one batched generation for an ``LLMAgent``) until every
    episode of the round has ended. Episode ids are the env slots ``0 .. len(envs) - 1``. The envs stay open.
    An agent's record (``end_episode``) comes back complete, as from ``play_episode``. Used by evaluation and
    by SFT model selection, so both count the same way.
    """
    if not envs:
        raise ValueError("play_lockstep needs at least one env")
    wins, steps, valid, started = 0, 0, 0, time.perf_counter()
    for start in range(0, len(task_ids), len(envs)):
        batch = task_ids[start : start + len(envs)]
        live: dict[int, tuple[str, dict[str, Any]]] = {}
        returns: dict[int, float] = {}
        for slot, task_id in enumerate(batch):
            live[slot] = envs[slot].reset(options={"task_id": task_id})
            returns[slot] = 0.0
        while live:
            slots = sorted(live)
            actions = agent.act([live[s][0] for s in slots], [live[s][1] for s in slots], slots)
            for slot, action in zip(slots, actions, strict=True):
                obs, reward, terminated, truncated, info = envs[slot].step(action)
                steps += 1
                returns[slot] += float(reward)
                valid += bool(info.get("action_valid", True))
                if terminated or truncated:
                    won = bool(info.get("won", False))
                    wins += won
                    record = agent.end_episode(slot)
                    if record is not None:
                        record.set_outcome(
                            returns[slot],
                            won,
                            terminated,
                            truncated,
                            info,
                            last_observation=obs,
                            last_action_valid=bool(info.get("action_valid", True)),
                        )
                    del live[slot]
                else:
                    live[slot] = (obs, info)
    return LockstepResult(len(task_ids), wins, steps, valid, time.perf_counter() - started)
