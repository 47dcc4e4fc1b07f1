"""One rollout session: play jobs on one split of an env with a policy, on env workers kept between calls.

Everything that plays whole episodes apart from the training stream goes through ``RolloutSession``: the
trainer's offline prompt values and held-out evaluations (``streamrl.algorithms.train``), value pretraining
(``streamrl.algorithms.value_pretrain``), the evaluation harness (``streamrl.evaluation.harness``) and the
benchmarks; the training stream itself runs its own ``Rollouts`` on the training session's vector env. A session

- resolves its split's task ids once (``task_ids``: the tasks the env's spec trains and evaluates on,
  ``agents.env_specs.task_ids_of``; ``first_tasks(n)`` checks a requested count against them), with the
  breakdown attributes of each task (``task_attributes``);
- builds the streaming vector env of the split on its first ``play`` and keeps it open until ``close``: a
  later ``play`` reuses the live workers (and their tool sandboxes) instead of starting new ones. Every
  episode is reset with the seed its job's key derives, so a kept worker plays a job as a fresh one does;
- plays any ``Agent``: the spec's ``LLMAgent`` on a backend (``llm_agent``), or a scripted one
  (``algorithms.runtime.Rollouts`` keeps the records of an agent that keeps none).

``RolloutFields`` declares, once, the rollout settings every config that plays episodes shares: episodes in flight,
how many tasks, the token budget per turn; ``ActionConstraint`` the action constraint of the configs that train.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from streamrl.agents.base import Agent, GenerationBackend, SamplingParams
from streamrl.agents.env_specs import EnvSpec, env_spec, expert_factory, make_env, task_ids_of
from streamrl.algorithms.runtime import Finished, Job, Rollouts, collect

if TYPE_CHECKING:
    from streamrl.agents.llm_agent import LLMAgent
    from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig


@dataclass(frozen=True)
class RolloutFields:
    """The rollout settings every config that plays episodes shares (``TrainConfig``, ``ValuePretrainConfig``,
    ``EvalConfig``), declared once; each config inherits them, so the names stay flat in Python, config files
    and command-line flags."""

    num_envs: int = 16
    """Episodes in flight at once (sub-envs of the streaming vector env)."""
    tasks: int | None = None
    """Play the first N tasks of the split (training: of the training split; evaluation: of each split);
    ``None`` = all."""
    max_new_tokens: int | None = None
    """Tokens per turn; ``None`` = the env's default (``streamrl eval`` of a run: the run's own)."""
    envs_per_worker: int | None = None
    """Sub-envs one env worker process hosts; ``None`` = the env's default (``EnvSpec.envs_per_worker``: 8 for
    Math-TIR, 1 for ALFWorld). A worker's sub-envs share its start-up and step one at a time; a crash or hang
    of the worker ends all of their episodes, each returned marked. Where they run, not what they play: the
    same jobs give the same episodes at any value."""

    def rollout_errors(self) -> list[str]:
        """What is wrong with these fields (empty when nothing), each message naming the value and what is
        valid; every config raises them as its own error type."""
        errors = []
        if self.num_envs < 1:
            errors.append(f"num_envs must be >= 1, got {self.num_envs}")
        if self.tasks is not None and self.tasks < 1:
            errors.append(f"tasks must be >= 1 (or None: all), got {self.tasks}")
        if self.envs_per_worker is not None and self.envs_per_worker < 1:
            errors.append(
                f"envs_per_worker must be >= 1 (or None: the env's default), got {self.envs_per_worker}"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            errors.append(
                f"max_new_tokens must be >= 1 (or None: the env's default), got {self.max_new_tokens}"
            )
        return errors


@dataclass(frozen=True)
class ActionConstraint:
    """How a policy that trains chooses its actions, declared once for the configs that train on rollouts
    (``TrainConfig``, ``ValuePretrainConfig``). ``EvalConfig`` has its own, three-valued: ``None`` plays a run as
    it was trained."""

    constrain_actions: bool = False
    """Choose among the env's actions (``LLMAgent(constrain_actions=True)``: the prompt format's
    ``action_choices``, ALFWorld's admissible commands); the learner scores the renormalized policy the rollouts
    sample from. HF backend only."""
    avoid_repeats: bool = False
    """With ``constrain_actions``: no command twice from one state (``LLMAgent(avoid_repeats=True)``). Each
    turn's choices leave out the commands the episode already took from the same observation and choices,
    unless none would be left; the learner scores that reduced set, the policy the rollouts sampled from."""

    def constraint_errors(self) -> list[str]:
        """What is wrong with the constraint (empty when nothing)."""
        if self.avoid_repeats and not self.constrain_actions:
            return ["avoid_repeats=True needs constrain_actions=True: it removes choices"]
        return []


EnvWorkers = Literal["subprocess", "inprocess"]
"""Where a local run's env workers live: subprocesses (default) or this process (debugging, tests)."""


