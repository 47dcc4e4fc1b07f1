"""SFT cold start: behaviour cloning of expert agents, rendered through the LLM agent's own prompts and masks.

The SPO++ paper starts Math-TIR from an SFT checkpoint; this module gives the ``tiny`` model the same kind of
start, one checkpoint per env (``sft_checkpoint("math_tir")``, ``sft_checkpoint("alfworld")``: RL on an env
starts from its own checkpoint; trained together, the two envs' data left Math-TIR at 3%):

1. **Expert data.** Each expert episode (``ALFWorldSearchAgent``, which searches the room and decides from
   what the agent sees; ``MathSolverAgent`` writing correct tool code) is played through a real ``LLMAgent``
   whose backend is *teacher-forced*: it "generates" the tokens of the expert's action followed by the
   end-of-turn token. The resulting ``Trajectory`` therefore has exactly the token layout, chat rendering,
   context policy and ``action_mask`` that the agent produces at RL time -- one piece of code renders both.
   Options: DART noise (random actions that are context, not targets, so the expert's next actions are
   recovery demonstrations) and downsampling of frequent actions. Math-TIR is restricted to the one-line
   procedural families ``MATH_SFT_FAMILIES`` (training and evaluation alike), and its data is mostly
   *synthetic*: thousands of freshly generated problems of those families (none in the test split), because
   copying numbers (question -> program, tool output -> ``\\boxed{}``) is learnt from variety, not from more
   epochs over a few hundred tasks. ALFWorld's extra data are more generated games of the training floor plans
   (``train`` games 128-1151; RL trains on the first 128), its admissible commands are listed one per line
   (a listed command is then the same token string as the reply that issues it), and most of its frequent,
   easy search turns are downsampled to context.
2. **Training.** Token-level cross-entropy on action tokens (mask 1), averaged over all action tokens of a
   batch, plus ``SFTConfig.context_weight`` times a language-modelling loss on the context tokens (prompt,
   observations, tool output; both recipes use 0.3: the context's copies teach the copying the actions
   need); AdamW with linear warm-up and cosine decay, full fine-tuning by default (``lora`` to train an
   adapter instead). A recipe may start from another env's
   checkpoint (``SFTConfig.init_from``): ALFWorld starts from Math-TIR's.
3. **Cache.** The checkpoint is saved under ``$STREAMRL_CACHE/sft/<model>-sft-<config hash>`` (atomic,
   locked), so tests and examples reuse it. ``evaluate`` measures the success rate of an ``LLMAgent`` on a
   split.

Measured on ``tiny`` (2.08M parameters), 1 torch thread on the shared 2-core machine, 2026-11-29/30 (success
rate greedy / sampled at temperature 1; ALFWorld on the first 32 games of each split, 50-step limit):

- **Math-TIR** (recipe: 3,271 expert episodes, 3 epochs, lr 5e-3, ``context_weight`` 0.3; ~6.5 min; rates on
  the first 50 family tasks of ``train`` and all 50 of ``test``): seed 0 12% / 2% on train, 6% / 6% on test;
  seed 1 14% / 12% and 22% / 20%; seed 2 38% / 28% and 46% / 44% -- test greedy 25% on average over the three
  seeds. Without the context loss (the recipe until 2026-11-30) the same seeds reach 34% / 17% and 24% / 12%
  (seed 0), 5% / 3% and 2% / 2% (seed 1), 3% / 0% and 4% / 0% (seed 2; 64 ``train`` tasks): 10% test greedy
  on average, because whether the model learns to copy numbers within the budget depends on the seed (data draws and order; the
  initial weights are the same). The context loss (the question's numbers recur in the program, the tool's
  output in the answer) makes that copying more likely but not certain. Also measured without it: 5 epochs
  (~9 min), test 6% / 2%, 14% / 6%, 18% / 12%; lr 2e-3 and 1e-2 did not rescue seed 1 (0-3%); keeping the
  best of 5 epochs by greedy success on 64 freshly generated problems (``select_best_of=64``): test 6% / 8% /
  12% greedy for seeds 0 / 1 / 2 (validation picked epochs 5 / 2 / 4), so selection stays an option.
- **ALFWorld** (recipe: 1,151 won expert episodes of 1,152 games, 1 in 10 ``go to`` and 3 in 10 ``open``
  turns trained on, ``context_weight`` 0.3, 2 epochs from the Math-TIR checkpoint; 7,462 sequences, 2.39M
  tokens, 54.6k action tokens; ~3.5 min of expert play and ~19 min of training): greedy 3% / 6% / 0% on
  train / eval_seen / eval_unseen (12 / 18 / 11% of its actions valid: after an inadmissible ``go to`` it
  often repeats it to the step limit); sampled at temperature 1, 6% / 9% / 9% (2, 3, 3 of 32; 33 / 39 / 34%
  valid) and, on 64 games of each split with other draws, 5% / 11% / 6% (3, 7, 4 of 64): 22 wins in 288
  sampled episodes (7.6%), where the random agent (``ALFWorldRandomAgent``) wins none of the same 192 games.
  With 1 epoch (~9 min): greedy 0% everywhere, sampled 13 wins in 288 (4.5%); with 1 epoch and no context
  loss (the recipe until 2026-11-30): 2 in 288; 1 epoch with weight 1.0: greedy 0%, sampled 5 of 96.
  Teacher-forced on 12 ``eval_seen`` games the 1-epoch checkpoint matches 93/195 ``go to``, 107/108
  ``open``, 8/14 ``take`` and 11/12 ``move`` turns (without the context loss 68/195, 107/108, 2/14, 11/12):
  the context loss taught it to pick the task's object among the listed ``take`` commands. Also measured with the context loss and not kept: DART noise (576 games played twice, 15% random
  actions): 0% everywhere, 3% valid greedy; the ``go to`` commands listed as well (4.7M tokens, 23 min):
  5/195 ``go to``, 0/14 ``take``.
  Without the context loss, per-turn imitation on the same 12 games (``go to`` / ``open`` / ``take`` /
  ``move`` turns matched): the 2026-11-29 recipe (128 games, comma-separated list, 2 epochs) 22/49 / 20/21 / 0/10 /
  0/10 on unseen games; 1,152 games with the comma list 66/195 / 106/108 / 1/14 / 1/12 (the object of
  ``take`` / ``move`` is the most frequent one, "take egg 1", not the task's); one command per line
  68/195 / 107/108 / 2/14 / 11/12 (copying a listed ``move`` works; picking the right one of several listed
  ``take`` commands does not). Also measured and not kept (teacher-forced, same games): 2 epochs (87/195,
  107/108, 1/14, 4/12); a memoryless random search expert (``ALFWorldSearchAgent(search="random")``, which
  wins 59/64 training games within 50 steps: 0/13 ``take``, 0/11 ``move``); a consistent random renaming of
  the object names in half or all of the episodes (to stop predicting the frequent object: 2/14 ``take``
  at best); an induction-head warm-up (300 steps of random token strings shown twice, repeat loss 0.02)
  before the data, from the bare model (8/195 ``go to``, 7/108 ``open``) or from the Math-TIR checkpoint with
  renaming (0/12 ``move``) -- on Math-TIR seeds 1 and 2 it left test success at 2%; the random search with
  the ``go to`` commands listed too (640 games; no turn type above 10/238). Earlier variants
  (2026-11-29, 128 games): from scratch, window of 0 or 1 past turns, 1-2 epochs, DART noise 0.15-0.2,
  1/4 of the ``go to`` turns: 0% success each. The expert is imitable in principle (it wins every training
  game); what a few CPU minutes leave a 2M-parameter model short of is the room-order search step (find the
  current receptacle in the room description and name the next one: ~half the ``go to`` turns), and one
  slip derails a greedy episode.

Command line (one checkpoint per env with its recipe, then greedy and sampled success rates as JSON)::

    python -m streamrl.agents.sft --envs alfworld math_tir --eval-episodes 64 --temperature 0 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from streamrl.agents.base import Agent, EpisodeId, Generation, SamplingParams
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig, selected_token_logprobs
from streamrl.agents.llm_agent import ContextPolicy, LLMAgent
from streamrl.agents.lora import LoRAConfig, wrap_lora
from streamrl.agents.models import build_once, cache_root, load_model, load_tokenizer, resolve_model
from streamrl.agents.prompts import ALFWorldPrompt, MathTIRPrompt, PromptFormat
from streamrl.agents.rollout import play_episode
from streamrl.agents.trajectory import TokenSequence, Trajectory

_RECIPE = 4  # bump when the data rendering or training loop changes


# ----------------------------------------------------------------------------------------------------------
# Env specs: which gym env, prompt format, context policy and expert belong to an env name


@dataclass(frozen=True)
class EnvSpec:
    """How the agents layer plays one env: gym id, splits, prompt format, context policy, expert."""

    gym_id: str
    train_split: str
    eval_splits: tuple[str, ...]
    prompt: Callable[[], PromptFormat]
    context: ContextPolicy
    max_new_tokens: int
    expert: Callable[[Any], Agent]
    """Builds the expert for a given env instance (the Math solver needs the env's task records)."""
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
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


def _alfworld_extra_games(n: int, seed: int) -> dict[str, Any]:
    """Games ``128 .. 128 + n - 1`` of the generated ``train`` split: more rooms and goals of ALFRED's training
    floor plans, beyond the 128 games RL trains on (the SPO++ paper's training-set size); none is an eval game.
    A generated game depends only on its index, so every seed gets the same games (the seed still shuffles the
    training order). Generated on first use (~0.5 CPU-second a game, cached with the split)."""
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


MATH_SFT_FAMILIES: tuple[str, ...] = ("mod", "combin", "series")
"""Procedural Math-TIR families the SFT recipe trains and evaluates on: their reference programs are one line
(``print(pow(30, 170, 46))``, ``print(math.comb(11, 3))``, ``print(sum(7 + 3 * i for i in range(25)))``), so a
~2M-parameter model trained from scratch only has to learn to copy two or three numbers from the question into
the program and the tool's output into ``\\boxed{}``. Longer programs need a pretrained model."""


def _math_family_filter(env: Any) -> Callable[[str], bool]:
    family = {t.task_id: t.meta.get("family") for t in env.unwrapped.tasks}
    return lambda task_id: family.get(task_id) in MATH_SFT_FAMILIES


def _math_synthetic_tasks(n: int, seed: int) -> dict[str, Any]:
    """``n`` fresh procedural problems of ``MATH_SFT_FAMILIES`` (a seed of their own), none of whose questions
    is in the held-out ``test`` split: cheap extra expert data, since copying numbers is learnt from variety."""
    from streamrl.envs.math_tasks import procedural_records, procedural_tasks, sample_procedural

    if n < 0:
        raise ValueError(f"the number of synthetic tasks must be >= 0, got {n}")
    held_out = frozenset(t.question for t in procedural_tasks("test"))
    raw = sample_procedural(f"streamrl-sft-math-{seed}", n, exclude=held_out, families=MATH_SFT_FAMILIES)
    return {"tasks": list(procedural_records(raw, f"sft-synthetic/{seed}/", "train"))}


def _math_held_out_tasks(n: int, seed: int) -> dict[str, Any]:
    """Validation problems: a draw with seed ``-1 - seed``, apart from the training draws of every seed >= 0."""
    return _math_synthetic_tasks(n, -1 - seed)


ENV_SPECS: dict[str, EnvSpec] = {
    "alfworld": EnvSpec(
        gym_id="streamrl/ALFWorld-v0",
        train_split="train",
        eval_splits=("eval_seen", "eval_unseen"),
        # The expert (ALFWorldSearchAgent) decides from the task, the room description (both in the first
        # observation, which a window always keeps), the current observation and the admissible commands, so
        # the policy sees exactly that: a window of one past turn, and the admissible commands without the
        # ~25 "go to" ones (the room description names every receptacle), one per line so that a listed
        # command is the same token string as the reply that issues it (~320 tokens a turn). Measured with
        # the omniscient walkthrough expert instead (its moves cannot be inferred from the observations):
        # 0% success in every variant (full history or window, with or without the list, 6-20 epochs).
        prompt=lambda: ALFWorldPrompt(list_admissible=True, list_go_to=False, one_command_per_line=True),
        context=ContextPolicy(mode="window", window_turns=1, max_context_tokens=1024),
        max_new_tokens=24,
        expert=_alfworld_expert,
        env_kwargs={"max_steps": 50},  # ALFWorld's own limit
        random_action=_alfworld_random_action,
        # Searching takes long in kitchens with many closed cabinets: the expert wins 111/128 training games
        # within 50 steps, all 128 within 100 (tests/test_alfworld_agents.py).
        expert_env_kwargs={"max_steps": 100},
        synthetic_tasks=_alfworld_extra_games,
    ),
    "math_tir": EnvSpec(
        gym_id="streamrl/MathTIR-v0",
        train_split="train",
        eval_splits=("test",),
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
    ),
}


def env_spec(name: str) -> EnvSpec:
    if name not in ENV_SPECS:
        raise ValueError(f"unknown env {name!r}; valid: {sorted(ENV_SPECS)}")
    return ENV_SPECS[name]


def make_env(name: str, split: str, **kwargs: Any) -> Any:
    """The gym env of ``name`` on ``split`` (with the spec's extra kwargs, then ``kwargs``)."""
    import gymnasium as gym
    import streamrl.envs  # noqa: F401  (registers the ids)

    spec = env_spec(name)
    return gym.make(spec.gym_id, split=split, **{**dict(spec.env_kwargs), **kwargs})


def task_ids_of(env: Any, env_name: str | None = None) -> list[str]:
    """Stable task ids an env can play, in its split order (``task_ids``, or the ids of ``tasks``).

    With ``env_name``, only the tasks its spec's ``task_filter`` keeps (the ones SFT trains and evaluates on).
    """
    inner = env.unwrapped
    if hasattr(inner, "task_ids"):
        ids = inner.task_ids
        out = list(ids() if callable(ids) else ids)
    elif hasattr(inner, "tasks"):
        out = [t.task_id for t in inner.tasks]
    else:
        raise TypeError(
            f"{type(inner).__name__} exposes neither task_ids nor tasks; cannot enumerate its tasks"
        )
    task_filter = env_spec(env_name).task_filter if env_name is not None else None
    if task_filter is not None:
        keep = task_filter(env)
        out = [t for t in out if keep(t)]
    return out


# ----------------------------------------------------------------------------------------------------------
# Expert data through the agent's own rendering


class TeacherForcedBackend:
    """A ``GenerationBackend`` that "generates" queued token ids (log-prob 0): the expert's action tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.queue: list[list[int]] = []

    @property
    def adapter_version(self) -> int:
        return 0

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        if len(self.queue) != len(prompts):
            raise RuntimeError(f"{len(prompts)} prompts but {len(self.queue)} forced completions queued")
        out = [Generation(list(ids), [0.0] * len(ids), "stop") for ids in self.queue]
        self.queue = []
        return out

    def score(self, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[float]]:
        raise NotImplementedError("a teacher-forced backend has no model to score with")

    def set_adapter(self, path: str | None, version: int) -> None:
        raise NotImplementedError("a teacher-forced backend has no model")

    def close(self) -> None:
        pass


class TeacherForcedAgent:
    """Plays an expert's actions while recording them as an ``LLMAgent`` would have generated them.

    With ``noise > 0`` (DART, Laskey et al. 2017, arXiv:1703.09327), each turn is, with that probability, a
    ``random_action`` instead of the expert's: the episode then visits states off the expert's path, and the
    expert's next actions are recovery demonstrations. Noise turns stay in the trajectory (as context of the
    turns after them) but are not trained on: their indices are in ``info["noise_turns"]`` and
    ``info["untrained_turns"]``, which ``sequences_of`` masks. The
    expert must decide from the state, not from a plan (``ALFWorldSearchAgent``, not the walkthrough).
    """

    def __init__(
        self,
        expert: Agent,
        tokenizer: Any,
        prompt_format: PromptFormat,
        context: ContextPolicy,
        noise: float = 0.0,
        random_action: Callable[[Mapping[str, Any], random.Random], str] | None = None,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        if noise and random_action is None:
            raise ValueError(f"noise={noise} needs a random_action to inject")
        self.expert = expert
        self.backend = TeacherForcedBackend(tokenizer)
        self.llm = LLMAgent(
            self.backend,
            prompt_format=prompt_format,
            tokenizer=tokenizer,
            sampling=SamplingParams(max_new_tokens=4096),
            context=context,
        )
        eos = tokenizer.eos_token_id
        self._eos = [int(eos)] if eos is not None else []
        self.noise, self.random_action, self._rng = noise, random_action, random.Random(seed)
        self._noise_turns: dict[EpisodeId, list[int]] = {}
        self._turns: dict[EpisodeId, int] = {}

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = self.expert.act(observations, infos, episode_ids)
        for i, (info, eid) in enumerate(zip(infos, episode_ids, strict=True)):
            turn = self._turns.get(eid, 0)
            self._turns[eid] = turn + 1
            if self.noise and self._rng.random() < self.noise:
                assert self.random_action is not None
                actions[i] = self.random_action(info, self._rng)
                self._noise_turns.setdefault(eid, []).append(turn)
        self.backend.queue = [self.llm.chat.encode(a) + self._eos for a in actions]
        self.llm.act(observations, infos, episode_ids)
        return actions

    def end_episode(self, episode_id: EpisodeId) -> Trajectory:
        self.expert.end_episode(episode_id)
        noise_turns = self._noise_turns.pop(episode_id, [])
        self._turns.pop(episode_id, None)
        trajectory = self.llm.end_episode(episode_id)
        trajectory.info["noise_turns"] = list(noise_turns)
        trajectory.info["untrained_turns"] = list(noise_turns)
        return trajectory


def expert_trajectories(
    env_name: str,
    tokenizer: Any,
    split: str | None = None,
    limit: int | None = None,
    synthetic: int = 0,
    seed: int = 0,
    replays: int = 1,
    noise: float = 0.0,
) -> list[Trajectory]:
    """Won expert episodes of ``env_name`` as trajectories: every task of the split (or the first ``limit``),
    then ``synthetic`` generated tasks (``EnvSpec.synthetic_tasks``; an error for envs without a generator).

    Each split task is played ``replays`` times: the first time by the expert alone, then with DART noise
    ``noise`` (``TeacherForcedAgent``; needs ``EnvSpec.random_action``), each replay with its own draws.
    """
    spec = env_spec(env_name)
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    if noise and spec.random_action is None:
        raise ValueError(
            f"env {env_name!r} has no random_action for DART noise; noise must be 0, got {noise}"
        )
    sources: list[tuple[Any, list[str], float, int]] = []
    env = make_env(env_name, split or spec.train_split, **dict(spec.expert_env_kwargs))
    task_ids = task_ids_of(env, env_name)[:limit]
    sources.append((env, task_ids, 0.0, seed))
    for replay in range(1, replays):
        sources.append((env, task_ids, noise, seed * 1000 + replay))
    if synthetic:
        if spec.synthetic_tasks is None:
            raise ValueError(f"env {env_name!r} has no task generator; synthetic must be 0, got {synthetic}")
        extra = {**spec.synthetic_tasks(synthetic, seed), **dict(spec.expert_env_kwargs)}
        synth_env = make_env(env_name, spec.train_split, **extra)
        sources.append((synth_env, task_ids_of(synth_env, env_name), 0.0, seed))
    out: list[Trajectory] = []
    try:
        for source_env, source_ids, source_noise, source_seed in sources:
            agent = TeacherForcedAgent(
                spec.expert(source_env),
                tokenizer,
                spec.prompt(),
                spec.context,
                noise=source_noise,
                random_action=spec.random_action,
                seed=source_seed,
            )
            for task_id in source_ids:
                result = play_episode(source_env, agent, options={"task_id": task_id})
                trajectory = result.record
                assert trajectory is not None  # a TeacherForcedAgent keeps a record
                if trajectory.won and "context_exhausted" not in trajectory.info:
                    out.append(trajectory)
    finally:
        for source_env in {id(s[0]): s[0] for s in sources}.values():
            source_env.close()
    return out


# ----------------------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Behaviour-cloning recipe. Every field is part of the checkpoint's cache key.

    The defaults are generic; ``sft_config(env)`` gives the measured recipe of one env (``SFT_RECIPES``).
    """

    envs: tuple[str, ...]
    """Envs whose expert data is mixed into one training set (one checkpoint plays all of them). One env per
    checkpoint is the recommended use: on ``tiny``, training on both envs together left Math-TIR at 3%."""
    model: str = "tiny"
    """Registry name or local HF directory of the model to fine-tune."""
    max_expert_episodes: int = 0
    """Per env, the first tasks of the training split (ALFWorld has 128, Math-TIR 271 in
    ``MATH_SFT_FAMILIES``); 0 = all."""
    synthetic_episodes: int = 0
    """Per env with a task generator (``EnvSpec.synthetic_tasks``), extra expert episodes on generated training
    tasks: fresh Math-TIR problems, or ALFWorld games after the 128 of the training split."""
    expert_replays: int = 1
    """Times each training task is played: once by the expert alone, then with DART noise (below)."""
    expert_noise: float = 0.0
    """Per-turn probability of a random action in the replays (envs with ``EnvSpec.random_action``)."""
    downsample: tuple[tuple[str, float], ...] = ()
    """``(action prefix, keep probability)`` pairs: an expert turn whose action starts with the prefix is a
    training target with that probability, otherwise context only (``sequences_of``); e.g.
    ``(("go to ", 0.25),)`` keeps a quarter of ALFWorld's search steps (~60% of its turns)."""
    context_weight: float = 0.0
    """Weight of a language-modelling loss on the context tokens (prompt, observations, tool output), added to
    the action tokens' loss as ``action NLL + context_weight * context NLL`` (each a mean over its tokens).
    The context is most of the tokens (44 times the actions on ALFWorld, 3 times on Math-TIR) and full of
    copies (ALFWorld's admissible commands repeat the objects of the observation, Math-TIR's code the numbers
    of the question), so it trains the copying a small model needs at no extra forward cost; 0 trains on the
    actions alone."""
    epochs: int = 3
    batch_size: int = 4
    """Sequences per step (small batches: more updates per token, which is what a few minutes buy)."""
    lr: float = 5e-3
    """Peak AdamW learning rate (a random-init tiny model needs a high one; use ~1e-4 for pretrained ones)."""
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora: LoRAConfig | None = None
    """``None`` = full fine-tuning; otherwise train (and save) a LoRA adapter merged into the checkpoint."""
    seed: int = 0
    select_best_of: int = 0
    """Model selection: after every epoch, play this many freshly *generated* tasks greedily (envs with
    ``EnvSpec.held_out_tasks``, i.e. Math-TIR; drawn with a seed of their own, so they may repeat a training
    problem by chance but never a test one) and keep the weights of the best epoch; 0 keeps the last epoch.
    On ``tiny`` the epoch at which copying numbers clicks, and whether later epochs undo it, varies with the
    seed."""
    init_from: str | None = None
    """An env name: start from that env's SFT checkpoint (``sft_config(init_from, model=model)``, its recipe
    and seed, trained first if not cached) instead of the bare ``model`` -- a curriculum. ALFWorld starts from
    Math-TIR's: the copy skills learnt there (question -> program, output -> answer) are what ALFWorld's
    commands need (copy an admissible command, a receptacle name)."""

    def __post_init__(self) -> None:
        if not self.envs or isinstance(self.envs, str):
            raise ValueError(f"envs must be a non-empty tuple of env names, got {self.envs!r}")
        for name in (*self.envs, *([self.init_from] if self.init_from is not None else [])):
            env_spec(name)
        if self.init_from is not None and self.init_from in SFT_RECIPES:
            if SFT_RECIPES[self.init_from].get("init_from") is not None:
                raise ValueError(f"init_from={self.init_from!r}: that recipe has an init_from itself")
        if any(not 0.0 < p <= 1.0 for _, p in self.downsample):
            raise ValueError(f"downsample keep probabilities must be in (0, 1], got {self.downsample}")
        if self.expert_replays < 1 or not 0.0 <= self.expert_noise < 1.0:
            raise ValueError(
                f"expert_replays must be >= 1 and expert_noise in [0, 1), got {self.expert_replays}, "
                f"{self.expert_noise}"
            )
        if self.select_best_of < 0:
            raise ValueError(f"select_best_of must be >= 0, got {self.select_best_of}")
        no_held_out = [n for n in self.envs if env_spec(n).held_out_tasks is None]
        if self.select_best_of and no_held_out:
            raise ValueError(
                f"select_best_of needs held-out generated tasks; {no_held_out} have none (use select_best_of=0)"
            )
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if not self.context_weight >= 0.0:
            raise ValueError(f"context_weight must be >= 0, got {self.context_weight}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def start(self) -> SFTConfig | None:
        """The config of the checkpoint this one starts from (``init_from``), or ``None`` (bare ``model``)."""
        return None if self.init_from is None else sft_config(self.init_from, model=self.model)

    def key(self) -> str:
        model_key = resolve_model(self.model).name
        start = self.start()
        blob = json.dumps(
            {
                "config": asdict(self),
                "model_dir": model_key,
                "recipe": _RECIPE,
                "start": start.key() if start is not None else None,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _downsample(
    trajectories: Sequence[Trajectory], rules: Sequence[tuple[str, float]], rng: random.Random
) -> None:
    """Add to ``info["untrained_turns"]`` each turn whose action starts with a rule's prefix, unless a draw
    falls under the rule's keep probability (``SFTConfig.downsample``)."""
    if not rules:
        return
    for traj in trajectories:
        untrained = set(traj.info.get("untrained_turns", ()))
        for i, turn in enumerate(traj.turns):
            keep = next((p for prefix, p in rules if turn.action.startswith(prefix)), 1.0)
            if keep < 1.0 and rng.random() >= keep:
                untrained.add(i)
        traj.info["untrained_turns"] = sorted(untrained)


def sequences_of(trajectories: Sequence[Trajectory]) -> list[TokenSequence]:
    """The training sequences of ``trajectories``: those with action tokens, where the turns listed in
    ``info["untrained_turns"]`` (noise, downsampled) are context (mask 0) -- copies; trajectories unchanged."""
    out: list[TokenSequence] = []
    for traj in trajectories:
        sequences = list(traj.sequences)
        for index in traj.info.get("untrained_turns", ()):
            turn = traj.turns[index]
            if turn.sequence < 0 or turn.action_span[0] == turn.action_span[1]:
                continue
            seq = sequences[turn.sequence]
            if seq is traj.sequences[turn.sequence]:  # copy before the first change
                seq = sequences[turn.sequence] = TokenSequence(
                    list(seq.token_ids),
                    list(seq.action_mask),
                    list(seq.rollout_logprobs),
                    list(seq.token_versions),
                )
            for k in range(*turn.action_span):
                seq.action_mask[k], seq.rollout_logprobs[k], seq.token_versions[k] = 0, 0.0, -1
        out.extend(s for s in sequences if s.num_action_tokens)
    return out


def sft_loss(
    model: Any, batch: Sequence[TokenSequence], pad_token_id: int, context_weight: float = 0.0
) -> tuple[torch.Tensor, int]:
    """Mean negative log-likelihood of the action tokens of ``batch`` (right-padded), plus ``context_weight``
    times the mean NLL of its other tokens (``SFTConfig.context_weight``); returns (loss, action tokens).

    Logits are computed only where they are needed (``selected_token_logprobs``): at the positions whose next
    token is an action token, or at every position when ``context_weight`` is non-zero.
    """
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = torch.as_tensor(seq.token_ids)
        attn[row, : len(seq)] = 1
        target[row, : len(seq)] = torch.as_tensor(seq.action_mask, dtype=torch.bool)
    device = next(model.parameters()).device
    select = attn[:, 1:].bool() if context_weight else target[:, 1:]
    lp = selected_token_logprobs(model, ids.to(device), attn.to(device), select.to(device))
    if not context_weight:
        return -lp.mean(), int(lp.numel())
    is_action = target[:, 1:][select].to(device)
    loss = -lp[is_action].mean()
    if not bool(is_action.all()):
        loss = loss - context_weight * lp[~is_action].mean()
    return loss, int(is_action.sum())


def train_sft(
    model: Any,
    sequences: Sequence[TokenSequence],
    config: SFTConfig,
    pad_token_id: int,
    log: Callable[[str], None] = print,
    validate: Callable[[Any], float] | None = None,
) -> list[float]:
    """Behaviour cloning of ``sequences`` into ``model`` (in place); returns the loss of every step.

    With ``validate`` (model -> score, higher is better), it is called after every epoch and the model ends with
    the weights of the best-scoring epoch (the earliest among ties)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    # Batches of similar length waste less compute on padding: sort, chunk, then shuffle the chunks.
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    chunks = [order[i : i + config.batch_size] for i in range(0, len(order), config.batch_size)]
    total = config.epochs * len(chunks)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    rng = random.Random(config.seed)
    losses: list[float] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    model.train()
    started = time.perf_counter()
    for epoch in range(config.epochs):
        rng.shuffle(chunks)
        for chunk in chunks:
            loss, _ = sft_loss(model, [sequences[i] for i in chunk], pad_token_id, config.context_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
        recent = losses[-len(chunks) :]
        message = f"epoch {epoch + 1}/{config.epochs}: loss {sum(recent) / len(recent):.3f}"
        if validate is not None:
            score = validate(model)
            model.train()
            if best is None or score > best[0]:
                best = (score, epoch + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
            message += f", validation {score:.3f} (best: epoch {best[1]})"
        log(f"{message} ({time.perf_counter() - started:.0f}s)")
    if best is not None:
        model.load_state_dict(best[2])
    model.eval()
    return losses


SFT_RECIPES: dict[str, dict[str, Any]] = {
    # Of the variants measured (module doc), the one that imitates the expert best turn by turn and wins most
    # sampled episodes: 1,152 games (the 128 RL trains on and 1,024 more of the same floor plans), 2 epochs,
    # most of the easy, frequent search turns ("go to": 1 in 10 kept, "open": 3 in 10) left as context only,
    # and the context loss (the observations and admissible commands teach copying object names).
    "alfworld": {
        "init_from": "math_tir",
        "synthetic_episodes": 1024,
        "downsample": (("go to ", 0.1), ("open ", 0.3)),
        "epochs": 2,
        "lr": 5e-3,
        "context_weight": 0.3,
    },
    "math_tir": {"synthetic_episodes": 3000, "epochs": 3, "lr": 5e-3, "context_weight": 0.3},
}
"""Per env, the ``SFTConfig`` fields of its measured recipe (rates and times in the module doc)."""


def sft_config(env_name: str, **overrides: Any) -> SFTConfig:
    """The SFT recipe of one env (``SFT_RECIPES``) with ``overrides``: the config of its own checkpoint."""
    env_spec(env_name)
    return SFTConfig(envs=(env_name,), **{**SFT_RECIPES[env_name], **overrides})


def sft_checkpoint(config: SFTConfig | str, log: Callable[[str], None] = print) -> Path:
    """The fine-tuned model directory for ``config`` (or for env name ``config``'s recipe, ``sft_config``),
    trained and cached on first use::

        HFBackend(sft_checkpoint("math_tir"))   # start Math-TIR RL from its SFT checkpoint
    """
    if isinstance(config, str):
        config = sft_config(config)
    base = resolve_model(config.model)
    target = cache_root() / "sft" / f"{base.name}-sft-{config.key()}"
    target.parent.mkdir(parents=True, exist_ok=True)

    def build(out: Path) -> None:
        start = config.start()  # the checkpoint to start from is built (or found) first, under its own lock
        start_dir = None if start is None else sft_checkpoint(start, log)
        tokenizer = load_tokenizer(base)
        sequences: list[TokenSequence] = []
        stats: dict[str, Any] = {}
        for name in config.envs:
            started = time.perf_counter()
            spec = env_spec(name)
            synthetic = config.synthetic_episodes if spec.synthetic_tasks is not None else 0
            noisy = spec.random_action is not None
            trajs = expert_trajectories(
                name,
                tokenizer,
                limit=config.max_expert_episodes or None,
                synthetic=synthetic,
                seed=config.seed,
                replays=config.expert_replays if noisy else 1,
                noise=config.expert_noise if noisy else 0.0,
            )
            _downsample(trajs, config.downsample, random.Random(config.seed))
            seqs = sequences_of(trajs)
            stats[name] = {
                "episodes": len(trajs),
                "sequences": len(seqs),
                "tokens": sum(len(s) for s in seqs),
                "action_tokens": sum(s.num_action_tokens for s in seqs),
                "collect_s": round(time.perf_counter() - started, 1),
            }
            log(f"expert data {name}: {stats[name]}")
            sequences.extend(seqs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = load_model(base if start_dir is None else start_dir)
            started = time.perf_counter()
            if config.lora is not None:
                model = wrap_lora(model, config.lora)
            validation: list[float] = []
            validate = _validator(config, tokenizer, validation) if config.select_best_of else None
            losses = train_sft(model, sequences, config, int(tokenizer.pad_token_id), log, validate)
        if config.lora is not None:
            model = model.merge_and_unload()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        report = {
            "config": asdict(config),
            "base_model": str(base),
            "start": None if start_dir is None else str(start_dir),
            "data": stats,
            "steps": len(losses),
            "validation_by_epoch": validation,
            "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "train_s": round(time.perf_counter() - started, 1),
        }
        (out / "streamrl_sft.json").write_text(json.dumps(report, indent=2, sort_keys=True))

    return build_once(target, build)


def _validator(config: SFTConfig, tokenizer: Any, scores: list[float]) -> Callable[[Any], float]:
    """``model -> mean greedy success`` on ``config.select_best_of`` held-out generated tasks per env
    (``EnvSpec.held_out_tasks``); appends to ``scores``."""
    held_out = {}
    for name in config.envs:
        generate = env_spec(name).held_out_tasks
        assert generate is not None  # SFTConfig checks it
        held_out[name] = generate(config.select_best_of, config.seed)

    def validate(model: Any) -> float:
        backend = HFBackend(model, tokenizer=tokenizer)  # the model as it is, on its own device
        rates = []
        for name, env_kwargs in held_out.items():
            spec = env_spec(name)
            greedy = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=0.0)
            result = evaluate(
                backend, name, spec.train_split, config.select_best_of, greedy, env_kwargs=env_kwargs
            )
            rates.append(result["success_rate"])
        scores.append(sum(rates) / len(rates))
        return scores[-1]

    return validate


# ----------------------------------------------------------------------------------------------------------
# Evaluation


def evaluate(
    backend: HFBackend,
    env_name: str,
    split: str,
    episodes: int,
    sampling: SamplingParams | None = None,
    batch_size: int = 16,
    env_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Success rate of an ``LLMAgent`` on the first ``episodes`` tasks of ``split`` (lock-step batches).

    Episodes run ``batch_size`` at a time, each in its own env, so the backend generates for all of them in
    one call per turn. ``env_kwargs`` go to every env (e.g. ``tasks=`` for a generated task set).
    """
    spec = env_spec(env_name)
    # No per-call seed: a fixed one would replay the same random draws at every turn. The backend's own
    # generator (HFBackendConfig.seed) makes the run reproducible instead.
    sampling = sampling or SamplingParams(max_new_tokens=spec.max_new_tokens)
    agent = LLMAgent(backend, prompt_format=spec.prompt(), sampling=sampling, context=spec.context)
    extra = dict(env_kwargs or {})
    probe = make_env(env_name, split, **extra)
    task_ids = task_ids_of(probe, env_name)[:episodes]
    envs = [probe] + [make_env(env_name, split, **extra) for _ in range(min(batch_size, len(task_ids)) - 1)]
    wins, steps, valid, started = 0, 0, 0, time.perf_counter()
    try:
        for start in range(0, len(task_ids), len(envs)):
            batch = task_ids[start : start + len(envs)]
            live: dict[int, tuple[str, dict[str, Any]]] = {}
            for slot, task_id in enumerate(batch):
                live[slot] = envs[slot].reset(options={"task_id": task_id})
            while live:
                slots = sorted(live)
                actions = agent.act([live[s][0] for s in slots], [live[s][1] for s in slots], slots)
                for slot, action in zip(slots, actions, strict=True):
                    obs, _, terminated, truncated, info = envs[slot].step(action)
                    steps += 1
                    valid += bool(info.get("action_valid", True))
                    if terminated or truncated:
                        wins += bool(info.get("won", False))
                        agent.end_episode(slot)
                        del live[slot]
                    else:
                        live[slot] = (obs, info)
    finally:
        for env in envs:
            env.close()
    return {
        "env": env_name,
        "split": split,
        "episodes": len(task_ids),
        "success_rate": wins / max(1, len(task_ids)),
        "valid_action_rate": valid / max(1, steps),
        "mean_steps": steps / max(1, len(task_ids)),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m streamrl.agents.sft"
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--envs",
        nargs="+",
        default=sorted(ENV_SPECS),
        choices=sorted(ENV_SPECS),
        help="one checkpoint per env, each with its recipe (SFT_RECIPES), unless --joint",
    )
    parser.add_argument("--joint", action="store_true", help="one checkpoint trained on all --envs together")
    # Recipe overrides (default: the env's recipe): one flag per SFTConfig field of that name.
    recipe_fields = {
        "epochs": int,
        "lr": float,
        "batch_size": int,
        "max_expert_episodes": int,
        "synthetic_episodes": int,
        "expert_replays": int,
        "expert_noise": float,
        "context_weight": float,
        "seed": int,
        "select_best_of": int,
    }
    for name, kind in recipe_fields.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=None, help="default: the env's recipe")
    parser.add_argument("--eval-episodes", type=int, default=64, help="per split; 0 skips evaluation")
    parser.add_argument("--baseline", action="store_true", help="also evaluate the untrained model")
    parser.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="evaluation sampling temperature(s) (0 = greedy)",
    )
    parser.add_argument(
        "--eval-batch", type=int, default=32, help="episodes played concurrently in evaluation"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = {k: getattr(args, k) for k in recipe_fields if getattr(args, k) is not None}
    overrides["model"] = args.model
    if args.joint:
        configs = [SFTConfig(envs=tuple(args.envs), **overrides)]
    else:
        configs = [sft_config(name, **overrides) for name in args.envs]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report: dict[str, Any] = {"checkpoints": []}
    for config in configs:
        started = time.perf_counter()
        path = sft_checkpoint(config, log)
        entry: dict[str, Any] = {
            "checkpoint": str(path),
            "sft": json.loads((path / "streamrl_sft.json").read_text()),
            "checkpoint_s": round(time.perf_counter() - started, 1),
            "eval": [],
        }
        report["checkpoints"].append(entry)
        if not args.eval_episodes:
            continue
        models = [("sft", str(path))] + (
            [("untrained", str(resolve_model(config.model)))] if args.baseline else []
        )
        for label, model_dir in models:
            backend = HFBackend(model_dir, config=HFBackendConfig(device="cpu"))
            for name in config.envs:
                spec = env_spec(name)
                for temperature in args.temperature:
                    for split in (spec.train_split, *spec.eval_splits):
                        sampling = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=temperature)
                        result = evaluate(backend, name, split, args.eval_episodes, sampling, args.eval_batch)
                        result["model"] = label
                        result["temperature"] = temperature
                        log(json.dumps(result))
                        entry["eval"].append(result)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
