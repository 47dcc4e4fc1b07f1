"""Episodes in flight: many env episodes on a ``StreamingVectorEnv``, their turns batched through one agent.

``Rollouts`` is the generator half of the single-stream runtime. Each started *job* (a task id, a seed, and
the dispatcher's ticket) occupies one sub-env until its episode ends. ``poll`` receives whichever sub-envs
are ready, asks the agent for all their actions in one batched generation, sends them, and returns
the episodes that finished -- first-ready, so a long episode never holds up a short one. An episode whose
env worker failed comes back too, its trajectory marked with ``info["error"]``; so does one whose generation
the backend lost (``LLMAgent.lost``: a rollout engine died), with ``info["error_kind"] = "engine"``; its
sub-env is reset for the next job.

Batch window. The backend serves one call at a time, and a call costs about the same for one row as for
many (a batched engine decodes every row in the same steps). An episode whose env step ends just after a
call started waits for that whole call and then for its own, so generating for whatever is ready splits the
episodes into cohorts that take turns at the backend -- each turn then costs up to a whole call more (with
env steps much shorter than a call, about twice as long). So after the first ready result ``poll`` waits for
the env steps still in flight, up to twice the typical env step and never longer than a typical call
(running averages of both), and generates for all of them at once; a slow env step (a long tool call) is
not waited for.

Determinism. A job's env seed and the agent's episode id derive from the job's ``key`` (the ticket's
dispatch index), never from the order in which results arrive. With ``lockstep=True`` ``poll`` waits for
every pending sub-env before generating, so the batches the backend sees are the same from run to run and a
seeded run is reproducible bit for bit (the synchronous trainer, ``max_staleness=0``). Otherwise it takes
what is ready, which is faster and nondeterministic in batch composition only.

The agent is any ``Agent``: an ``LLMAgent`` keeps the token record of each episode itself
(``RolloutAgent``); a scripted one is recorded by the runtime (its turns' actions and the env's replies).

``collect`` plays a fixed list of jobs to the end with no training; ``streamrl.algorithms.session.RolloutSession``
does so on a kept vector env (offline values, held-out evaluation, value pretraining, ``streamrl eval``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from streamrl.agents.base import Agent, EpisodeId, derive_seed
from streamrl.agents.trajectory import Trajectory, TurnRecord
from streamrl.envs.vector import EnvResult, StreamingVectorEnv


@runtime_checkable
class RolloutAgent(Protocol):
    """What ``Rollouts`` asks of its agent beyond ``Agent``'s ``act`` / ``end_episode``: an ``LLMAgent`` keeps a
    ``Trajectory`` per episode and knows its action tokens and lost generations. Any other ``Agent`` (a scripted
    expert) is given these members by ``Rollouts`` itself (``_Recorded``)."""

    def begin_episode(
        self, episode_id: EpisodeId, task_id: str | None = None, ticket: Any = None
    ) -> None: ...

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]: ...

    def end_episode(self, episode_id: EpisodeId) -> Trajectory: ...

    def discard(self, episode_id: EpisodeId) -> None: ...

    def action_tokens(self, episode_id: EpisodeId) -> int: ...

    def lost(self, episode_id: EpisodeId) -> str | None:
        """Why the agent's backend lost the episode's last generation (``LLMAgent.lost``), or ``None``."""
        ...

    @property
    def active_episodes(self) -> list[EpisodeId]: ...


class _Recorded:
    """A plain ``Agent`` (``act`` and ``end_episode`` only, e.g. a scripted expert) as a ``RolloutAgent``: it keeps
    a ``Trajectory`` per episode with each turn's action and the env's reply and verdict (no tokens: it
    generates none)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._pending: dict[EpisodeId, tuple[str | None, Any]] = {}
        self._episodes: dict[EpisodeId, Trajectory] = {}

    def begin_episode(self, episode_id: EpisodeId, task_id: str | None = None, ticket: Any = None) -> None:
        self._pending[episode_id] = (task_id, ticket)

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        for observation, info, eid in zip(observations, infos, episode_ids, strict=True):
            trajectory = self._episodes.get(eid)
            if trajectory is None:
                task_id, ticket = self._pending.pop(eid, (None, None))
                self._episodes[eid] = Trajectory(
                    task_id=str(task_id or info.get("task_id", "")), ticket=ticket
                )
            else:  # the env's reply to the previous action (tool calls: set_outcome files the episode's total)
                trajectory.turns[-1].observation = observation
                if "action_valid" in info:
                    trajectory.turns[-1].action_valid = bool(info["action_valid"])
        actions = self.agent.act(observations, infos, episode_ids)
        for eid, action in zip(episode_ids, actions, strict=True):
            self._episodes[eid].turns.append(TurnRecord(action, action, -1, (0, 0), (0, 0)))
        return actions

    def end_episode(self, episode_id: EpisodeId) -> Trajectory:
        self.agent.end_episode(episode_id)
        return self._episodes.pop(episode_id)

    def discard(self, episode_id: EpisodeId) -> None:
        self._pending.pop(episode_id, None)
        if self._episodes.pop(episode_id, None) is not None:
            self.agent.end_episode(episode_id)

    def action_tokens(self, episode_id: EpisodeId) -> int:
        return 0

    def lost(self, episode_id: EpisodeId) -> str | None:
        return None  # a scripted agent has no generation to lose

    @property
    def active_episodes(self) -> list[EpisodeId]:
        return list(self._episodes)