def env_hosting(
    env: str, backend: EnvWorkers = "subprocess", envs_per_worker: int | None = None
) -> VectorEnvConfig:
    """How the sub-envs of ``env`` are hosted: ``backend`` workers (``"subprocess"`` or ``"inprocess"``) of
    ``envs_per_worker`` sub-envs each, ``None`` meaning the env's default (``EnvSpec.envs_per_worker``)."""
    from streamrl.envs.vector import VectorEnvConfig

    per = env_spec(env).envs_per_worker if envs_per_worker is None else envs_per_worker
    return VectorEnvConfig(backend=backend, envs_per_worker=per)


def task_attributes(env: Any) -> dict[str, dict[str, str]]:
    """Breakdown attributes of each task: those an env's task records carry, ``source`` and ``family`` (Math-TIR's
    ``MathTask.source`` and ``meta["family"]``), and those its ``task_attributes()`` method names (ALFWorld's
    ``task_type``); an env with neither has none."""
    out: dict[str, dict[str, str]] = {}
    describe = getattr(env.unwrapped, "task_attributes", None)
    if callable(describe):
        for task_id, named in describe().items():
            out[str(task_id)] = {str(k): str(v) for k, v in named.items()}
    for task in getattr(env.unwrapped, "tasks", None) or ():
        attrs: dict[str, str] = {}
        if isinstance(getattr(task, "source", None), str):
            attrs["source"] = task.source
        family = (getattr(task, "meta", None) or {}).get("family")
        if isinstance(family, str):
            attrs["family"] = family
        out.setdefault(str(task.task_id), {}).update(attrs)
    return out


