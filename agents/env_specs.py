"""Env specs: which gym env, splits, prompt format, context policy and expert belong to an env name.

An ``LLMAgent`` plays an env well only through the prompt format and context policy it was trained with, and
the SFT cold start clones an expert through exactly that rendering. ``EnvSpec`` binds them together per env
name (``ENV_SPECS``; ``register_env_spec`` adds your own), so teacher forcing
(``streamrl.agents.teacher_forcing``), SFT training (``streamrl.sft``), evaluation
(``streamrl.evaluation.harness``) and the trainer build the same env, agent and task list from one name.
``play_tasks`` is the one loop that plays a spec's tasks with an LLM agent.

Your own env trains in three steps: subclass ``streamrl.envs.base.TextEnv``, register it with
``gymnasium.register``, and give it a prompt format::

    gym.register(id="examples/GuessNumber-v0", entry_point=GuessNumberEnv)
    register_env_spec("guess_number", EnvSpec(gym_id="examples/GuessNumber-v0", prompt=GuessPrompt))
    train(TrainConfig(env="guess_number", init="base", out="runs/guess"))

Everything else in ``EnvSpec`` has a default (one task set without a ``split=`` keyword, SPO++'s whole-episode
context, 64 new tokens a turn, no expert). ``env_spec`` also takes ``"module:name"`` and ``"path/file.py:name"``,
as ``gymnasium.make`` takes ``"module:EnvName-v0"``: it imports the module, whose import registers the spec, so
``streamrl train --env my_pkg.my_env:guess_number`` trains an env the command line has never heard of
(``examples/custom_env.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamrl.agents.base import Agent, GenerationBackend, SamplingParams
from streamrl.agents.llm_agent import ContextPolicy, LLMAgent
from streamrl.agents.prompts import ALFWorldPrompt, MathTIRPrompt, PromptFormat
from streamrl.agents.rollout import LockstepResult, play_lockstep
from streamrl.envs.math_tasks import MATH_SFT_FAMILIES, synthetic_procedural
from streamrl.utils.modules import import_user_module


@dataclass(frozen=True)
class _SamePrompt:
    """A prompt format given as an instance, as the zero-argument factory ``EnvSpec.prompt`` holds (prompt
    formats are frozen: every agent may share one)."""

    format: PromptFormat

    def __call__(self) -> PromptFormat:
        return self.format


@dataclass(frozen=True)
class EnvSpec:
    """How the agents layer plays one env: gym id, prompt format, and (with defaults) splits, context policy,
    turn budget and expert.

    Only ``gym_id`` and ``prompt`` are required: ``EnvSpec(gym_id="examples/GuessNumber-v0", prompt=GuessPrompt)``
    trains with ``init="base"``. The built-in specs set every field they use explicitly.
    """

    gym_id: str
    """The registered Gymnasium id (``gymnasium.register``), or ``"module:Name-v0"`` as ``gymnasium.make`` takes."""
    prompt: Callable[[], PromptFormat]
    """The prompt format (``streamrl.agents.prompts.PromptFormat``): what the policy is told and how its text
    becomes an action. A zero-argument factory (e.g. the class) or an instance, which every agent then shares."""
    train_split: str = "train"
    """The split RL trains on (and SFT clones the expert on)."""
    eval_splits: tuple[str, ...] = ("train",)
    """Held-out splits, the first the trainer's default ``eval_split``. The default, the training split, suits an
    env with one task set; an env with splits names its held-out ones here (and sets ``split_keyword``)."""
    validation_split: str | None = None
    """A split of held-out *training* tasks (drawn like ``train_split``'s, none of them in it or in an eval split)
    on which settings are chosen (``streamrl train --eval-split``, ``streamrl eval --splits``), so the eval splits
    are looked at only for the final measurement; ``None``: the env has none."""
    split_keyword: str | None = None
    """The keyword of the env's constructor that selects a split (``"split"`` for streamrl's envs:
    ``gym.make(gym_id, split="test")``); ``None``: the env takes no split, every split plays its one task set,
    so ``train_split`` and ``eval_splits`` must then all be one name (a label)."""
    context: ContextPolicy = field(default_factory=ContextPolicy)
    """What the policy sees at each turn; the default is SPO++'s: the whole episode in one sequence (one
    training row per episode, the cheapest for the learner), up to 4096 tokens."""
    max_new_tokens: int = 64
    """Tokens the policy may generate in one turn (the prompt format's stop strings may end it sooner): a line
    of text or a short command. Raise it for envs whose turns are long (code, reasoning)."""
    expert: Callable[[Any], Agent] | None = None
    """Builds the expert for a given env instance (the Math solver needs the env's task records): the agent the
    SFT cold start (``init="sft"``) clones and ``streamrl eval --agent expert`` plays; ``None``: the env has no
    expert, so runs start from the model as it is (``init="base"``)."""
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env's constructor on every split (``make_kwargs``)."""
    task_filter: Callable[[Any], Callable[[str], bool]] | None = None
    """Given an env instance, a predicate on task ids: the tasks SFT trains on and ``evaluate`` plays."""
    synthetic_tasks: Callable[[int, int], dict[str, Any]] | None = None
    """``(n, seed) ->`` env kwargs (over ``env_kwargs``) of an env whose tasks are ``n`` extra generated training
    tasks, none of them in an eval split; ``None`` if the env has no generator."""
    held_out_tasks: Callable[[int, int], dict[str, Any]] | None = None
    """Like ``synthetic_tasks`` but for model selection (``SFTConfig.select_best_of``): ``(n, seed) ->`` env kwargs
    of ``n`` generated tasks drawn apart from the training ones of any seed; ``None``: no selection possible."""
    random_action: Callable[[Mapping[str, Any], random.Random], str] | None = None
    """``(info, rng) -> action``: a random action for DART-style noise in expert episodes, or ``None`` (no
    noise possible)."""
    expert_env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Env kwargs (over ``env_kwargs``) while the expert plays, e.g. a longer step budget for its searches."""
    slip_action: Callable[[str, Mapping[str, Any], random.Random], str | None] | None = None
    """``(expert action, info, rng) -> command``: a near miss of the expert's action that the env rejects (the
    state stays as it was), for the slip-and-recover demonstrations of ``SFTConfig.expert_slips``; ``None``
    from the callable when the action has no such near miss, ``None`` here when the env has none."""
    envs_per_worker: int = 1
    """Sub-envs one env worker process hosts unless a run says otherwise (``envs_per_worker`` of the train, eval
    and value-pretraining configs). Every worker pays a start-up (an interpreter, the package, the env's own
    processes such as Math-TIR's tool sandboxes); the sub-envs of one worker share it but step one at a time, and
    a crash or hang of the worker ends all of their episodes (each comes back marked). More than 1 suits an env
    whose steps take milliseconds and whose workers are costly to start; 1 (the default) one whose steps are
    slow or may hang."""

    def __post_init__(self) -> None:
        if not isinstance(self.gym_id, str) or not self.gym_id:
            raise ValueError(
                f"gym_id must be a registered gymnasium id (a non-empty str), got {self.gym_id!r}"
            )
        prompt = self.prompt
        if not isinstance(prompt, type) and isinstance(prompt, PromptFormat):
            object.__setattr__(self, "prompt", _SamePrompt(prompt))
        elif not callable(prompt):
            raise TypeError(
                f"prompt must be a PromptFormat or a zero-argument callable returning one, got {prompt!r}"
            )
        made = self.prompt()
        if not isinstance(made, PromptFormat):
            raise TypeError(
                f"prompt {prompt!r} made {made!r}, not a PromptFormat (it needs name, stop_strings, "
                "system_prompt, user_message and parse_action: streamrl.agents.prompts.PromptFormat)"
            )
        if not isinstance(self.envs_per_worker, int) or self.envs_per_worker < 1:
            raise ValueError(f"envs_per_worker must be an int >= 1, got {self.envs_per_worker!r}")
        eval_splits = self.eval_splits
        if (
            isinstance(eval_splits, str)
            or not eval_splits
            or not all(isinstance(s, str) for s in eval_splits)
        ):
            raise ValueError(f"eval_splits must be a non-empty tuple of split names, got {eval_splits!r}")
        object.__setattr__(self, "eval_splits", tuple(eval_splits))
        if self.validation_split is not None and (
            not isinstance(self.validation_split, str)
            or self.validation_split in (self.train_split, *self.eval_splits)
        ):
            raise ValueError(
                f"validation_split={self.validation_split!r} must be a split name apart from train_split="
                f"{self.train_split!r} and eval_splits={self.eval_splits} (or None)"
            )
        if self.split_keyword is None and set(self.splits) != {self.train_split}:
            raise ValueError(
                f"splits {list(self.splits)} name splits other than train_split={self.train_split!r}, but "
                "split_keyword is None: the env takes no split, so every split would play the same tasks. Set "
                "split_keyword to the env constructor's keyword that selects a split (e.g. 'split'), or leave "
                "the splits at their defaults"
            )
        if not isinstance(self.context, ContextPolicy):
            raise TypeError(f"context must be a ContextPolicy, got {self.context!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.expert is not None and not callable(self.expert):
            raise TypeError(f"expert must be None or a callable (env) -> Agent, got {self.expert!r}")

    @property
    def splits(self) -> tuple[str, ...]:
        """Every split this spec names: the training split first, then the held-out ones, then the validation
        split (if any)."""
        validation = () if self.validation_split is None else (self.validation_split,)
        return tuple(dict.fromkeys((self.train_split, *self.eval_splits, *validation)))

    def make_kwargs(self, split: str, **overrides: Any) -> dict[str, Any]:
        """The ``gymnasium.make`` keyword arguments of this env on ``split``: the split (under ``split_keyword``,
        if the env takes one), then ``env_kwargs``, then ``overrides``. For an env without splits, ``split``
        must be one of its split labels (a ``ValueError`` names them)."""
        if self.split_keyword is None:
            if split not in self.splits:
                raise ValueError(
                    f"split {split!r}: env {self.gym_id} has one task set and takes no split; valid: "
                    f"{list(self.splits)}"
                )
            return {**self.env_kwargs, **overrides}
        return {self.split_keyword: split, **self.env_kwargs, **overrides}

    @property
    def lists_actions(self) -> bool:
        """Whether the env's prompt format lists the actions a turn may take (``action_choices``): what an
        agent needs to play with ``constrain_actions``."""
        return callable(getattr(self.prompt(), "action_choices", None))

    def llm_agent(
        self,
        backend: GenerationBackend,
        sampling: SamplingParams | None = None,
        *,
        constrain_actions: bool = False,
        avoid_repeats: bool = False,
        tokenizer: Any = None,
    ) -> LLMAgent:
        """An ``LLMAgent`` on ``backend`` with this env's prompt format and context policy; ``sampling``
        defaults to temperature 1 and the spec's ``max_new_tokens``; ``constrain_actions`` restricts its
        actions to the prompt format's ``action_choices``, ``avoid_repeats`` to those not taken before from the
        same state (``LLMAgent``)."""
        # No run seed by default: the backend's own generator (HFBackendConfig.seed) draws; pass sampling with
        # a seed for per-episode, per-turn seeds derived from it (LLMAgent).
        sampling = sampling or SamplingParams(max_new_tokens=self.max_new_tokens)
        return LLMAgent(
            backend,
            tokenizer=tokenizer,
            prompt_format=self.prompt(),
            sampling=sampling,
            context=self.context,
            constrain_actions=constrain_actions,
            avoid_repeats=avoid_repeats,
        )


def _alfworld_expert(env: Any) -> Agent:
    from streamrl.agents.alfworld_agents import ALFWorldSearchAgent

    return ALFWorldSearchAgent()


def _alfworld_random_action(info: Mapping[str, Any], rng: random.Random) -> str:
    """A random admissible command ("help" left out: its long reply says nothing about the room), a quarter
    of the time with its number changed ("open drawer 2" -> "open drawer 5"): mostly an inadmissible command,
    the typical slip of a small model, after which the expert shows how to go on from "Nothing happens."."""
    commands = sorted(str(c) for c in info.get("admissible_commands") or [] if c != "help")
    command = rng.choice(commands) if commands else "look"
    head, _, number = command.rpartition(" ")
    if number.isdigit() and rng.random() < 0.25:
        command = f"{head} {rng.choice([n for n in range(1, 10) if n != int(number)])}"
    return command


def _alfworld_slip(action: str, info: Mapping[str, Any], rng: random.Random) -> str | None:
    """A near miss of the expert's ``action`` that the game rejects: one of its numbers changed so that the
    command is not admissible ("go to cabinet 4" -> "go to cabinet 9" in a kitchen with six cabinets, "take
    apple 1 from countertop 2" -> "take apple 3 from countertop 2"). These are the slips a small policy makes
    at the search and pick steps; after one the game answers "Nothing happens.", the state is unchanged and
    the expert's action is still the right one, so the next turn shows the policy to write the command it
    missed rather than the one that failed again. ``None`` when the action has no number to change."""
    admissible = {str(c) for c in info.get("admissible_commands") or []}
    words = action.split(" ")
    misses = [
        " ".join([*words[:i], str(n), *words[i + 1 :]])
        for i, word in enumerate(words)
        if word.isdigit()
        for n in range(1, 13)
        if str(n) != word
    ]
    misses = [m for m in misses if m not in admissible]
    return rng.choice(misses) if misses else None


def _alfworld_extra_games(n: int, seed: int) -> dict[str, Any]:
    """Games ``128 .. 128 + n - 1`` of the generated ``train`` split: more rooms and goals of ALFRED's training
    floor plans, beyond the 128 games RL trains on (the SPO++ paper's training-set size); none is an eval game.
    A generated game depends only on its index, so every seed gets the same games (the seed still shuffles the
    training order). Generated on first use and cached with the split."""
    from streamrl.envs.alfworld_gen import GenerationConfig, ensure_split

    if n < 0:
        raise ValueError(f"the number of extra ALFWorld games must be >= 0, got {n}")
    first = GenerationConfig().train
    paths = ensure_split("train", GenerationConfig(train=first + n))
    return {"game_files": [str(p) for p in paths[first:]]}


def _math_expert(env: Any) -> Agent:
    from streamrl.agents.math_solver import MathSolverAgent

    agent: Agent = MathSolverAgent(env.unwrapped.tasks)
    return agent


def _math_family_filter(env: Any) -> Callable[[str], bool]:
    family = {t.task_id: t.meta.get("family") for t in env.unwrapped.tasks}
    return lambda task_id: family.get(task_id) in MATH_SFT_FAMILIES


def _math_synthetic_tasks(n: int, seed: int) -> dict[str, Any]:
    """``n`` fresh procedural problems of ``MATH_SFT_FAMILIES`` (a seed of their own), none of whose questions
    is in the held-out ``test`` split: cheap extra expert data, since copying numbers is learnt from variety."""
    return {"tasks": list(synthetic_procedural(n, seed))}


def _math_held_out_tasks(n: int, seed: int) -> dict[str, Any]:
    """Validation problems: a draw with seed ``-1 - seed``, apart from the training draws of every seed >= 0."""
    return _math_synthetic_tasks(n, -1 - seed)


ENV_SPECS: dict[str, EnvSpec] = {
    "alfworld": EnvSpec(
        gym_id="streamrl/ALFWorld-v0",
        train_split="train",
        eval_splits=("eval_seen", "eval_unseen"),
        validation_split="validation",
        split_keyword="split",
        # The expert (ALFWorldSearchAgent) decides from the task, the room description (both in the first
        # observation, which a window always keeps), the current observation and the admissible commands, so
        # the policy sees exactly that: a window of one past turn, and the admissible commands without the
        # ~25 "go to" ones (the room description names every receptacle), one per line so that a listed
        # command is the same token string as the reply that issues it. An expert that decides from more
        # than the policy sees (the walkthrough) cannot be imitated (docs/sft.md).
        prompt=lambda: ALFWorldPrompt(list_admissible=True, list_go_to=False, one_command_per_line=True),
        context=ContextPolicy(mode="window", window_turns=1, max_context_tokens=1024),
        max_new_tokens=24,
        expert=_alfworld_expert,
        env_kwargs={"max_steps": 50},  # ALFWorld's own limit
        random_action=_alfworld_random_action,
        slip_action=_alfworld_slip,
        # Searching takes long in kitchens with many closed cabinets: within ALFWorld's 50 steps the expert
        # loses some training games it wins within 100 (docs/sft.md, How it works)
        expert_env_kwargs={"max_steps": 100},
        synthetic_tasks=_alfworld_extra_games,
    ),
    "math_tir": EnvSpec(
        gym_id="streamrl/MathTIR-v0",
        train_split="train",
        eval_splits=("test",),
        split_keyword="split",
        prompt=MathTIRPrompt,
        context=ContextPolicy(mode="full", max_context_tokens=2048),
        max_new_tokens=160,
        expert=_math_expert,
        # The procedural families (short reference programs such as ``print(pow(30, 170, 46))``) are what a
        # ~2M-parameter model can clone in minutes; GSM-symbolic word problems need a pretrained model.
        env_kwargs={"source": "procedural", "max_tool_calls": 2, "max_turns": 4},
        task_filter=_math_family_filter,
        synthetic_tasks=_math_synthetic_tasks,
        held_out_tasks=_math_held_out_tasks,
        # A step is a parse and at most one sandboxed snippet (milliseconds; 5 s at most, the sandbox's limit),
        # while a worker's start-up (the interpreter and package, then a tool and a grading sandbox, each
        # importing sympy and numpy) costs 2-3 CPU-seconds: eight sub-envs share one, a session's first
        # evaluation then starts 1.7x sooner and a warm one plays as fast (benchmarks/bench_env_hosting.py,
        # docs/training.md)
        envs_per_worker=8,
    ),
}


_BUILTIN_SPECS = frozenset(ENV_SPECS)


def register_env_spec(name: str, spec: EnvSpec, *, replace: bool = False) -> None:
    """Make ``spec`` known as env ``name``: then ``make_env(name, ...)``, ``evaluate`` and the trainer
    (``TrainConfig(env=name)``) play it. This is how your own gym env becomes trainable. A taken name raises
    unless ``replace`` (the built-in names cannot be replaced)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(
            f"env name must be a non-empty str without ':' (which separates a module from a name in "
            f"'module:name'), got {name!r}"
        )
    if not isinstance(spec, EnvSpec):
        raise TypeError(f"spec must be an EnvSpec, got {type(spec).__name__}")
    if name in _BUILTIN_SPECS or (name in ENV_SPECS and not replace):
        raise ValueError(
            f"env name {name!r} is already registered"
            + ("" if name in _BUILTIN_SPECS else " (pass replace=True to replace it)")
            + f"; registered: {sorted(ENV_SPECS)}"
        )
    ENV_SPECS[name] = spec


def env_spec(name: str) -> EnvSpec:
    """The spec of env ``name``: a registered name, or ``"module:name"`` / ``"path/file.py:name"``, which first
    imports the module (``import_user_module``), whose import registers ``name``, as ``gymnasium.make`` imports
    the module of ``"module:EnvName-v0"``. A ``ValueError`` names the valid names if there is none."""
    if name in ENV_SPECS:
        return ENV_SPECS[name]
    if isinstance(name, str) and ":" in name:
        where, _, key = name.rpartition(":")
        try:
            import_user_module(where)
        except (ImportError, FileNotFoundError) as exc:
            raise ValueError(f"env {name!r}: cannot import {where!r}: {exc}") from exc
        if key not in ENV_SPECS:
            raise ValueError(
                f"env {name!r}: importing {where!r} registered no env named {key!r} (register_env_spec); "
                f"registered: {sorted(ENV_SPECS)}"
            )
        return ENV_SPECS[key]
    raise ValueError(
        f"unknown env {name!r}; valid: {sorted(ENV_SPECS)}, or 'module:name' / 'file.py:name' for an env "
        "that module registers (register_env_spec)"
    )


def expert_factory(name: str) -> Callable[[Any], Agent]:
    """What builds the expert of env ``name`` for an env instance (``EnvSpec.expert``); a ``ValueError`` when
    the env has none, naming the envs that have one."""
    spec = env_spec(name)
    if spec.expert is None:
        with_expert = sorted(n for n, s in ENV_SPECS.items() if s.expert is not None)
        raise ValueError(
            f"env {name!r} has no expert (EnvSpec.expert is None): nothing to clone (SFT) or play as the "
            f"expert; envs with one: {with_expert}"
        )
    return spec.expert


def make_env(name: str, split: str, **kwargs: Any) -> Any:
    """The gym env of ``name`` on ``split`` (``EnvSpec.make_kwargs``: the split, the spec's extra kwargs, then
    ``kwargs``)."""
    import gymnasium as gym
    import streamrl.envs  # noqa: F401  (registers the ids)

    spec = env_spec(name)
    return gym.make(spec.gym_id, **spec.make_kwargs(split, **kwargs))


def task_ids_of(env: Any, env_name: str | None = None) -> list[str]:
    """Stable task ids a ``TextEnv`` can play, in its split order (``env.unwrapped.task_ids``).

    With ``env_name``, only the tasks its spec's ``task_filter`` keeps (the ones SFT and RL train and evaluate on).
    """
    out = list(env.unwrapped.task_ids)
    task_filter = env_spec(env_name).task_filter if env_name is not None else None
    if task_filter is not None:
        keep = task_filter(env)
        out = [t for t in out if keep(t)]
    return out


def play_tasks(
    agent: Agent,
    env_name: str,
    split: str,
    episodes: int,
    batch_size: int = 16,
    env_kwargs: Mapping[str, Any] | None = None,
) -> LockstepResult:
    """Play the first ``episodes`` tasks of ``split`` that env ``env_name``'s spec trains and evaluates on
    (``task_ids_of``), ``batch_size`` envs at a time in lock-step (``play_lockstep``); returns the counts.

    ``env_kwargs`` go to every env (e.g. ``tasks=`` for a generated task set). The envs are closed on return.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    extra = dict(env_kwargs or {})
    envs = [make_env(env_name, split, **extra)]
    try:
        task_ids = task_ids_of(envs[0], env_name)[:episodes]
        while len(envs) < min(batch_size, len(task_ids)):
            envs.append(make_env(env_name, split, **extra))
        return play_lockstep(agent, envs, task_ids)
    finally:
        for env in envs:
            env.close()
