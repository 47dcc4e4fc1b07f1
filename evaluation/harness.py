"""The evaluation harness (``streamrl eval``): what an agent achieves on an env's splits, and how two compare.

An agent is named by a short spec (``AgentSpec.parse``):

==========================  =============================================================================
``run:DIR``, ``run:DIR@K``  the policy run ``DIR`` published as version K (``policy/vK``; default: the latest
                            on disk; ``@0`` is the model the run started from)
``run:DIR@average``         the run's averaged policy (``policy/average``: the mean of its last versions'
                            weights, ``TrainConfig.average_last`` or ``streamrl average``)
``model:NAME[@POLICY]``     a registry model or local Hugging Face directory, optionally with a published
                            policy (a LoRA adapter, or full fine-tuned weights) laid over it
``sft:NAME[@POLICY]``       NAME's SFT checkpoint for the env (what ``streamrl train --init sft`` starts from;
                            built and cached on first use); ``sft`` alone is ``tiny``'s
``expert``                  the env's scripted expert (``EnvSpec.expert``: the Math-TIR solver, the ALFWorld
                            search agent)
==========================  =============================================================================

The episodes. Each split contributes its first ``tasks`` tasks (those the env's spec trains and evaluates
on, ``agents.env_specs.task_ids_of``); each task is played ``samples`` times for each of ``seeds`` at each
sampling temperature (greedy, temperature 0, is played once per seed: its samples would repeat). An episode
is named by (split, task id, seed, sample) and every random choice in it -- the env's reset seed and the
agent's per-turn sampling seeds -- derives from that name alone, so two agents, or two invocations, play the
same episodes: paired comparisons (``paired_difference``) need nothing else.

They run on a ``RolloutSession`` per split (``algorithms.session``, as the trainer's held-out evaluation does),
kept for the whole invocation: its env workers start once and play every agent and temperature. The backend
generates for every episode awaiting an action in one call; a scripted expert plays through the same runtime.

The report (``run_evaluation``, a JSON-ready dict): per agent and temperature, the success rate with its
95 % interval clustered by task (the task is the unit: its samples and seeds are not independent draws) and the
episode-level Wilson interval beside it, mean reward, unbiased pass@k (Chen et al. 2021) averaged over tasks, mean steps, action
tokens and tool calls, the invalid-action rate, and the same per breakdown group -- the split (ALFWorld's seen
vs unseen), ``task_type`` (ALFWorld's six task types, from the env's info), ``source`` and ``family`` (Math-TIR's
task records); each agent's per-episode records; and, with a second agent, the paired differences with their
intervals clustered by task, the episode-level ones beside them.
The summaries and paired differences are ``streamrl.evaluation.summary``; ``format_report``
(``streamrl.evaluation.report``) prints the report as tables; the agent specs and their loading are
``streamrl.evaluation.agents``. Formulas: ``docs/evaluation.md``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from streamrl.agents.base import Agent, GenerationBackend, SamplingParams, derive_seed
from streamrl.agents.env_specs import env_spec, play_tasks
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.runtime import Finished, Job
from streamrl.algorithms.session import EnvWorkers, RolloutFields, RolloutSession, env_hosting
from streamrl.evaluation.agents import (
    AGENT_FORMS,
    DEFAULT_MODEL,
    AgentSpec,
    LoadedAgent,
    load_agent,
    policy_version,
    read_run_config,
    run_versions,
)
from streamrl.evaluation.report import format_report
from streamrl.evaluation.summary import (
    EpisodeRecord,
    Metric,
    breakdown,
    paired_difference,
    paired_difference_by_task,
    paired_differences,
    paired_entry,
    summarize,
)

__all__ = [
    "AGENT_FORMS",
    "DEFAULT_MODEL",
    "AgentSpec",
    "EpisodeRecord",
    "EvalConfig",
    "LoadedAgent",
    "Metric",
    "breakdown",
    "episode_key",
    "eval_session",
    "evaluate",
    "format_report",
    "load_agent",
    "paired_difference",
    "paired_difference_by_task",
    "paired_differences",
    "play_split",
    "policy_version",
    "read_run_config",
    "run_evaluation",
    "run_versions",
    "summarize",
]

# ----------------------------------------------------------------------------------------------------------
# The lock-step success rate SFT reports (kept for ``streamrl sft``)


def evaluate(
    backend: GenerationBackend,
    env_name: str,
    split: str,
    episodes: int,
    sampling: SamplingParams | None = None,
    batch_size: int = 16,
    env_kwargs: Mapping[str, Any] | None = None,
    constrain_actions: bool = False,
    avoid_repeats: bool = False,
) -> dict[str, Any]:
    """Success rate of an ``LLMAgent`` on ``backend`` on the first ``episodes`` tasks of ``split``.

    Episodes run ``batch_size`` at a time, each in its own env, so the backend generates for all of them in
    one call per turn. ``sampling`` defaults to temperature 1 with the env's generation budget;
    ``env_kwargs`` go to every env (e.g. ``tasks=`` for a generated task set). Returns ``env``, ``split``,
    ``episodes``, ``success_rate``, ``valid_action_rate`` (valid actions per step), ``mean_steps`` and
    ``seconds``. ``constrain_actions``: the agent chooses among the env's actions, ``avoid_repeats``: not twice
    one from the same state (``LLMAgent``). (``streamrl sft`` reports this; ``run_evaluation`` is the full
    harness.)
    """
    agent = env_spec(env_name).llm_agent(
        backend, sampling, constrain_actions=constrain_actions, avoid_repeats=avoid_repeats
    )
    played = play_tasks(agent, env_name, split, episodes, batch_size, env_kwargs)
    return {
        "env": env_name,
        "split": split,
        "episodes": played.episodes,
        "success_rate": played.success_rate,
        "valid_action_rate": played.valid_steps / max(1, played.steps),
        "mean_steps": played.steps / max(1, played.episodes),
        "seconds": round(played.seconds, 1),
    }


# ----------------------------------------------------------------------------------------------------------
# Episodes and their records


@dataclass(frozen=True)
class EvalConfig(RolloutFields):
    """``streamrl eval``: evaluate an agent (a run's policy at a version, a model with an optional policy, an
    SFT checkpoint, or the env's scripted expert) on an env's splits, greedy and sampled; optionally against a
    second agent on the same episodes (paired). Prints a table and writes a JSON report."""

    agent: str = ""
    """The agent: run:DIR[@K or @average], model:NAME[@POLICY_DIR], sft[:NAME][@POLICY_DIR] or expert (required)."""
    vs: str | None = None
    """A second agent, played on the same episodes; the report adds the paired differences (agent − vs)."""
    env: str | None = None
    """Env name; ``None``: the run's env (a ``run:`` agent), else math_tir."""
    splits: tuple[str, ...] = ()
    """Splits to play; empty: the env's evaluation splits (Math-TIR: test; ALFWorld: eval_seen eval_unseen)."""
    samples: int = 4
    """Episodes per task and seed at a sampling temperature > 0 (pass@k needs k <= samples x seeds)."""
    seeds: tuple[int, ...] = (0,)
    """Evaluation seeds: each (task, seed, sample) episode's env and sampling seeds derive from them."""
    temperatures: tuple[float, ...] = (0.0, 1.0)
    """Sampling temperatures; 0 is greedy (one episode per task and seed)."""
    pass_k: tuple[int, ...] = ()
    """k of pass@k; empty: 1 and the episodes per task. Values above a mode's episodes per task are skipped."""
    constrain_actions: bool | None = None
    """Let each agent choose only among the env's actions (``LLMAgent(constrain_actions=True)``: ALFWorld's
    admissible commands; HF backend); ``None``: a ``run:`` agent as it was trained, every other unconstrained."""
    avoid_repeats: bool | None = None
    """With constrained actions: no command twice from one state (``LLMAgent(avoid_repeats=True)``); ``None``: a
    ``run:`` agent as it was trained, every other not."""
    env_workers: EnvWorkers = "subprocess"
    """Vector env workers: subprocess (default) or inprocess (debugging, tests)."""
    device: str = "auto"
    """torch device of the model (auto: cuda when available; the HF backend's)."""
    backend: Literal["hf", "vllm"] = "hf"
    """Generation backend: ``hf`` (transformers, default) or ``vllm`` (the ``vllm`` extra; serves a base model
    or a peft adapter over it, not full fine-tuned weights)."""
    threads: int = 1
    """torch threads (more only for a lone process)."""
    out: Path | None = None
    """Write the JSON report (with every episode's record) to this file (a str from Python is taken as a path)."""
    progress: bool = True
    """Show a progress bar (``--no-progress`` for logs)."""
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env over its spec's (Python / config only); ``{}``: a ``run:`` agent's own."""

    def __post_init__(self) -> None:
        if not self.agent:
            raise ValueError(f"agent is required; forms: {AGENT_FORMS}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend must be 'hf' or 'vllm', got {self.backend!r}")
        for name in ("samples", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for error in self.rollout_errors():
            raise ValueError(error)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(
                f"temperatures must be >= 0 (0 = greedy) and at least one, got {self.temperatures}"
            )
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError(f"temperatures must be distinct, got {self.temperatures}")
        if any(k < 1 for k in self.pass_k):
            raise ValueError(f"pass_k values must be >= 1, got {self.pass_k}")
        if self.avoid_repeats and self.constrain_actions is False:
            raise ValueError(
                "avoid_repeats=True needs constrain_actions=True (or None: a run's own): it removes choices"
            )

    def samples_at(self, temperature: float) -> int:
        """Episodes per task and seed at ``temperature`` (greedy: one)."""
        return 1 if temperature == 0 else self.samples


def episode_key(split: str, task_id: str, seed: int, sample: int) -> int:
    """The runtime key of an episode: its env and sampling seeds derive from it, so from its name only."""
    return derive_seed(seed, "eval", split, task_id, sample)


def _record(
    finished: Any, split: str, seed: int, sample: int, temperature: float, attrs: Mapping[str, str]
) -> EpisodeRecord:
    trajectory: Trajectory = finished.trajectory
    groups = {"split": split, **attrs}
    if "task_type" in trajectory.info:
        groups["task_type"] = str(trajectory.info["task_type"])
    error = trajectory.info.get("error")
    return EpisodeRecord(
        split=split,
        task_id=finished.job.task_id,
        seed=seed,
        sample=sample,
        temperature=temperature,
        success=bool(trajectory.won),
        reward=float(trajectory.reward),
        steps=len(trajectory.turns),
        action_tokens=trajectory.num_action_tokens,
        tool_calls=sum(turn.tool_calls for turn in trajectory.turns),
        invalid_actions=sum(1 for turn in trajectory.turns if turn.action_valid is False),
        groups=groups,
        error=None if error is None else str(error),
    )


def play_split(
    loaded: LoadedAgent,
    env: str,
    split: str,
    config: EvalConfig,
    env_kwargs: Mapping[str, Any],
    max_new_tokens: int,
    progress: Callable[[Any], None] | None = None,
    constrain_actions: bool = False,
    avoid_repeats: bool = False,
    session: RolloutSession | None = None,
) -> list[EpisodeRecord]:
    """Play ``loaded`` on ``split`` of ``env``: every (task, seed, sample) episode of every temperature of
    ``config`` (module doc), on one rollout session; the records in plan order. ``constrain_actions``: the LLM
    agent chooses among the env's actions (``EvalConfig.constrain_actions``); ``avoid_repeats``: not twice one
    from the same state (``EvalConfig.avoid_repeats``). ``session``: the split's session to play on (kept by the
    caller for other agents, made by ``eval_session``); ``None``: one for this call."""
    if session is None:
        with eval_session(env, split, config, env_kwargs) as own:
            return play_split(
                loaded,
                env,
                split,
                config,
                env_kwargs,
                max_new_tokens,
                progress,
                constrain_actions=constrain_actions,
                avoid_repeats=avoid_repeats,
                session=own,
            )
    task_ids = session.task_ids[: config.tasks]
    if not task_ids:
        raise ValueError(f"split {split!r} of {env} has no tasks to evaluate")
    expert = session.expert() if loaded.backend is None else None

    # A scripted agent ignores the temperature: it plays the largest plan once and each mode takes its episodes.
    modes = [None] if expert is not None else list(config.temperatures)
    widest = max(config.samples_at(t) for t in config.temperatures)
    played: dict[tuple[float | None, tuple[str, int, int]], Finished] = {}
    for temperature in modes:
        episodes = _plan(config, task_ids, widest if temperature is None else config.samples_at(temperature))
        agent: Agent
        if temperature is None:
            assert expert is not None
            agent = expert
        else:
            sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=0)
            assert loaded.backend is not None
            agent = session.llm_agent(
                loaded.backend, sampling, constrain_actions=constrain_actions, avoid_repeats=avoid_repeats
            )
        jobs = [Job(t, episode_key(split, t, s, k)) for t, s, k in episodes]
        if len({j.key for j in jobs}) != len(jobs):  # 31-bit hashes: a collision is astronomically rare
            raise RuntimeError(f"two episodes of {split} share a runtime key; change the seeds")
        for episode, finished in zip(
            episodes, session.play(agent, jobs, seed=0, progress=progress), strict=True
        ):
            played[(temperature, episode)] = finished
    attrs = session.task_attributes
    records = []
    for temperature in config.temperatures:
        for t, s, k in _plan(config, task_ids, config.samples_at(temperature)):
            finished = played[(None if expert is not None else temperature, (t, s, k))]
            records.append(_record(finished, split, s, k, temperature, attrs.get(t, {})))
    return records


def _plan(config: EvalConfig, task_ids: Sequence[str], samples: int) -> list[tuple[str, int, int]]:
    """The (task, seed, sample) episodes of one mode, in plan order."""
    return [(t, s, k) for s in config.seeds for t in task_ids for k in range(samples)]


def eval_session(env: str, split: str, config: EvalConfig, env_kwargs: Mapping[str, Any]) -> RolloutSession:
    """The rollout session that plays ``split`` for ``config``: as many sub-envs as the widest mode has episodes,
    at most ``config.num_envs``, hosted as ``config.env_workers`` and ``config.envs_per_worker`` say. Kept for every
    agent of an invocation."""
    session = RolloutSession(
        env,
        split,
        num_envs=config.num_envs,
        env_kwargs=env_kwargs,
        workers=env_hosting(env, config.env_workers, config.envs_per_worker),
    )
    widest = max(config.samples_at(t) for t in config.temperatures)
    session.reserve(max(1, len(_plan(config, session.task_ids[: config.tasks], widest))))
    return session


# ----------------------------------------------------------------------------------------------------------
# The whole evaluation


def _resolve_setting(
    config: EvalConfig, specs: Sequence[AgentSpec]
) -> tuple[str, dict[str, Any], int | None]:
    """The env, env kwargs and token budget: the config's, else the ``run:`` agents' (which must agree)."""
    runs = [read_run_config(s.name) for s in specs if s.kind == "run"]
    envs = {str(r["env"]) for r in runs}
    if len(envs) > 1:
        raise ValueError(f"the runs were trained on different envs {sorted(envs)}; pass --env to choose")
    env = config.env or (envs.pop() if envs else "math_tir")
    env_spec(env)  # an unknown env: ValueError naming the valid ones
    for r, s in zip(runs, [s for s in specs if s.kind == "run"], strict=True):
        if r["env"] != env:
            raise ValueError(f"run {s.name!r} was trained on env {r['env']!r}, not {env!r}")
    env_kwargs = dict(config.env_kwargs)
    if not env_kwargs and runs:
        kinds = {json.dumps(r.get("env_kwargs") or {}, sort_keys=True) for r in runs}
        if len(kinds) > 1:
            raise ValueError(
                f"the runs were trained with different env_kwargs {sorted(kinds)}; set env_kwargs"
            )
        env_kwargs = dict(runs[0].get("env_kwargs") or {})
    budgets = {r.get("max_new_tokens") for r in runs}
    if config.max_new_tokens is None and len(budgets) > 1:
        raise ValueError(
            f"the runs were trained with different max_new_tokens {sorted(budgets, key=str)}; set it"
        )
    max_new = config.max_new_tokens or (budgets.pop() if budgets else None)
    return env, env_kwargs, max_new


def _action_mode(config: EvalConfig, agent: AgentSpec) -> tuple[bool, bool]:
    """``(constrain_actions, avoid_repeats)`` of ``agent``: the config's, or where it says ``None`` a ``run:``
    agent's own training setting (every other agent: off)."""
    run = read_run_config(agent.name) if agent.kind == "run" else {}
    constrain = config.constrain_actions
    if constrain is None:
        constrain = bool(run.get("constrain_actions", False))
    avoid = config.avoid_repeats
    if avoid is None:
        avoid = constrain and bool(run.get("avoid_repeats", False))
    if avoid and not constrain:
        raise ValueError(
            f"avoid_repeats=True needs constrained actions, and {agent} plays unconstrained; "
            "pass constrain_actions=True (--constrain-actions)"
        )
    return constrain, avoid


