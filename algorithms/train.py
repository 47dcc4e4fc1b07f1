"""``streamrl train``: the single-stream trainer that runs every algorithm (SPO, SPO++, GRPO, SAO, yours).

One loop, in the order the data flows::

    dispatch   the tracker samples tasks (prioritized for SPO/SPO++), freezes baselines on tickets; admission
               keeps dispatched - dropped <= (max_staleness + k + 1) * B * P at version k (AReaL's rule)
    roll out   Rollouts: episodes on the streaming vector env, their turns batched through the backend
    file       the algorithm files outcomes in the tracker when episodes return (SPO++) or after the update (SPO)
    batch      the algorithm's batch rule forms an update batch of B episodes; before a publication, episodes
               that would exceed max_staleness are trained first and in-flight ones are waited for
    learn      advantages -> Learner.update (micro-batched, global token count) -> publish every P updates
    publish    save the policy (adapter or weights) + probe, load it into the backend, check the served
               log-probs on the probe against the learner's, then advance the tracker's clock

Generation and learning alternate with the in-process HF backend (one process, and the CPU is shared); with
a backend in another process (vLLM) generation goes on while the learner updates (``overlap``).

The run directory holds ``config.json``, ``metrics.jsonl`` (one row per update, with a periodic evaluation on
fixed held-out tasks -- its per-episode records in ``evals/update-<n>.jsonl``, and from the second on its
paired difference to the first -- and the closed ledger), TensorBoard event files, ``policy/v<k>`` (published versions,
the last few kept), and ``checkpoint/`` (learner, optimizer, scheduler, tracker, algorithm, buffer, tickets
in flight, counters, RNG; ``checkpoint.old/`` while a new one takes its place). ``resume=True`` continues a
killed run from its last complete checkpoint: every ticket that was in flight is played again,
finished-but-untrained episodes are kept.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from streamrl.agents.base import GenerationBackend, SamplingParams, derive_seed
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.base import Algorithm, Episode, SetupContext, algorithm_class, make_algorithm
from streamrl.algorithms.learner import Learner, LearnerConfig
from streamrl.algorithms.runtime import Finished, Job, Rollouts, collect
from streamrl.algorithms.tracker import EventTracker, Ticket
from streamrl.evaluation.stats import clustered_t_interval, t_interval
from streamrl.utils.cache import atomic_write_text

if TYPE_CHECKING:
    from streamrl.envs.vector import VectorEnvConfig
    from streamrl.sft import SFTConfig

BackendName = Literal["hf", "vllm"]
Init = Literal["sft", "base"]
EnvWorkers = Literal["subprocess", "inprocess"]
Cluster = Literal["local", "ray"]
PLACEMENT = (
    "cluster",
    "address",
    "env_actors",
    "env_actor_cpus",
    "rollout_engines",
    "engine_cpus",
    "engine_gpus",
    "learner_cpus",
    "learner_gpus",
)
"""TrainConfig fields that say where the work runs, not what is trained: a run may resume elsewhere."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; saved as the run's ``config.json`` (resume checks it)."""

    out: str = ""
    """Run directory (required)."""
    env: str = "math_tir"
    """``"math_tir"``, ``"alfworld"``, or a name given to ``agents.env_specs.register_env_spec``."""
    algo: str = "spo++"
    """``spo``, ``spo++``, ``grpo``, ``sao``, or ``module:Class`` / ``file.py:Class`` for your own."""
    model: str = "tiny"
    """Registry name (``tiny``, ``smollm2-135m``) or a local Hugging Face directory."""
    init: Init = "sft"
    """``"sft"``: start from the model's SFT checkpoint for ``env`` (built and cached on first use);
    ``"base"``: from ``model`` as it is."""
    sft: Mapping[str, Any] = field(default_factory=dict)
    """``init="sft"``: overrides of the env's SFT recipe (``SFTConfig`` fields over ``SFTConfig.for_env``, e.g.
    ``{"seed": 1}``), so the run starts from that recipe's checkpoint; empty = the preset's."""
    backend: BackendName = "hf"
    """Rollout backend: ``"hf"`` (in-process transformers) or ``"vllm"`` (needs LoRA)."""
    updates: int = 60
    """Policy updates to run."""
    batch: int = 64
    """B: trajectories per update (SPO++ paper: 128)."""
    num_envs: int = 16
    """Episodes in flight at once (sub-envs of the vector env)."""
    max_staleness: int = 1
    """S: a trained token is at most S versions older than the policy trained (0 = synchronous trainer)."""
    tasks: int | None = None
    """Train on the first N tasks of the training split (``None`` = all)."""
    offline_rollouts: int = 8
    """n_0: rollouts per task of the initial policy that initialize the prompt values (0 = uniform prior)."""
    temperature: float = 1.0
    """Rollout sampling temperature (the learner scores under the same temperature)."""
    constrain_actions: bool = False
    """Rollouts and evaluations choose among the env's actions (``LLMAgent(constrain_actions=True)``: the prompt
    format's ``action_choices``, ALFWorld's admissible commands); the learner scores the renormalized policy
    they sample from. HF backend only."""
    avoid_repeats: bool = False
    """With ``constrain_actions``: no command twice from one state (``LLMAgent(avoid_repeats=True)``). Each
    turn's choices leave out the commands the episode already took from the same observation and choices,
    unless none would be left; the learner scores that reduced set, the policy the rollouts sampled from."""
    max_new_tokens: int | None = None
    """Tokens per turn; ``None`` = the env's default."""
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env over its spec's (e.g. ``{"max_steps": 8}``: shorter ALFWorld episodes);
    the training, offline-value and evaluation envs all get them."""
    eval_every: int = 10
    """Updates between held-out evaluations (0 = none); one runs before the first update and at the end."""
    eval_episodes: int = 64
    """Held-out episodes per evaluation: fixed tasks, drawn uniformly once per run."""
    eval_split: str | None = None
    """Held-out split; ``None`` = the env's first evaluation split."""
    eval_temperature: float = 1.0
    """Sampling temperature of the evaluation (0 = greedy)."""
    checkpoint_every: int = 10
    """Updates between checkpoints (also on SIGINT/SIGTERM and at the end)."""
    keep_versions: int = 3
    """Published policy versions kept on disk (at least max_staleness + 1)."""
    overlap: bool | None = None
    """Generate while the learner updates; ``None`` = only with an out-of-process backend (vLLM, Ray engines)."""
    env_workers: EnvWorkers = "subprocess"
    """Vector env workers: ``"subprocess"`` (default) or ``"inprocess"`` (debugging); with ``cluster="ray"``
    they are Ray actors."""
    cluster: Cluster = "local"
    """Where env workers, rollout engines and learner ranks 1..R-1 run: ``"local"`` (this process and its
    subprocesses) or ``"ray"`` (Ray actors on the cluster at ``address``: README "Scaling out"). The runtime and
    learner rank 0 run in this process."""
    address: str | None = None
    """``cluster="ray"``: the Ray cluster to join (``ray start --head`` prints it; ``"auto"``: the cluster this
    node belongs to); ``None``: start a local Ray instance (or join the one ``RAY_ADDRESS`` names)."""
    env_actors: int | None = None
    """``cluster="ray"``: Ray actors hosting the ``num_envs`` sub-envs, which they share evenly (it must divide
    ``num_envs``); ``None``: one per sub-env."""
    env_actor_cpus: float = 1.0
    """``cluster="ray"``: CPUs Ray reserves for each env actor."""
    rollout_engines: int = 1
    """Rollout engines (``cluster="ray"``: Ray actors, each a ``backend`` engine with its own copy of the model;
    each request goes to the least loaded). Must be 1 with ``cluster="local"``."""
    engine_cpus: float = 1.0
    """``cluster="ray"``: CPUs Ray reserves for each rollout engine."""
    engine_gpus: float = 0.0
    """``cluster="ray"``: GPUs Ray gives each rollout engine (0: CPU engines; a fraction packs several on a GPU)."""
    threads: int = 1
    """torch threads of the trainer process (and of each other learner rank's)."""
    learner_ranks: int = 1
    """Data-parallel learner ranks (``streamrl.algorithms.distributed``): the trainer's process is rank 0; the
    others are processes it starts on this machine (one GPU each on CUDA, NCCL; gloo on CPU), or with
    ``cluster="ray"`` Ray actors on any node (``learner_cpus``, ``learner_gpus``; ``streamrl.algorithms.ray_ranks``).
    Each trains a shard of every update batch with the batch's global loss counts, so the update is the
    single-rank one. At most ``batch``; a resumed run may change it."""
    learner_cpus: float = 1.0
    """``cluster="ray"``: CPUs Ray reserves for each learner rank 1..R-1 (its torch threads are ``threads``)."""
    learner_gpus: int = 0
    """``cluster="ray"``: GPUs Ray gives each learner rank 1..R-1: 0 (CPU ranks, gloo) or 1 (NCCL; rank 0, this
    process, must then run the learner on a GPU of its own, which Ray does not place)."""
    seed: int = 0
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the algorithm's config fields (e.g. ``{"dual_clip_c": 3.0, "publish_every": 1}``), laid
    over the algorithm's preset for ``env`` (SPO++ publishes every update on ALFWorld, every two on Math-TIR)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["algorithm"] = dict(self.algorithm)
        data["env_kwargs"] = dict(self.env_kwargs)
        data["sft"] = dict(self.sft)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            why = ""
            if {"top_p", "top_k"} & set(unknown):
                why = (
                    " (rollouts sample the full softmax at `temperature`: the learner scores that distribution, "
                    "and a truncated one (top-p < 1, top-k) would make the importance ratio pi_old/pi_rollout wrong)"
                )
            raise ValueError(f"unknown train config key(s) {unknown}{why}; valid: {sorted(valid)}")
        values = dict(data)
        if isinstance(values.get("learner"), Mapping):
            learner = dict(values["learner"])
            lvalid = {f.name for f in fields(LearnerConfig)}
            bad = sorted(set(learner) - lvalid)
            if bad:
                raise ValueError(f"unknown learner config key(s) {bad}; valid: {sorted(lvalid)}")
            if isinstance(learner.get("lora_target_modules"), list):
                learner["lora_target_modules"] = tuple(learner["lora_target_modules"])
            values["learner"] = LearnerConfig(**learner)
        return cls(**values)