class RolloutSession:
    """Plays jobs on ``split`` of env ``env`` (module doc).

    ``num_envs`` sub-envs, hosted as ``workers`` says (default: ``env_hosting(env)``, subprocesses of the env's
    ``EnvSpec.envs_per_worker`` sub-envs each), each built with the spec's
    env kwargs and then ``env_kwargs``.
    """

    def __init__(
        self,
        env: str,
        split: str,
        *,
        num_envs: int = 16,
        env_kwargs: Mapping[str, Any] | None = None,
        workers: VectorEnvConfig | None = None,
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.env = env
        self.spec: EnvSpec = env_spec(env)  # an unknown env: ValueError naming the valid ones
        self.split = split
        self.num_envs = num_envs
        self.env_kwargs = dict(env_kwargs or {})
        self.workers = workers
        self._venv: StreamingVectorEnv | None = None
        self.closed = False
        self.generation_seconds = 0.0
        """Wall time the agents' generation calls took in this session's plays (``Rollouts.generation_seconds``)."""
        self.generated_tokens = 0
        """Action tokens generated in this session's plays."""

    # -- the split's tasks ------------------------------------------------------------------------------------
    @functools.cached_property
    def _described(self) -> tuple[list[str], dict[str, dict[str, str]]]:
        local = make_env(self.env, self.split, **self.env_kwargs)
        try:
            return task_ids_of(local, self.env), task_attributes(local)
        finally:
            local.close()

    @property
    def task_ids(self) -> list[str]:
        """The split's task ids that the env's spec trains and evaluates on, in split order."""
        return list(self._described[0])

    @property
    def task_attributes(self) -> dict[str, dict[str, str]]:
        """Breakdown attributes per task id (``task_attributes``)."""
        return self._described[1]

    def first_tasks(self, n: int | None) -> list[str]:
        """The first ``n`` task ids (``None``: all); ``ValueError`` naming the valid range when there are fewer."""
        ids = self.task_ids
        if n is None:
            return ids
        if not 1 <= n <= len(ids):
            raise ValueError(f"tasks={n} must be in [1, {len(ids)}] (the {self.env} {self.split} tasks)")
        return ids[:n]

    # -- policies ---------------------------------------------------------------------------------------------
    def llm_agent(
        self,
        backend: GenerationBackend,
        sampling: SamplingParams | None = None,
        *,
        constrain_actions: bool = False,
        avoid_repeats: bool = False,
        tokenizer: Any = None,
    ) -> LLMAgent:
        """The env spec's ``LLMAgent`` on ``backend`` (``EnvSpec.llm_agent``)."""
        return self.spec.llm_agent(
            backend,
            sampling,
            constrain_actions=constrain_actions,
            avoid_repeats=avoid_repeats,
            tokenizer=tokenizer,
        )

    def expert(self) -> Agent:
        """The env's scripted expert (``EnvSpec.expert``), built on an env of the split; ``ValueError`` when the
        env has none."""
        build = expert_factory(self.env)
        local = make_env(self.env, self.split, **self.env_kwargs)
        try:
            return build(local)
        finally:
            local.close()

    # -- playing ----------------------------------------------------------------------------------------------
    def reserve(self, episodes: int) -> None:
        """Before the first ``play``: no play will have more than ``episodes`` jobs, so start at most that many
        sub-envs (fewer workers for a small evaluation). Ignored once the vector env runs."""
        if episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        if self._venv is None:
            self.num_envs = min(self.num_envs, episodes)

    @property
    def venv(self) -> StreamingVectorEnv:
        """The split's vector env, started on first use and kept until ``close``."""
        if self.closed:
            raise RuntimeError(f"the rollout session of {self.env} {self.split} is closed")
        if self._venv is None:
            from streamrl.envs.vector import StreamingVectorEnv

            self._venv = StreamingVectorEnv.from_env(
                self.spec.gym_id,
                self.num_envs,
                config=self.workers or env_hosting(self.env),
                **self.spec.make_kwargs(self.split, **self.env_kwargs),
            )
        return self._venv

    def play(
        self,
        agent: Agent,
        jobs: Sequence[Job],
        *,
        seed: int = 0,
        lockstep: bool = True,
        progress: Callable[[Finished], None] | None = None,
    ) -> list[Finished]:
        """Play every job to the end with ``agent``, ``num_envs`` at a time; the finished jobs in job order.

        Each episode's env seed derives from (``seed``, its job's key), as its sampling seeds do from its key
        and the agent's run seed: the same jobs play the same episodes in any session. ``lockstep`` (default)
        waits for every pending sub-env before generating, so the backend sees the same batches from run to
        run (``Rollouts``); ``progress`` is called with each finished job."""
        if len({job.key for job in jobs}) != len(jobs):
            raise ValueError("every job of a play needs its own key (its seeds derive from it)")
        rollouts = Rollouts(self.venv, agent, seed=seed, lockstep=lockstep)
        try:
            return collect(rollouts, jobs, progress)
        finally:
            self.generation_seconds += rollouts.generation_seconds
            self.generated_tokens += rollouts.generated_tokens

    def close(self) -> None:
        """Stop the session's env workers."""
        if self._venv is not None:
            self._venv.close()
        self._venv = None
        self.closed = True

    def __enter__(self) -> RolloutSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
