"""The trainer's side rollouts: the policy played apart from training, before it (offline prompt values) and
between updates (the held-out evaluation).

``SideRollouts`` holds the two rollout sessions of a training run, kept for the run and closed with the trainer:
the training split's, whose vector env also carries the training rollouts (offline values play on it before
training starts, while it is idle), and the held-out split's, which starts env workers of its own at the first
evaluation (on the training split too: training episodes are in flight then) and reuses them at every later one.
Both play the policy being trained, through the rollouts' backend, with the rollouts' action constraint.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from streamrl.agents.base import GenerationBackend, SamplingParams, derive_seed
from streamrl.algorithms.placement import env_workers
from streamrl.algorithms.run_dir import RunDir
from streamrl.algorithms.runtime import Finished, Job
from streamrl.algorithms.session import RolloutSession
from streamrl.algorithms.train_config import TrainConfig
from streamrl.utils.cache import atomic_write_text
from streamrl.utils.stats import clustered_t_interval, t_interval

if TYPE_CHECKING:
    from streamrl.agents.env_specs import EnvSpec
    from streamrl.agents.llm_agent import LLMAgent

__all__ = ["SideRollouts", "paired_delta"]

Purpose = Literal["train", "eval"]


class SideRollouts:
    """Offline prompt values before training and the held-out evaluation between updates, on kept sessions.

    ``sampling`` is the training rollouts' sampling (its ``max_new_tokens`` is kept, temperature and seed are
    set per use); ``files`` the run directory the evaluation records go to; ``progress``: show a bar of each
    side rollout's episodes (under the run's)."""

    def __init__(
        self,
        config: TrainConfig,
        spec: EnvSpec,
        *,
        backend: GenerationBackend,
        sampling: SamplingParams,
        tokenizer: object,
        files: RunDir,
        progress: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        self.config = config
        self.spec = spec
        self.backend = backend
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.files = files
        self.show_progress = progress
        self.log = log
        self.eval_split = config.eval_split or spec.eval_splits[0]
        self._sessions: dict[str, RolloutSession] = {}
        self._eval_tasks: list[str] | None = None

    def session(self, purpose: Purpose) -> RolloutSession:
        """The rollout session of the training split (``"train"``) or of the held-out split (``"eval"``),
        made at its first use and kept until ``close``."""
        if purpose not in self._sessions:
            c = self.config
            split = self.spec.train_split if purpose == "train" else self.eval_split
            self._sessions[purpose] = RolloutSession(
                c.env, split, num_envs=c.num_envs, env_kwargs=c.env_kwargs, workers=env_workers(c)
            )
        return self._sessions[purpose]

    def close(self) -> None:
        """Close the sessions' env workers (the training ones too)."""
        for session in self._sessions.values():
            session.close()

    @property
    def eval_tasks(self) -> list[str]:
        """The fixed held-out episodes, by task, of the evaluations at the start and the end
        (``final_eval_episodes``, or ``eval_episodes``); the evaluations in between play its first
        ``eval_episodes`` (``curve_episodes``). Those are every task of the split equally often (each
        ``n // tasks`` times), the remainder drawn uniformly without replacement; the rest extend them a task
        played least so far at a time (ties in a seeded order), so the final episodes are as even over the tasks
        as their number allows. The same list for every run with the same seed; empty when the run does not
        evaluate."""
        if self._eval_tasks is None:
            c = self.config
            if not c.eval_episodes or not c.eval_every:
                self._eval_tasks = []
            else:
                ids = self.session("eval").task_ids
                n = c.eval_episodes
                rng = random.Random(derive_seed(c.seed, "eval-tasks"))
                curve = ids * (n // len(ids)) + rng.sample(ids, n % len(ids))
                final = c.final_eval_episodes or n
                order = random.Random(derive_seed(c.seed, "final-eval-tasks")).sample(ids, len(ids))
                self._eval_tasks = extend_evenly(curve, order, final)
        return self._eval_tasks

    @property
    def curve_episodes(self) -> int:
        """How many of ``eval_tasks`` the evaluations between the start and the end play (their first)."""
        return min(self.config.eval_episodes, len(self.eval_tasks))

    def agent(self, temperature: float, seed: int) -> LLMAgent:
        """The policy being trained, sampling at ``temperature`` with run seed ``seed``, apart from training:
        the rollouts' agent with its action constraint."""
        return self.spec.llm_agent(
            self.backend,
            replace(self.sampling, temperature=temperature, seed=seed),
            constrain_actions=self.config.constrain_actions,
            avoid_repeats=self.config.avoid_repeats,
            tokenizer=self.tokenizer,
        )

    def play(
        self, purpose: Purpose, jobs: Sequence[Job], temperature: float, seed: int, desc: str
    ) -> list[Finished]:
        """Play ``jobs`` on the ``purpose`` session with the current policy (lock-step, env and sampling seeds
        from ``seed``), with a progress bar of its episodes when progress is shown."""
        session, agent = self.session(purpose), self.agent(temperature, seed)
        if not self.show_progress:
            return session.play(agent, jobs, seed=seed)
        from tqdm.auto import tqdm

        with tqdm(total=len(jobs), desc=desc, unit="episode", position=1, leave=False) as bar:
            return session.play(agent, jobs, seed=seed, progress=lambda _: bar.update(1))

    # -- offline values ----------------------------------------------------------------------------------------
    def offline_values(self, model_dir: Path, task_ids: Sequence[str]) -> dict[str, list[float]]:
        """The rewards of ``config.offline_rollouts`` episodes of each task in ``task_ids`` by the starting
        policy (``model_dir``), for the tracker's initial values; cached on disk under a key of everything they
        depend on, and seeded apart from the run seed so that every seed shares them."""
        n0 = self.config.offline_rollouts
        cache = self.offline_cache_path(model_dir, task_ids)
        if cache.is_file():
            outcomes: dict[str, list[float]] = json.loads(cache.read_text())
            self.log(f"offline values: {cache} (cached)")
        else:
            jobs = [Job(t, i * n0 + k) for i, t in enumerate(task_ids) for k in range(n0)]
            done = self.play("train", jobs, self.config.temperature, derive_seed("offline"), "offline values")
            outcomes = {t: [] for t in task_ids}
            for item in done:
                outcomes[item.job.task_id].append(float(item.trajectory.reward))
            atomic_write_text(cache, json.dumps(outcomes))  # the cache is shared by concurrent runs
            self.log(f"offline values: {n0} rollouts x {len(task_ids)} tasks -> {cache}")
        return {t: outcomes[t] for t in task_ids}

    def offline_cache_path(self, model_dir: Path, task_ids: Sequence[str]) -> Path:
        """Where the offline values of this starting model, env, task set and sampling are cached."""
        from streamrl.agents.models import weights_fingerprint
        from streamrl.utils.cache import cache_root

        c = self.config
        key = json.dumps(
            [
                weights_fingerprint(model_dir),
                c.env,
                self.spec.train_split,
                list(task_ids),
                c.offline_rollouts,
                c.temperature,
                self.sampling.max_new_tokens,
                sorted(c.env_kwargs.items()),
                # a constrained policy plays other episodes (unconstrained runs keep their earlier keys)
                *([[c.constrain_actions, c.avoid_repeats]] if c.constrain_actions else []),
            ],
        )
        name = hashlib.sha256(key.encode()).hexdigest()[:20]
        # an env named by its module ("examples/custom_env.py:guess_number") is one file name, not a folder
        env = re.sub(r"[^A-Za-z0-9_.-]+", "_", c.env)
        return cache_root() / "offline_values" / f"{model_dir.name}-{env}-{name}.json"

    # -- held-out evaluation -----------------------------------------------------------------------------------
    def evaluate(self, update: int, version: int, *, final: bool = False) -> dict[str, float]:
        """Success on the fixed held-out episodes with the policy of ``version`` after ``update`` updates: all of
        ``eval_tasks`` at the start (update 0) and when ``final``, the curve's first ``curve_episodes`` between.
        Writes the episodes' records to the run directory and returns the ``eval/*`` metrics over the curve's
        episodes, with the paired difference to the start's evaluation of the same episodes after the first
        update; with final episodes beyond the curve's, the start and the end add ``eval_full/*`` over all."""
        started = time.perf_counter()
        full = update == 0 or final
        tasks = self.eval_tasks if full else self.eval_tasks[: self.curve_episodes]
        # the same episode seeds at every version and in every run with this seed: paired comparisons
        jobs = [Job(t, i) for i, t in enumerate(tasks)]
        seed, desc = derive_seed(self.config.seed, "eval"), f"held-out eval (update {update})"
        done = self.play("eval", jobs, self.config.eval_temperature, seed, desc)
        records = [
            {
                "key": item.job.key,
                "task_id": item.job.task_id,
                "won": bool(item.trajectory.won),
                "reward": float(item.trajectory.reward),
                "steps": len(item.trajectory.turns),
                "action_tokens": item.trajectory.num_action_tokens,
            }
            for item in sorted(done, key=lambda item: item.job.key)
        ]
        self.files.write_eval(update, records)
        start = self.files.read_eval(0) if update else None
        curve = [r for r in records if r["key"] < self.curve_episodes]
        row = {**_success("eval", curve, start), "eval/version": float(version)}
        if full and len(self.eval_tasks) > self.curve_episodes:
            row.update(_success("eval_full", records, start))
        row["eval/seconds"] = time.perf_counter() - started
        return row


def extend_evenly(first: Sequence[str], order: Sequence[str], n: int) -> list[str]:
    """``first`` extended to ``n`` tasks: each added task is one of ``order`` played least so far, the earliest in
    ``order`` among equals (``first`` itself when ``n <= len(first)``)."""
    out, counts = list(first), Counter(first)
    while len(out) < n:
        fewest = min(counts[t] for t in order)
        for t in order:
            if counts[t] == fewest and len(out) < n:
                out.append(t)
                counts[t] += 1
    return out


def _success(
    prefix: str, records: Sequence[dict[str, Any]], start: Sequence[dict[str, Any]] | None
) -> dict[str, float]:
    """``{prefix}/success``, its binomial standard error, mean reward, episodes and tasks of ``records``, and,
    given the start's evaluation, the paired difference to its records of the same keys (``paired_delta``)."""
    wins = [float(r["won"]) for r in records]
    p = sum(wins) / len(wins)
    row = {
        f"{prefix}/success": p,
        f"{prefix}/stderr": math.sqrt(p * (1 - p) / len(wins)),
        f"{prefix}/reward": sum(r["reward"] for r in records) / len(records),
        f"{prefix}/episodes": float(len(records)),
        f"{prefix}/tasks": float(len({r["task_id"] for r in records})),
    }
    if start is not None:
        # paired with the start's evaluation: the same tasks and episode seeds, so the per-episode
        # differences cancel most of the sampling noise
        before = {r["key"]: r for r in start}
        if all(r["key"] in before for r in records):
            diffs = [float(r["won"]) - float(before[r["key"]]["won"]) for r in records]
            delta = paired_delta(diffs, [r["task_id"] for r in records])
            row.update({k.replace("eval/", f"{prefix}/"): v for k, v in delta.items()})
    return row


def paired_delta(diffs: Sequence[float], tasks: Sequence[str]) -> dict[str, float]:
    """``eval/delta``, the mean paired difference to the start's evaluation (``tasks[i]`` the task of
    ``diffs[i]``), and the half-widths of its 95 % intervals: ``eval/delta_ci95`` clustered by task (the unit: a
    task's repeated episodes are not independent; ``nan`` with a single task) and ``eval/delta_ci95_episode``, the
    paired t interval over episodes as if independent (``nan`` with a single episode)."""
    mean = sum(diffs) / len(diffs)
    clustered = clustered_t_interval(diffs, tasks) if len(set(tasks)) > 1 else None
    episode = t_interval(diffs) if len(diffs) > 1 else None
    return {
        "eval/delta": mean,
        "eval/delta_ci95": math.nan if clustered is None else clustered.half_width,
        "eval/delta_ci95_episode": math.nan if episode is None else episode.half_width,
    }