def run_evaluation(config: EvalConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Play ``config.agent`` (and ``config.vs``) on the episodes ``config`` names and report (module doc).

    Returns a JSON-ready dict: ``env``, ``splits``, ``tasks`` (per split), ``config``, ``agents`` (a list: per
    agent its ``label`` (A, B), ``agent`` spec, ``description``, ``results`` (per temperature: ``summary`` and
    ``breakdown``) and ``episodes`` (every ``EpisodeRecord``)), ``paired`` (with ``vs``: per temperature, the
    differences A − B of success and reward) and ``seconds``. Writes it to ``config.out`` when set. Bad input
    (an unknown env, split, run directory or version) raises ``ValueError`` / ``FileNotFoundError`` naming
    the value and what is valid, before anything is played.
    """
    import torch

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.perf_counter()
    specs = [AgentSpec.parse(config.agent)] + ([AgentSpec.parse(config.vs)] if config.vs else [])
    env, env_kwargs, max_new = _resolve_setting(config, specs)
    spec = env_spec(env)
    valid_splits = spec.splits
    splits = config.splits or spec.eval_splits
    unknown = [s for s in splits if s not in valid_splits]
    if unknown:
        raise ValueError(f"unknown split(s) {unknown} of env {env!r}; valid: {list(valid_splits)}")
    for s in specs:  # a missing version fails before any agent plays
        if s.kind == "run":
            policy_version(s.name, s.version)
    max_new_tokens = max_new or spec.max_new_tokens
    pass_k = config.pass_k or (1, config.samples * len(config.seeds))
    torch.set_num_threads(config.threads)

    modes = [_action_mode(config, s) for s in specs]  # a contradiction fails before any agent plays
    agents: list[dict[str, Any]] = []
    task_counts: dict[str, int] = {}
    sessions: dict[str, RolloutSession] = {}
    try:
        for label, agent_spec, (constrain, avoid) in zip("AB", specs, modes, strict=False):
            loaded = load_agent(agent_spec, env, device=config.device, backend=config.backend, log=log)
            log(
                f"eval {label}: {loaded.description} on {env} {list(splits)}"
                + (
                    f" (actions constrained to the env's{', none twice from one state' if avoid else ''})"
                    if constrain
                    else ""
                )
            )
            bar = _progress_bar(config, label, env)
            tick = None if bar is None else (lambda _finished, bar=bar: bar.update(1))
            try:
                records: list[EpisodeRecord] = []
                for split in splits:
                    if split not in sessions:  # kept for the next agent: its workers start once
                        sessions[split] = eval_session(env, split, config, env_kwargs)
                    played = play_split(
                        loaded,
                        env,
                        split,
                        config,
                        env_kwargs,
                        max_new_tokens,
                        tick,
                        constrain_actions=constrain,
                        avoid_repeats=avoid,
                        session=sessions[split],
                    )
                    task_counts[split] = len({r.task_id for r in played})
                    records += played
            finally:
                loaded.close()
                if bar is not None:
                    bar.close()
            results = []
            for temperature in config.temperatures:
                mode = [r for r in records if r.temperature == temperature]
                results.append(
                    {
                        "temperature": temperature,
                        "summary": summarize(mode, pass_k),
                        "breakdown": breakdown(mode, pass_k),
                    }
                )
            agents.append(
                {
                    "label": label,
                    "agent": str(agent_spec),
                    "description": loaded.description,
                    "constrain_actions": constrain,
                    "avoid_repeats": avoid,
                    "results": results,
                    "episodes": [r.to_dict() for r in records],
                }
            )
    finally:
        for session in sessions.values():
            session.close()
    report: dict[str, Any] = {
        "env": env,
        "splits": list(splits),
        "tasks": task_counts,
        "env_kwargs": env_kwargs,
        "max_new_tokens": max_new_tokens,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "agents": agents,
        "paired": [],
    }
    if len(agents) == 2:
        for temperature in config.temperatures:
            a, b = (
                [EpisodeRecord.from_dict(r) for r in x["episodes"] if r["temperature"] == temperature]
                for x in agents
            )
            metrics: tuple[Metric, ...] = ("success", "reward")
            for metric in metrics:
                if len(a) < 2:
                    continue
                report["paired"].append({"temperature": temperature, "metric": metric, "a": "A", "b": "B"})
                report["paired"][-1].update(paired_entry(a, b, metric))
    report["seconds"] = round(time.perf_counter() - started, 1)
    if config.out is not None:  # a str from Python callers, a Path from the CLI
        out = Path(config.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    return report


def _progress_bar(config: EvalConfig, label: str, env: str) -> Any:
    if not config.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc=f"eval {label} {env}", unit="episode", file=sys.stderr)