@dataclass(frozen=True)
class Job:
    """One episode to play: which task, under which key (unique; seeds derive from it), with what ticket (the
    dispatcher's, ``None`` apart from training) and dispatch group. Kept apart from ``Finished``: a job exists
    before its episode does (dispatched, in flight, requeued by a checkpoint)."""

    task_id: str
    key: int
    ticket: Any = None
    group: int | None = None


@dataclass
class Finished:
    """A finished job: the job and its trajectory (outcome filled; the env's seconds in ``timings["env_s"]``).
    Not an ``algorithms.base.Episode``: the episodes of evaluations and offline values have no ticket, and the
    job's key names the episode (its seeds derive from it)."""

    job: Job
    trajectory: Trajectory


@dataclass
class _Running:
    job: Job
    env_id: int
    reward: float = 0.0
    steps: int = 0
    env_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class Rollouts:
    """Jobs in flight on a vector env, acted on by one agent (see module doc)."""

    def __init__(
        self,
        venv: StreamingVectorEnv,
        agent: Agent,
        *,
        seed: int = 0,
        lockstep: bool = False,
    ) -> None:
        self.venv = venv
        self.agent: RolloutAgent = agent if isinstance(agent, RolloutAgent) else _Recorded(agent)
        """The agent as the runtime uses it: an ``LLMAgent`` as given, any other ``Agent`` recorded."""
        self.seed = seed
        self.lockstep = lockstep
        self._running: dict[int, _Running] = {}  # by venv episode id
        self.generation_seconds = 0.0
        """Wall time spent inside the agent's generation calls."""
        self.generated_tokens = 0
        """Action tokens generated so far, finished or not."""
        self._slot_seconds = 0.0
        self._slots_since = time.perf_counter()
        self.batch_window = True
        """Wait briefly for the env steps in flight before generating (module doc); ``False``: generate for
        whatever is ready (an ablation)."""
        self._step_seconds = 0.0  # running averages (batch window, module doc)
        self._call_seconds = 0.0

    # -- queries ------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.venv.num_envs - len(self._running)

    @property
    def running(self) -> list[Job]:
        """Jobs in flight, in start order."""
        return [r.job for r in sorted(self._running.values(), key=lambda r: r.job.key)]

    def occupied_slot_seconds(self) -> float:
        """Sub-env seconds spent holding a running job so far (the integral of ``len(running)`` over time):
        over a window, divided by ``num_envs`` x its length, the rollout slots' utilization."""
        self._count_slots()
        return self._slot_seconds

    def _count_slots(self) -> None:
        """Close the current interval of constant occupancy (called before every change of it)."""
        now = time.perf_counter()
        self._slot_seconds += len(self._running) * (now - self._slots_since)
        self._slots_since = now

    def running_tokens(self) -> int:
        """Action tokens generated so far by jobs still in flight."""
        return self._tokens_of(self._running.values())

    # -- starting -----------------------------------------------------------------------------------------
    def start(self, jobs: Sequence[Job]) -> None:
        """Reset one free sub-env per job with ``options={"task_id": ...}`` and a seed derived from its key."""
        if len(jobs) > self.free_slots:
            raise ValueError(f"{len(jobs)} jobs but only {self.free_slots} free sub-envs")
        busy = {r.env_id for r in self._running.values()}
        free = [i for i in range(self.venv.num_envs) if i not in busy]
        self._count_slots()
        for job, env_id in zip(jobs, free, strict=False):
            (episode_id,) = self.venv.reset_async(
                [env_id],
                seeds=derive_seed(self.seed, "env", job.key),
                options={"task_id": job.task_id},
            )
            self.agent.begin_episode(job.key, task_id=job.task_id, ticket=job.ticket)
            self._running[episode_id] = _Running(job, env_id)

    # -- stepping -----------------------------------------------------------------------------------------
    def poll(
        self, timeout: float | None = None, on_finished: Callable[[list[Finished]], None] | None = None
    ) -> list[Finished]:
        """Receive ready results, act on every episode that awaits an action, send; return finished jobs.

        Blocks until at least one result is ready (all of them with ``lockstep``) or ``timeout`` passes.
        ``on_finished``: called with the jobs that finished before generating for the others (which are then
        not returned), so that the caller can start new jobs in their slots at once -- their resets run in the
        env workers while the backend generates -- instead of after the generation call.
        """
        if self.venv.num_pending == 0:
            return []
        wait_for = self.venv.num_pending if self.lockstep else 1
        results = self.venv.recv(timeout=timeout, min_ready=wait_for)
        window = min(self._call_seconds, 2.0 * self._step_seconds)
        if self.batch_window and results and window > 0 and self.venv.num_pending:
            results += self.venv.recv(timeout=window, min_ready=self.venv.num_pending)
        finished: list[Finished] = []
        to_act: list[tuple[_Running, EnvResult]] = []
        for result in results:
            run = self._running.get(result.episode_id)
            if run is None:  # a result of an episode this runner abandoned
                continue
            run.env_seconds += result.env_seconds
            if not result.is_reset:
                run.steps += 1
                run.reward += float(result.reward)
                if result.error is None:
                    self._step_seconds = _average(self._step_seconds, result.env_seconds)
            if result.done:
                finished.append(self._finish(result, run))
            else:
                to_act.append((run, result))
        if finished and on_finished is not None:
            on_finished(finished)
            finished = []
        if to_act:
            to_act.sort(key=lambda item: item[0].job.key)  # batch order independent of arrival order
            started = time.perf_counter()
            before = self._tokens_of([run for run, _ in to_act])
            actions = self.agent.act(
                [r.obs for _, r in to_act], [r.info for _, r in to_act], [run.job.key for run, _ in to_act]
            )
            seconds = time.perf_counter() - started
            self.generation_seconds += seconds
            self._call_seconds = _average(self._call_seconds, seconds)
            self.generated_tokens += self._tokens_of([run for run, _ in to_act]) - before
            for (run, result), action in zip(to_act, actions, strict=True):
                lost = self.agent.lost(run.job.key)
                if lost is None:
                    self.venv.send([run.env_id], [action])
                else:  # its rollout engine died: the episode ends as failed, as an env worker's would
                    info = {"error": lost, "error_kind": "engine"}
                    failure = replace(result, terminated=False, truncated=True, info=info, error=lost)
                    finished.append(self._finish(failure, run))
        return finished

    def _tokens_of(self, runs: Iterable[_Running]) -> int:
        return sum(self.agent.action_tokens(run.job.key) for run in runs)

    def _finish(self, result: EnvResult, run: _Running) -> Finished:
        self._count_slots()
        del self._running[result.episode_id]
        job = run.job
        if job.key in self.agent.active_episodes:
            trajectory = self.agent.end_episode(job.key)
        else:  # the reset itself failed: the agent never saw the episode
            self.agent.discard(job.key)
            trajectory = Trajectory(task_id=job.task_id, ticket=job.ticket)
        info = dict(result.info)
        if result.error is not None:
            info.setdefault("error", result.error)
        trajectory.set_outcome(
            reward=run.reward,
            won=bool(info.get("won", False)),
            terminated=bool(result.terminated),
            truncated=bool(result.truncated),
            info=info,
            last_observation=str(result.obs),
            last_action_valid=info.get("action_valid"),
        )
        trajectory.timings["env_s"] = run.env_seconds
        trajectory.timings["episode_s"] = time.perf_counter() - run.started
        return Finished(job, trajectory)

    def abandon_all(self) -> list[Job]:
        """Stop every running job (their results are discarded) and return them, for requeueing."""
        jobs = self.running
        for run in self._running.values():
            self.agent.discard(run.job.key)
        self._count_slots()
        self._running.clear()
        while self.venv.num_pending:
            self.venv.recv(timeout=60.0, min_ready=self.venv.num_pending)
        return jobs


def _average(mean: float, value: float, weight: float = 0.2) -> float:
    """Exponential running average (the first value starts it)."""
    return value if mean == 0.0 else (1 - weight) * mean + weight * value


def collect(rollouts: Rollouts, jobs: Sequence[Job], progress: Any = None) -> list[Finished]:
    """Play every job to the end (at most ``free_slots`` at a time); return them in job order."""
    if rollouts.running:
        raise RuntimeError("collect needs an idle Rollouts (jobs are still running)")
    queue = list(jobs)
    done: dict[int, Finished] = {}
    while queue or rollouts.running:
        if queue and rollouts.free_slots:
            n = rollouts.free_slots
            rollouts.start(queue[:n])
            queue = queue[n:]
        for item in rollouts.poll(timeout=None):
            done[item.job.key] = item
            if progress is not None:
                progress(item)
    return [done[job.key] for job in jobs]