class ConfigError(ValueError):
    """A training config that cannot run; raised before any work starts."""


def initial_model_dir(
    model: str,
    init: Init,
    env: str,
    log: Callable[[str], None] = print,
    sft: Mapping[str, Any] | None = None,
) -> Path:
    """The model directory a run of ``env`` starts from: ``model``'s SFT checkpoint for ``env`` (``init="sft"``,
    its preset with the ``sft`` overrides, built and cached on first use) or ``model`` as it is
    (``init="base"``). A run's version 0 is this model, so evaluating a run's start (``streamrl eval``)
    resolves it here too."""
    from streamrl.agents.models import resolve_model

    if init == "sft":
        from streamrl.sft import sft_checkpoint

        return Path(sft_checkpoint(sft_recipe(model, env, sft or {}), log=log))
    if init != "base":
        raise ValueError(f"init must be 'sft' or 'base', got {init!r}")
    if sft:
        raise ValueError(f"sft overrides {dict(sft)} need init='sft', got init={init!r}")
    return Path(resolve_model(model))


def sft_recipe(model: str, env: str, overrides: Mapping[str, Any]) -> SFTConfig:
    """``SFTConfig.for_env(env, model=model, **overrides)``, with an unknown or invalid override named."""
    from dataclasses import fields as dataclass_fields

    from streamrl.sft import SFTConfig

    valid = {f.name for f in dataclass_fields(SFTConfig)} - {"model"}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown sft override(s) {unknown}; SFTConfig fields: {sorted(valid)}")
    return SFTConfig.for_env(env, model=model, **overrides)


# ---------------------------------------------------------------------------------------------------------
# Ledger: every dispatched trajectory and every generated action token is accounted for
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Ledger:
    """Closes in trajectories and in action tokens: dispatched = trained + dropped_stale + dropped_group + failed +
    buffered + in flight, and generated_tokens = trained + dropped + failed + buffered + in-flight tokens."""

    dispatched: int = 0
    finished: int = 0
    trained: int = 0
    dropped_stale: int = 0
    """Finished after their version was superseded (``current-version`` rule): filed in the tracker, not trained."""
    dropped_group: int = 0
    """Whole groups without reward variance (DAPO) or with too few members left."""
    failed: int = 0
    """Ended by an env worker failure (``info["error"]``): neither filed nor trained."""
    generated_tokens: int = 0
    """Counted as the backend generates them (``Rollouts.generated_tokens``), independently of the rest; the
    tokens of episodes in flight at a checkpoint are not carried over (a resumed run plays them again)."""
    trained_tokens: int = 0
    dropped_tokens: int = 0
    failed_tokens: int = 0

    def row(
        self, buffered: int, buffered_tokens: int, in_flight: int, in_flight_tokens: int
    ) -> dict[str, int]:
        return {
            **{f"ledger/{k}": v for k, v in asdict(self).items()},
            "ledger/buffered": buffered,
            "ledger/in_flight": in_flight,
            "ledger/buffered_tokens": buffered_tokens,
            "ledger/in_flight_tokens": in_flight_tokens,
        }


class PublishError(RuntimeError):
    """The backend did not serve the policy the learner published."""


# ---------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------


class Trainer:
    """Builds everything a ``TrainConfig`` names and runs it (``Trainer(config).run()``)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        algorithm: Algorithm | None = None,
        backend: GenerationBackend | None = None,
        on_update: Callable[[int, Sequence[Episode]], None] | None = None,
        resume: bool = False,
        log: Callable[[str], None] = print,
        progress: bool = True,
    ) -> None:
        """``backend``: serve rollouts with this backend (e.g. ``streamrl.agents.latency.LatencyBackend``)
        instead of the one ``config.backend`` names; it must serve the model's tokenizer and accept the
        published policy (``set_adapter``, ``score``, and ``.model`` for fully fine-tuned weights). The trainer
        closes it. ``on_update(version, batch)``: called before each update with the policy version the update
        starts from and the episodes it trains (tests, benchmarks, custom logging)."""
        self.log = log
        self.show_progress = progress
        self._given_backend = backend
        self.on_update = on_update
        if algorithm is not None:
            self._check_given_algorithm(config, algorithm)
        self.algorithm = algorithm if algorithm is not None else self._make_algorithm(config)
        self.config = config
        self.run_dir = Path(config.out)
        self._validate(resume)
        torch.set_num_threads(config.threads)
        self._stop = threading.Event()
        self._resumed = False
        self._checkpoint_version = 0
        """The policy version the last checkpoint serves: kept on disk whatever ``keep_versions`` says."""
        try:
            self._build()
            checkpoint = self._last_checkpoint() if resume else None
            if checkpoint is not None:
                self._load_checkpoint(checkpoint)
                self._resumed = True
            elif resume:  # killed before its first checkpoint: it starts over
                self._truncate_metrics(-1)
        except BaseException:
            self.close()  # what was built before the error: learner ranks, engines, env workers, Ray
            raise

    # -- validation -----------------------------------------------------------------------------------------
    @staticmethod
    def _check_given_algorithm(config: TrainConfig, algorithm: Algorithm) -> None:
        """A ready-made algorithm must be the one ``config.algo`` names (the run's config.json rebuilds it on
        resume), and its options live in its own config, not in ``config.algorithm``."""
        try:
            named = algorithm_class(config.algo)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(str(exc)) from exc
        if type(algorithm) is not named:
            raise ConfigError(
                f"config.algo={config.algo!r} names {named.__qualname__}, but the algorithm given is a "
                f"{type(algorithm).__qualname__}: set algo to its registry name or 'file.py:Class'"
            )
        if config.algorithm:
            raise ConfigError(
                f"config.algorithm overrides {sorted(config.algorithm)} are ignored when an algorithm object is "
                "given: put them in its config"
            )

    def _make_algorithm(self, config: TrainConfig) -> Algorithm:
        try:
            return make_algorithm(config.algo, env=config.env, **dict(config.algorithm))
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise ConfigError(str(exc)) from exc

    def _validate(self, resume: bool) -> None:
        from streamrl.agents.env_specs import ENV_SPECS

        c = self.config
        if not c.out:
            raise ConfigError("out (the run directory) is required, e.g. out='runs/spo_pp-math'")
        if c.env not in ENV_SPECS:
            raise ConfigError(f"unknown env {c.env!r}; valid: {sorted(ENV_SPECS)}")
        if c.backend not in ("hf", "vllm"):
            raise ConfigError(f"unknown backend {c.backend!r}; valid: 'hf', 'vllm'")
        if c.init not in ("sft", "base"):
            raise ConfigError(f"init must be 'sft' or 'base', got {c.init!r}")
        if c.sft:
            if c.init != "sft":
                raise ConfigError(f"sft overrides {dict(c.sft)} need init='sft', got init={c.init!r}")
            try:
                sft_recipe(c.model, c.env, c.sft)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"sft={dict(c.sft)}: {exc}") from exc
        from streamrl.agents.models import resolve_model

        try:
            resolve_model(c.model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in (
            "updates",
            "batch",
            "num_envs",
            "threads",
            "keep_versions",
            "learner_ranks",
            "rollout_engines",
        ):
            if getattr(c, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(c, name)}")
        self._validate_cluster()
        for name in ("max_staleness", "offline_rollouts", "eval_every", "eval_episodes", "checkpoint_every"):
            if getattr(c, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(c, name)}")
        if c.learner.sharding == "fsdp" and c.learner_ranks < 2:
            raise ConfigError(
                f"learner.sharding='fsdp' shards the policy over learner ranks: it needs learner_ranks >= 2, got "
                f"{c.learner_ranks} (one rank holds the whole model: use sharding='replicate')"
            )
        if c.learner_ranks > c.batch:
            raise ConfigError(
                f"learner_ranks={c.learner_ranks} is more than the batch ({c.batch} trajectories): every rank needs "
                "at least one trajectory of each update; use learner_ranks <= batch"
            )
        if c.keep_versions < c.max_staleness + 1:
            raise ConfigError(
                f"keep_versions={c.keep_versions} must be >= max_staleness + 1 = {c.max_staleness + 1}"
            )
        if c.temperature <= 0:
            raise ConfigError(
                f"temperature must be > 0 for RL (the learner scores the sampling policy), got {c.temperature}"
            )
        if c.batch < self.algorithm.min_batch:
            raise ConfigError(
                f"batch={c.batch} is too small for {self.algorithm.name}: its advantages are standardized over "
                f"the batch, which needs batch >= {self.algorithm.min_batch}"
            )
        g = self.algorithm.config.group_size
        if self.algorithm.config.batch_rule == "groups":
            if c.batch % g:
                raise ConfigError(
                    f"batch={c.batch} must be a multiple of {self.algorithm.name}'s group_size={g}"
                )
            if c.num_envs < g:
                raise ConfigError(f"num_envs={c.num_envs} cannot hold one group of group_size={g}")
        elif g != 1:
            raise ConfigError(f"group_size={g} needs batch_rule='groups'")
        if c.constrain_actions and c.backend == "vllm":
            raise ConfigError(
                "constrain_actions=True needs the hf backend: vLLM's structured outputs are not the token-level "
                "constraint the learner rescores"
            )
        if c.constrain_actions and not ENV_SPECS[c.env].lists_actions:
            raise ConfigError(
                f"constrain_actions=True: the {c.env} env's prompt format has no action_choices to choose among"
            )
        if c.avoid_repeats and not c.constrain_actions:
            raise ConfigError("avoid_repeats=True needs constrain_actions=True: it removes choices")
        if c.backend == "vllm" and c.learner.finetune == "full":
            raise ConfigError(
                "the vllm backend loads LoRA adapters; use learner.finetune='lora' (or 'auto' on a large model)"
            )
        config_file = self.run_dir / "config.json"
        if config_file.is_file():
            saved = json.loads(config_file.read_text())
            if not resume:
                raise ConfigError(
                    f"{self.run_dir} already holds a run; pass resume=True (--resume) or another out"
                )
            mine = json.loads(json.dumps(self.config.to_dict()))
            # saved before the field: it started from the preset of its time, which the checkpoint cannot tell
            # (no "start" in its state either), so it resumes only with the preset
            saved.setdefault("sft", {})
            saved.setdefault("constrain_actions", False)  # saved before the field: unconstrained
            saved.setdefault("avoid_repeats", False)  # saved before the field: repeats allowed
            for values in (saved, mine):  # how the ranks hold the policy is placement: checkpoints are full
                (values.get("learner") or {}).pop("sharding", None)
            changed = sorted(
                k
                for k in set(saved) | set(mine)
                if saved.get(k) != mine.get(k) and k not in ("updates", "learner_ranks", *PLACEMENT)
            )
            if changed:
                diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in changed)
                raise ConfigError(f"cannot resume {self.run_dir} with a different config ({diffs})")

    def _validate_cluster(self) -> None:
        c = self.config
        if c.cluster not in ("local", "ray"):
            raise ConfigError(f"cluster must be 'local' or 'ray', got {c.cluster!r}")
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        if c.cluster == "local":
            given = [f"{k}={getattr(c, k)!r}" for k in PLACEMENT[1:] if getattr(c, k) != defaults[k]]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} apply to cluster='ray' only; this run has cluster='local'"
                )
            return
        if c.env_workers == "inprocess":
            raise ConfigError(
                "env_workers='inprocess' is for cluster='local'; with cluster='ray' envs run in Ray actors"
            )
        if c.env_actors is not None and not (
            1 <= c.env_actors <= c.num_envs and c.num_envs % c.env_actors == 0
        ):
            raise ConfigError(
                f"env_actors={c.env_actors} must divide num_envs={c.num_envs} (each actor hosts num_envs / "
                "env_actors sub-envs)"
            )
        for name in ("env_actor_cpus", "engine_cpus", "engine_gpus"):
            if not getattr(c, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(c, name)}")
        if not c.learner_cpus > 0:
            raise ConfigError(f"learner_cpus must be > 0 (a learner rank computes), got {c.learner_cpus}")
        if c.learner_gpus not in (0, 1):
            raise ConfigError(
                f"learner_gpus must be 0 (CPU ranks) or 1 (a GPU per rank: a rank computes on one), "
                f"got {c.learner_gpus}"
            )
        if c.learner_ranks == 1 and (c.learner_cpus, c.learner_gpus) != (defaults["learner_cpus"], 0):
            raise ConfigError(
                f"learner_cpus={c.learner_cpus!r}, learner_gpus={c.learner_gpus!r} are the resources of learner "
                "ranks 1..R-1 (Ray actors); this run has learner_ranks=1 (its learner is this process)"
            )
        from streamrl.utils.ray import require_ray

        try:
            require_ray()
        except ImportError as exc:
            raise ConfigError(f"cluster='ray' needs Ray: {exc}") from exc

    # -- construction ----------------------------------------------------------------------------------------
    def _build(self) -> None:
        from streamrl.agents.env_specs import env_spec, make_env, task_ids_of
        from streamrl.agents.models import load_model, load_tokenizer
        from streamrl.envs.vector import StreamingVectorEnv

        c = self.config
        self.spec = env_spec(c.env)
        self.model_dir = initial_model_dir(c.model, c.init, c.env, log=self.log, sft=c.sft)
        self.tokenizer = load_tokenizer(self.model_dir)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, "learner"))
            policy = load_model(self.model_dir)
        self._ray_connected = False
        if c.cluster == "ray":  # before the learner: its ranks may be Ray actors
            from streamrl.utils.ray import connect

            self._ray_connected = connect(c.address)  # and so this trainer disconnects at close()
        total_steps = c.updates * c.learner.mini_batches * c.learner.epochs
        if c.learner_ranks > 1:
            from streamrl.algorithms.distributed import DistributedLearner, LearnerSpec

            spec = LearnerSpec(
                str(self.model_dir),
                c.learner,
                pad_token_id=int(self.tokenizer.pad_token_id),
                total_steps=total_steps,
                temperature=c.temperature,
                algorithm=c.algo,
                threads=c.threads,
            )
            if c.cluster == "ray":
                from streamrl.algorithms.ray_ranks import RayRanks

                ranks = RayRanks(num_cpus=c.learner_cpus, num_gpus=c.learner_gpus)
                try:
                    self.learner = DistributedLearner(
                        policy, spec, c.learner_ranks, init_method=ranks.init_method(), start_rank=ranks
                    )
                except ValueError as exc:  # the ranks' devices do not fit rank 0's
                    raise ConfigError(str(exc)) from exc
            else:
                self.learner = DistributedLearner(policy, spec, c.learner_ranks)
        else:
            self.learner = Learner(
                policy,
                c.learner,
                pad_token_id=int(self.tokenizer.pad_token_id),
                total_steps=total_steps,
                temperature=c.temperature,
            )
        context = SetupContext(
            model_dir=self.model_dir,
            device=self.learner.device,
            pad_token_id=int(self.tokenizer.pad_token_id),
            tokenizer=self.tokenizer,
            micro_batch_tokens=c.learner.micro_batch_tokens,
            seed=derive_seed(c.seed, "algorithm"),
            log=self.log,
        )
        try:
            self.algorithm.setup(context)
        except ValueError as exc:  # e.g. SAO's critic_init does not fit the starting model
            raise ConfigError(f"{self.algorithm.name}: {exc}") from exc
        self.backend = self._given_backend if self._given_backend is not None else self._make_backend()
        max_new = c.max_new_tokens or self.spec.max_new_tokens
        self.sampling = SamplingParams(
            temperature=c.temperature, max_new_tokens=max_new, seed=derive_seed(c.seed, "sampling")
        )
        self.agent = self.spec.llm_agent(
            self.backend,
            self.sampling,
            constrain_actions=c.constrain_actions,
            avoid_repeats=c.avoid_repeats,
            tokenizer=self.tokenizer,
        )

        try:
            probe_env = make_env(c.env, self.spec.train_split, **dict(c.env_kwargs))
        except TypeError as exc:
            raise ConfigError(f"env_kwargs={dict(c.env_kwargs)} do not fit the {c.env} env: {exc}") from exc
        task_ids = task_ids_of(probe_env, c.env)
        probe_env.close()
        if c.tasks is not None:
            if c.tasks < 1 or c.tasks > len(task_ids):
                raise ConfigError(
                    f"tasks={c.tasks} must be in [1, {len(task_ids)}] (the {c.env} training tasks)"
                )
            task_ids = task_ids[: c.tasks]
        if self.algorithm.config.batch_rule != "groups" and c.batch > len(task_ids):
            raise ConfigError(
                f"batch={c.batch} is larger than the task set ({len(task_ids)} tasks): with one request in flight "
                "per task a batch could never fill; lower batch or raise tasks"
            )
        self.task_ids = task_ids
        self.tracker = EventTracker(task_ids, self.algorithm.tracker_config(derive_seed(c.seed, "tracker")))
        env_kwargs = {**self.spec.env_kwargs, **c.env_kwargs}
        self.venv = StreamingVectorEnv.from_env(
            self.spec.gym_id, c.num_envs, config=self._workers(), split=self.spec.train_split, **env_kwargs
        )
        lockstep = c.max_staleness == 0
        self.rollouts = Rollouts(
            self.venv, self.agent, seed=derive_seed(c.seed, "rollouts"), lockstep=lockstep
        )
        self.overlap = c.overlap if c.overlap is not None else (c.backend == "vllm" or c.cluster == "ray")
        self.eval_split = c.eval_split or self.spec.eval_splits[0]
        self.eval_tasks = self._eval_tasks()
        # state
        self.updates = 0
        self.ledger = Ledger()
        self.buffer: list[Episode] = []
        self.queued: list[Job] = []  # tickets to (re)start before sampling new ones (resume)
        self.groups: dict[int, list[Episode]] = {}
        self.group_sizes: dict[int, int] = {}
        self.next_group = 0
        self.generator_busy = 0.0
        self.learner_busy = 0.0
        self.started = time.perf_counter()
        self._slots_at_row = (self.started, 0.0)  # (time, occupied slot-seconds) at the previous row
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.probe = self._probe_sequence()

    def _make_backend(self) -> Any:
        from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
        from streamrl.agents.vllm_backend import VLLMBackend, VLLMBackendConfig

        c = self.config
        config: HFBackendConfig | VLLMBackendConfig
        if c.backend == "vllm":
            config = VLLMBackendConfig(
                max_lora_rank=c.learner.lora_rank, max_loras=c.keep_versions, seed=c.seed
            )
        else:  # an engine actor takes the device Ray gave it
            config = HFBackendConfig(device=c.learner.device if c.cluster == "local" else "auto", seed=c.seed)
        if c.cluster == "ray":
            from streamrl.agents.ray_engines import RayEngines

            resources = {"num_cpus": c.engine_cpus, "num_gpus": c.engine_gpus}
            return RayEngines(
                self.model_dir,
                config,
                engines=c.rollout_engines,
                actor_options=resources,
                tokenizer=self.tokenizer,
            )
        if isinstance(config, VLLMBackendConfig):
            return VLLMBackend(str(self.model_dir), config=config)
        # The rollout backend has weights of its own: what it serves changes only at publication.
        return HFBackend(self.model_dir, tokenizer=self.tokenizer, config=config)

    def _workers(self) -> VectorEnvConfig:
        """How the sub-envs are hosted (``VectorEnvConfig``): local worker processes, or Ray actors."""
        from streamrl.envs.vector import VectorEnvConfig

        c = self.config
        if c.cluster == "local":
            return VectorEnvConfig(backend=c.env_workers)
        per_actor = c.num_envs // (c.env_actors or c.num_envs)
        return VectorEnvConfig(
            backend="ray", envs_per_worker=per_actor, ray_actor_options={"num_cpus": c.env_actor_cpus}
        )

    def _eval_tasks(self) -> list[str]:
        """The fixed held-out episodes: every task of the split equally often (each ``n // tasks`` times), the
        remainder drawn uniformly without replacement; the same list for every run with the same seed."""
        from streamrl.agents.env_specs import make_env, task_ids_of

        if not self.config.eval_episodes or not self.config.eval_every:
            return []
        env = make_env(self.config.env, self.eval_split, **dict(self.config.env_kwargs))
        ids = task_ids_of(env, self.config.env)
        env.close()
        n = self.config.eval_episodes
        rng = random.Random(derive_seed(self.config.seed, "eval-tasks"))
        return ids * (n // len(ids)) + rng.sample(ids, n % len(ids))

    def _probe_sequence(self) -> list[int]:
        """A fixed token sequence on which the served and the learner's log-probs must agree after publication."""
        prompt = self.agent.chat.render([{"role": "user", "content": "What is 6 times 7? Use the tool."}])
        tail = self.tokenizer.encode(" The answer is \\boxed{42}.", add_special_tokens=False)
        return list(prompt) + list(tail)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train for ``config.updates`` updates (from where a resumed run left off); returns a summary."""
        c = self.config
        (self.run_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2, sort_keys=True))
        previous_handlers = self._install_signals()
        writer = self._tensorboard()
        bar = self._progress_bar()
        last_eval = "-"  # the bar shows the latest held-out success
        try:
            if not self._resumed:
                self._offline_init()
                if self.eval_tasks:
                    first = self._evaluate()
                    self._write_metrics({"update": 0, **first}, writer)
                    last_eval = f"{first['eval/success']:.3f} (update 0)"
            pool = ThreadPoolExecutor(1) if self.overlap else None
            while self.updates < c.updates and not self._stop.is_set():
                batch = self._next_batch()
                if batch is None:
                    break
                row = self._train_on(batch, pool)
                if (
                    c.eval_every
                    and self.eval_tasks
                    and (self.updates % c.eval_every == 0 or self.updates == c.updates)
                ):
                    row.update(self._evaluate())
                self._write_metrics(row, writer)
                if "eval/success" in row:
                    last_eval = f"{row['eval/success']:.3f} (update {self.updates})"
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(batch_success=f"{row['batch/success']:.2f}", held_out=last_eval)
                if c.checkpoint_every and self.updates % c.checkpoint_every == 0:
                    self._save_checkpoint()
            self._save_checkpoint()
        finally:
            for sig, handler in previous_handlers.items():  # a finished run no longer owns Ctrl-C
                signal.signal(sig, handler)
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
            self.close()
        return {"updates": self.updates, "run_dir": str(self.run_dir), "interrupted": self._stop.is_set()}

    def close(self) -> None:
        """Release the env workers, the backend, the learner (and its ranks) and a Ray connection this trainer
        made; also what a build that failed part-way had started."""
        for name in ("venv", "backend", "learner"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        if getattr(self, "_ray_connected", False):
            import ray

            ray.shutdown()

    # -- dispatch and rollout ----------------------------------------------------------------------------------
    def _capacity(self) -> int:
        """How many more trajectories admission allows now (AReaL's rule, in trajectories)."""
        c = self.config
        per_version = c.batch * self.algorithm.config.publish_every
        dropped = self.ledger.dropped_stale + self.ledger.dropped_group + self.ledger.failed
        allowed = (c.max_staleness + self.tracker.version + 1) * per_version + dropped
        return allowed - self.ledger.dispatched

    def _dispatch(self) -> None:
        free = self.rollouts.free_slots
        if self.queued:  # requeued tickets (resume) first
            again, self.queued = self.queued[:free], self.queued[free:]
            self.rollouts.start(again)
            free -= len(again)
        room = min(free, self._capacity())
        g = self.algorithm.config.group_size if self.algorithm.config.batch_rule == "groups" else 1
        room -= room % g
        if room <= 0:
            return
        busy = {t.task_id for t in self.tracker.in_flight} if g == 1 else set()
        candidates = [t for t in self.task_ids if t not in busy]
        tasks = self.tracker.sample(room // g, candidates=candidates, strict=False)
        jobs: list[Job] = []
        for task in tasks:
            group = None
            if g > 1:
                group = self.next_group
                self.next_group += 1
                self.group_sizes[group] = g
            for _ in range(g):
                ticket = self.tracker.dispatch(task)
                jobs.append(Job(task, ticket.dispatch_index, ticket, group))
        self.ledger.dispatched += len(jobs)
        if jobs:
            self.rollouts.start(jobs)

    def _poll(self, timeout: float | None) -> None:
        before = self.rollouts.generated_tokens
        finished = self.rollouts.poll(timeout=timeout)
        self.ledger.generated_tokens += self.rollouts.generated_tokens - before
        self._receive(finished)

    def _receive(self, finished: Sequence[Finished]) -> None:
        for item in finished:
            self.ledger.finished += 1
            episode = Episode(item.trajectory, item.job.ticket, item.job.group)
            tokens = episode.num_action_tokens
            if episode.failed:
                self.tracker.cancel(episode.ticket)
                self.ledger.failed += 1
                self.ledger.failed_tokens += tokens
                if episode.group is not None:
                    self.group_sizes[episode.group] -= 1
                    self._close_group(episode.group)
                continue
            self.algorithm.on_complete(self.tracker, episode)
            rule = self.algorithm.config.batch_rule
            if rule == "current-version" and episode.ticket.version < self.tracker.version:
                self.ledger.dropped_stale += 1
                self.ledger.dropped_tokens += tokens
                continue
            if episode.group is not None:
                self.groups.setdefault(episode.group, []).append(episode)
                self._close_group(episode.group)
            else:
                self.buffer.append(episode)

    def _drain_buffer(self) -> None:
        """``current-version``: finished work of a superseded version leaves the buffer (it was filed in the
        tracker when it returned); it is ledgered as dropped_stale, never trained."""
        stale = [e for e in self.buffer if e.ticket.version < self.tracker.version]
        if stale:
            self.buffer = [e for e in self.buffer if e.ticket.version >= self.tracker.version]
            self.ledger.dropped_stale += len(stale)
            self.ledger.dropped_tokens += sum(e.num_action_tokens for e in stale)

    def _close_group(self, group: int) -> None:
        members = self.groups.get(group, [])
        if len(members) < self.group_sizes[group]:
            return
        self.groups.pop(group, None)
        if len(members) < 2 or not self.algorithm.keep_group([m.reward for m in members]):
            self.ledger.dropped_group += len(members)
            self.ledger.dropped_tokens += sum(m.num_action_tokens for m in members)
            return
        self.buffer.extend(members)

    def _must_wait(self, publishing: bool) -> bool:
        """Before a publication, in-flight work that would exceed max_staleness must finish first."""
        if not publishing or self.algorithm.config.batch_rule == "current-version":
            return False
        limit = self.tracker.version - self.config.max_staleness
        return any(job.ticket.version <= limit for job in self.rollouts.running) or any(
            job.ticket.version <= limit for job in self.queued
        )

    def _take_batch(self, publishing: bool) -> list[Episode] | None:
        b = self.config.batch
        if self._must_wait(publishing):
            return None
        due: list[Episode] = []
        if publishing and self.algorithm.config.batch_rule != "current-version":
            limit = self.tracker.version - self.config.max_staleness
            due = [e for e in self.buffer if e.min_version <= limit]
            due.sort(key=lambda e: e.ticket.dispatch_index)  # oldest first
        if self.algorithm.config.batch_rule == "groups" and due:
            due_groups = {e.group for e in due}
            due = [e for e in self.buffer if e.group in due_groups]
        rest = [e for e in self.buffer if e not in due]
        need = max(b, len(due))
        if len(due) + len(rest) < need:
            return None
        batch = due + rest[: need - len(due)]
        taken = {id(e) for e in batch}
        self.buffer = [e for e in self.buffer if id(e) not in taken]
        if self.config.max_staleness == 0:
            batch.sort(key=lambda e: e.ticket.dispatch_index)  # arrival order is not reproducible
        return batch

    def _next_batch(self) -> list[Episode] | None:
        publishing = (self.updates + 1) % self.algorithm.config.publish_every == 0
        while not self._stop.is_set():
            batch = self._take_batch(publishing)
            if batch is not None:
                return batch
            self._dispatch()
            if not self.rollouts.running:
                raise RuntimeError(
                    f"no episode in flight and no batch ready ({len(self.buffer)} buffered, capacity "
                    f"{self._capacity()}): the batch rule cannot fill a batch of {self.config.batch}"
                )
            started = time.perf_counter()
            self._poll(timeout=None)
            self.generator_busy += time.perf_counter() - started
        return None

    # -- learning and publication ---------------------------------------------------------------------------------
    def _train_on(self, batch: list[Episode], pool: ThreadPoolExecutor | None) -> dict[str, Any]:
        version = self.tracker.version
        staleness = Counter(version - e.min_version for e in batch)
        if self.on_update is not None:
            self.on_update(version, batch)
        started = time.perf_counter()
        trains_policy = self.algorithm.train_policy(self.updates)  # False: e.g. SAO's critic-only warm-up
        advantages = self.algorithm.advantages(batch) if trains_policy else []
        if not trains_policy:
            metrics: dict[str, float] = {}
        elif pool is None:
            metrics = self.learner.update(batch, advantages, self.algorithm)
        else:  # keep generating (at the old version) while the learner works
            future = pool.submit(self.learner.update, batch, advantages, self.algorithm)
            while not future.done():
                self._dispatch()
                if self.rollouts.running:
                    self._poll(timeout=0.05)
                else:
                    time.sleep(0.01)
            metrics = future.result()
        metrics["policy_trained"] = float(trains_policy)
        metrics.update(self.algorithm.after_update(self.tracker, batch, self.learner))
        self.updates += 1
        self.ledger.trained += len(batch)
        self.ledger.trained_tokens += sum(e.num_action_tokens for e in batch)
        published = None
        if self.updates % self.algorithm.config.publish_every == 0:
            published = self._publish()
        self.learner_busy += time.perf_counter() - started
        return self._row(batch, metrics, staleness, published)

    def _publish(self) -> int:
        """Save the policy + probe, load it into the backend, verify what is served, advance the clock."""
        from streamrl.agents.vllm_backend import write_adapter_probe

        version = self.tracker.version + 1
        final = self.run_dir / "policy" / f"v{version}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.learner.save_policy(tmp)
        expected = self.learner.token_logprobs(self.probe)
        write_adapter_probe(tmp, self.probe, expected)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._serve(final, version)
        served = self.backend.score([self.probe], [1])[0]
        worst = max(abs(a - b) for a, b in zip(served, expected, strict=True))
        tolerance = 1e-3 if self.learner.device.type == "cpu" else 5e-2
        if not worst <= tolerance:
            raise PublishError(
                f"after publishing v{version} the backend serves log-probs {worst:.3g} away from the learner's "
                f"on the probe (tolerance {tolerance}): it is not serving the published policy"
            )
        self.tracker.publish()
        if self.algorithm.config.batch_rule == "current-version":
            self._drain_buffer()
        for old in sorted((self.run_dir / "policy").glob("v*")):
            if (
                old.name.startswith("v")
                and old.name[1:].isdigit()
                and int(old.name[1:]) <= version - self.config.keep_versions
                and int(old.name[1:]) != self._checkpoint_version  # a resume serves it again
            ):
                shutil.rmtree(old, ignore_errors=True)
        return version

    def _serve(self, policy_dir: Path, version: int) -> None:
        """Load a published policy into the rollout backend: an adapter, or full weights into its own copy."""
        if not policy_dir.is_dir():
            published = (
                sorted(p.name for p in policy_dir.parent.glob("v*")) if policy_dir.parent.is_dir() else []
            )
            raise PublishError(
                f"policy version v{version} is missing: no {policy_dir} (on disk: {published})"
            )
        if self.learner.finetune == "lora":
            self.backend.set_adapter(str(policy_dir), version)
            return
        from streamrl.agents.hf_backend import load_weights
        from streamrl.agents.ray_engines import RayEngines

        if isinstance(self.backend, RayEngines):  # engines elsewhere: each loads the files itself
            self.backend.set_weights(str(policy_dir), version)
            return
        try:
            load_weights(self.backend.model, policy_dir)
        except ValueError as exc:
            raise PublishError(str(exc)) from exc
        self.backend.set_adapter(None, version)

    # -- metrics ----------------------------------------------------------------------------------------------------
    def _row(
        self,
        batch: Sequence[Episode],
        metrics: Mapping[str, float],
        staleness: Counter[int],
        published: int | None,
    ) -> dict[str, Any]:
        trajs = [e.trajectory for e in batch]
        elapsed = time.perf_counter() - self.started
        turns = [len(t.turns) for t in trajs]
        invalid = sum(sum(1 for turn in t.turns if turn.action_valid is False) for t in trajs)
        row: dict[str, Any] = {
            "update": self.updates,
            "version": self.tracker.version,
            "published": published,
            "batch/success": sum(t.won for t in trajs) / len(trajs),
            "batch/reward": sum(t.reward for t in trajs) / len(trajs),
            "batch/turns": sum(turns) / len(turns),
            "batch/action_tokens": sum(t.num_action_tokens for t in trajs) / len(trajs),
            "batch/tool_calls": sum(sum(turn.tool_calls for turn in t.turns) for t in trajs) / len(trajs),
            "batch/invalid_action_rate": invalid / max(1, sum(turns)),
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "batch/task_ids": [e.task_id for e in batch],
            "batch/dispatch_indices": [e.ticket.dispatch_index for e in batch],
            **{f"learner/{k}": v for k, v in metrics.items()},
            "time/elapsed_s": elapsed,
            "time/generator_busy_s": self.generator_busy,
            "time/learner_busy_s": self.learner_busy,
            "time/generation_s": self.rollouts.generation_seconds,
            "throughput/trajectories_per_s": self.ledger.trained / elapsed,
            "throughput/action_tokens_per_s": self.rollouts.generated_tokens / elapsed,
            **self._slot_utilization(),
        }
        row.update(self._ledger_row())
        return row

    def _slot_utilization(self) -> dict[str, float]:
        """Occupied rollout slot-seconds so far, and the fraction of the slots that held a running episode
        since the previous row (the generator's utilization; learner and evaluation time included)."""
        now, occupied = time.perf_counter(), self.rollouts.occupied_slot_seconds()
        then, before = self._slots_at_row
        self._slots_at_row = (now, occupied)
        window = self.config.num_envs * (now - then)
        return {
            "time/rollout_slot_s": occupied,
            "throughput/slot_utilization": (occupied - before) / window if window > 0 else 0.0,
        }

    def _ledger_row(self) -> dict[str, int]:
        buffered = self.buffer + [m for members in self.groups.values() for m in members]
        return self.ledger.row(
            buffered=len(buffered),
            buffered_tokens=sum(e.num_action_tokens for e in buffered),
            in_flight=len(self.rollouts.running) + len(self.queued),
            in_flight_tokens=self.rollouts.running_tokens(),
        )

    def _write_metrics(self, row: Mapping[str, Any], writer: Any) -> None:
        # strict JSON: a non-finite value (e.g. an undefined explained variance) is written as null
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(clean, sort_keys=True, allow_nan=False) + "\n")
        if writer is not None:
            step = int(row.get("update", self.updates))
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    writer.add_scalar(key, value, step)
            writer.flush()

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboard is a core dependency
            return None
        return SummaryWriter(str(self.run_dir / "tensorboard"))

    def _progress_bar(self) -> Any:
        if not self.show_progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=self.config.updates,
            initial=self.updates,
            desc=f"{self.algorithm.name} {self.config.env}",
            unit="update",
        )

    # -- offline values and evaluation ------------------------------------------------------------------------
    def _collect(self, side: Rollouts, jobs: Sequence[Job], desc: str) -> list[Finished]:
        """``collect`` with a progress bar of its episodes (under the run's bar) when the run shows progress."""
        if not self.show_progress:
            return collect(side, jobs)
        from tqdm.auto import tqdm

        with tqdm(total=len(jobs), desc=desc, unit="episode", position=1, leave=False) as bar:
            return collect(side, jobs, progress=lambda _: bar.update(1))

    def _side_rollouts(self, split: str, temperature: float, seed: int) -> Rollouts:
        """Rollouts on ``split`` with the current policy, apart from training (offline values, evaluation)."""
        from streamrl.envs.vector import StreamingVectorEnv

        venv = StreamingVectorEnv.from_env(
            self.spec.gym_id,
            self.config.num_envs,
            config=self._workers(),
            split=split,
            **{**self.spec.env_kwargs, **self.config.env_kwargs},
        )
        sampling = replace(self.sampling, temperature=temperature, seed=seed)
        agent = self.spec.llm_agent(
            self.backend,
            sampling,
            constrain_actions=self.config.constrain_actions,
            avoid_repeats=self.config.avoid_repeats,
            tokenizer=self.tokenizer,
        )
        return Rollouts(venv, agent, seed=seed, lockstep=True)

    def _offline_init(self) -> None:
        n0 = self.config.offline_rollouts
        if n0 == 0 or self.tracker.config.mode == "bookkeeping":
            return
        cache = self._offline_cache_path()
        if cache.is_file():
            outcomes = json.loads(cache.read_text())
            self.log(f"offline values: {cache} (cached)")
        else:
            # seeded apart from the run seed: the values are a function of the cache key, shared by all seeds
            side = self._side_rollouts(self.spec.train_split, self.config.temperature, derive_seed("offline"))
            try:
                jobs = [Job(t, i * n0 + k) for i, t in enumerate(self.task_ids) for k in range(n0)]
                done = self._collect(side, jobs, "offline values")
            finally:
                side.venv.close()
            outcomes = {t: [] for t in self.task_ids}
            for item in done:
                outcomes[item.job.task_id].append(float(item.trajectory.reward))
            atomic_write_text(cache, json.dumps(outcomes))  # the cache is shared by concurrent runs
            self.log(f"offline values: {n0} rollouts x {len(self.task_ids)} tasks -> {cache}")
        self.tracker.init_offline({t: outcomes[t] for t in self.task_ids})

    def _offline_cache_path(self) -> Path:
        import hashlib

        from streamrl.agents.models import weights_fingerprint
        from streamrl.utils.cache import cache_root

        key = json.dumps(
            [
                weights_fingerprint(self.model_dir),
                self.config.env,
                self.spec.train_split,
                self.task_ids,
                self.config.offline_rollouts,
                self.config.temperature,
                self.sampling.max_new_tokens,
                sorted(self.config.env_kwargs.items()),
            ],
        )
        name = hashlib.sha256(key.encode()).hexdigest()[:20]
        return cache_root() / "offline_values" / f"{self.model_dir.name}-{self.config.env}-{name}.json"

    def _evaluate(self) -> dict[str, float]:
        """Success on the fixed held-out tasks, with the policy of the current version."""
        started = time.perf_counter()
        # the same episode seeds at every version and in every run with this seed: paired comparisons
        side = self._side_rollouts(
            self.eval_split, self.config.eval_temperature, derive_seed(self.config.seed, "eval")
        )
        try:
            jobs = [Job(t, i) for i, t in enumerate(self.eval_tasks)]
            done = self._collect(side, jobs, f"held-out eval (update {self.updates})")
        finally:
            side.venv.close()
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
        evals = self.run_dir / "evals"
        evals.mkdir(exist_ok=True)
        atomic_write_text(
            evals / f"update-{self.updates:05d}.jsonl", "".join(json.dumps(r) + "\n" for r in records)
        )
        wins = [float(r["won"]) for r in records]
        p = sum(wins) / len(wins)
        row = {
            "eval/success": p,
            "eval/stderr": math.sqrt(p * (1 - p) / len(wins)),
            "eval/reward": sum(r["reward"] for r in records) / len(records),
            "eval/episodes": float(len(records)),
            "eval/tasks": float(len({r["task_id"] for r in records})),
            "eval/version": float(self.tracker.version),
            "eval/seconds": time.perf_counter() - started,
        }
        start = evals / "update-00000.jsonl"
        if self.updates and start.is_file():
            # paired with the start's evaluation: the same tasks and episode seeds, so the per-episode
            # differences cancel most of the sampling noise
            before = {r["key"]: r for r in map(json.loads, start.read_text().splitlines())}
            if before.keys() == {r["key"] for r in records}:
                diffs = [float(r["won"]) - float(before[r["key"]]["won"]) for r in records]
                row.update(_paired_delta(diffs, [r["task_id"] for r in records]))
        return row

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, Any]:
        """SIGINT/SIGTERM stop the run after the current step (and checkpoint); returns the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def stop(signum: int, frame: Any) -> None:
            self.log(f"signal {signum}: checkpointing after the current step")
            self._stop.set()

        previous: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, stop)
        return previous

    def _save_checkpoint(self) -> None:
        """Write the checkpoint to ``checkpoint.tmp/`` and rename it to ``checkpoint/``. Two renames cannot be
        one, so the previous checkpoint waits in ``checkpoint.old/`` until the new one is in place: whenever the
        process dies, ``checkpoint/`` or ``checkpoint.old/`` holds a complete checkpoint (``_last_checkpoint``).
        """
        final = self.run_dir / "checkpoint"
        tmp = self.run_dir / "checkpoint.tmp"
        old = self.run_dir / "checkpoint.old"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(
            {
                "learner": self.learner.state_dict(),
                "algorithm": self.algorithm.state_dict(),
                "torch_rng": torch.get_rng_state(),
            },
            tmp / "learner.pt",
        )
        in_flight = [job for job in self.queued] + self.rollouts.running
        state = {
            "updates": self.updates,
            "start": self._start_identity,
            "tracker": self.tracker.state_dict(),
            "ledger": {
                **asdict(self.ledger),
                "generated_tokens": self.ledger.generated_tokens - self.rollouts.running_tokens(),
            },
            "buffer": [self._episode_json(e) for e in self.buffer],
            "groups": {
                str(g): [self._episode_json(e) for e in members] for g, members in self.groups.items()
            },
            "group_sizes": {str(g): n for g, n in self.group_sizes.items()},
            "next_group": self.next_group,
            "in_flight": [
                {"task_id": j.task_id, "key": j.key, "ticket": asdict(j.ticket), "group": j.group}
                for j in in_flight
            ],
            "time": {"generator_busy": self.generator_busy, "learner_busy": self.learner_busy},
            "backend_version": self.tracker.version,
        }
        (tmp / "state.json").write_text(json.dumps(state))
        _fsync_folder(tmp)  # on disk before a rename publishes it, also across a power loss
        if final.exists():  # else a kill came between the renames and old/ is the last checkpoint: keep it
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_folder(self.run_dir, files=False)
        shutil.rmtree(old, ignore_errors=True)
        self._checkpoint_version = self.tracker.version

    @staticmethod
    def _episode_json(episode: Episode) -> dict[str, Any]:
        return {
            "trajectory": episode.trajectory.to_dict(),
            "ticket": asdict(episode.ticket),
            "group": episode.group,
        }

    @functools.cached_property
    def _start_identity(self) -> dict[str, str]:
        """The starting model a checkpoint belongs to: its directory's name (an SFT checkpoint's name holds its
        recipe's key) and a fingerprint of its weights (read once: the start does not change during a run)."""
        from streamrl.agents.models import weights_fingerprint

        return {"model_dir": self.model_dir.name, "weights": weights_fingerprint(self.model_dir)}

    def _last_checkpoint(self) -> Path | None:
        """The run's last complete checkpoint: ``checkpoint/``, or ``checkpoint.old/`` when the run was killed
        between ``_save_checkpoint``'s two renames; None when it was killed before its first checkpoint."""
        for name in ("checkpoint", "checkpoint.old"):
            if (self.run_dir / name / "state.json").is_file():
                return self.run_dir / name
        return None

    def _load_checkpoint(self, path: Path) -> None:
        state = json.loads((path / "state.json").read_text())
        started = state.get("start")  # absent in checkpoints written before the check
        now = self._start_identity
        if started is not None and started != now:
            if started["model_dir"] != now["model_dir"]:
                what = f"its config now resolves to {now['model_dir']} (the env's SFT preset changed?)"
            else:
                what = f"the weights of {now['model_dir']} changed ({started['weights']} -> {now['weights']})"
            raise ConfigError(
                f"cannot resume {self.run_dir}: it started from {started['model_dir']}, but {what}; resume it "
                "from the model it started from (for an SFT start, sft= the overrides of its recipe), or start "
                "a new run"
            )
        blob = torch.load(path / "learner.pt", weights_only=False)
        self.learner.load_state_dict(blob["learner"])
        self.algorithm.load_state_dict(blob["algorithm"])
        torch.set_rng_state(blob["torch_rng"])
        self.tracker.load_state_dict(state["tracker"])
        self.updates = int(state["updates"])
        self.ledger = Ledger(**state["ledger"])

        def episode(item: Mapping[str, Any]) -> Episode:
            ticket = Ticket(**item["ticket"])
            trajectory = Trajectory.from_dict(item["trajectory"])
            trajectory.ticket = ticket
            return Episode(trajectory, ticket, item["group"])

        self.buffer = [episode(item) for item in state["buffer"]]
        self.groups = {int(g): [episode(i) for i in members] for g, members in state["groups"].items()}
        self.group_sizes = {int(g): n for g, n in state["group_sizes"].items()}
        self.next_group = int(state["next_group"])
        self.queued = [
            Job(j["task_id"], j["key"], Ticket(**j["ticket"]), j["group"]) for j in state["in_flight"]
        ]
        self.generator_busy = state["time"]["generator_busy"]
        self.learner_busy = state["time"]["learner_busy"]
        self._truncate_metrics(self.updates)
        version = int(state["backend_version"])
        self._checkpoint_version = version
        if version > 0:  # serve the published policy of the checkpointed version, not the learner's weights
            self._serve(self.run_dir / "policy" / f"v{version}", version)
        self.log(
            f"resumed {self.run_dir} at update {self.updates} (version {version}, from {path.name}/), "
            f"{len(self.queued)} tickets requeued, {len(self.buffer)} episodes buffered"
        )

    def _truncate_metrics(self, updates: int) -> None:
        """Drop the metrics rows of updates after ``updates`` (and a row cut by a kill): they are run again."""
        from streamrl.utils.cache import atomic_write_text

        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(row.get("update", 0)) <= updates:
                kept.append(line + "\n")
        atomic_write_text(path, "".join(kept))


def _fsync_folder(path: Path, *, files: bool = True) -> None:
    """Flush to disk the folder ``path`` (its entries: what was renamed into it) and, with ``files``, the files
    in it."""
    items = [p for p in path.iterdir() if p.is_file()] if files else []
    for item in [*items, path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def train(
    config: TrainConfig,
    *,
    algorithm: Algorithm | None = None,
    backend: GenerationBackend | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``config`` to completion (or resume it) and return the trainer's summary (``backend``: see
    ``Trainer``)."""
    trainer = Trainer(config, algorithm=algorithm, backend=backend, resume=resume, progress=progress)
    return trainer.run()


def _paired_delta(diffs: Sequence[float], tasks: Sequence[str]) -> dict[str, float]:
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
