"""``TrainConfig``: everything a training run needs, and the checks that it can run.

The config is a frozen dataclass saved as the run's ``config.json`` (``to_dict`` / ``from_dict``; a resume
compares it); ``validate`` refuses a config that cannot run before any work starts, each error naming the value
and what would be valid. ``initial_model_dir`` resolves the model a run starts from (its version 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from streamrl.algorithms.base import Algorithm, algorithm_class, make_algorithm
from streamrl.algorithms.learner import LearnerConfig
from streamrl.algorithms.run_dir import RunDir
from streamrl.algorithms.session import ActionConstraint, EnvWorkers, RolloutFields

if TYPE_CHECKING:
    from streamrl.sft import SFTConfig

BackendName = Literal["hf", "vllm"]
Init = Literal["sft", "base"]
Cluster = Literal["local", "ray"]
Dispatch = Literal["fill", "trainable"]
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


TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    # Chosen on ALFWorld's validation games (held-out training games), never on eval_seen / eval_unseen:
    # docs/training.md, "An ALFWorld recipe". Each update trains 16 whole episodes of up to 50 turns; every
    # action is one of the admissible commands, none twice from one state (the cold start's selected policy).
    "alfworld": {
        "constrain_actions": True,
        "avoid_repeats": True,
        "updates": 60,
        "batch": 16,
        "num_envs": 16,
        "offline_rollouts": 2,
        "eval_split": "validation",
        "eval_episodes": 128,
        "eval_every": 60,
        "learner": {"lr": 3e-3, "mini_batches": 2},
    },
}
"""Per-env ``TrainConfig`` fields (``LearnerConfig`` fields under ``"learner"``) that ``streamrl train --env ENV``
and ``TrainConfig.for_env`` start from, below a ``--config`` file and flags. An env without one starts from
the field defaults (Math-TIR: the demo's run is ``streamrl demo``)."""


@dataclass(frozen=True)
class TrainConfig(ActionConstraint, RolloutFields):
    """Everything a training run needs; saved as the run's ``config.json`` (resume checks it). The rollout fields
    (``num_envs``, ``tasks``, ``max_new_tokens``, ``constrain_actions``, ``avoid_repeats``) are declared once in
    ``algorithms.session`` and shared with value pretraining and ``streamrl eval``; the training rollouts, the
    offline values and the held-out evaluations all play with them."""

    out: str = ""
    """Run directory (required)."""
    env: str = "math_tir"
    """``"math_tir"``, ``"alfworld"``, a name given to ``agents.env_specs.register_env_spec``, or
    ``module:name`` / ``file.py:name`` of a module whose import registers it (``agents.env_specs.env_spec``)."""
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
    schedule_updates: int | None = None
    """Updates the learning-rate schedule (warm-up + cosine) spans; ``None``: ``updates``. Larger than
    ``updates`` trains the first updates of a longer run at that run's learning rates (SPO++ Table 2's C10: the
    first ten updates of the preset's run, ``examples/reproduce_table2.py``)."""
    batch: int = 64
    """B: trajectories per update (SPO++ paper: 128)."""
    max_staleness: int = 1
    """S: a trained token is at most S versions older than the policy trained (0 = synchronous trainer)."""
    offline_rollouts: int = 8
    """n_0: rollouts per task of the initial policy that initialize the prompt values (0 = uniform prior)."""
    temperature: float = 1.0
    """Rollout sampling temperature (the learner scores under the same temperature)."""
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env over its spec's (e.g. ``{"max_steps": 8}``: shorter ALFWorld episodes);
    the training, offline-value and evaluation envs all get them."""
    eval_every: int = 10
    """Updates between held-out evaluations (0 = none); one runs before the first update and at the end."""
    eval_episodes: int = 64
    """Held-out episodes per evaluation: fixed tasks, drawn uniformly once per run."""
    final_eval_episodes: int | None = None
    """Held-out episodes of the two evaluations the run's paired gain compares, before the first update and at
    the end (``None`` = ``eval_episodes``). The evaluations in between play the first ``eval_episodes`` of
    them, and every evaluation's ``eval/*`` metrics are of those, so the curve stays paired with its start;
    the ends add ``eval_full/*`` over all of them. A precise start-to-end comparison then costs two long
    evaluations, not one per curve point (the demo: each test task once on the curve, four times at the ends)."""
    eval_split: str | None = None
    """Held-out split; ``None`` = the env's first evaluation split. Choose settings on the env's
    ``validation_split`` (ALFWorld: ``"validation"``, held-out training games) and keep the eval splits for the
    final measurement."""
    eval_temperature: float = 1.0
    """Sampling temperature of the evaluation (0 = greedy)."""
    checkpoint_every: int = 10
    """Updates between checkpoints (also on SIGINT/SIGTERM and at the end)."""
    keep_versions: int = 3
    """Published policy versions kept on disk (at least max_staleness + 1)."""
    average_last: int = 0
    """At the end of the run, write the uniform mean of the last K published versions' weights to
    ``policy/average`` (``streamrl.algorithms.averaging``: stochastic weight averaging), the run's result policy,
    evaluated as ``run:DIR@average``; a run that publishes fewer than K versions averages all of them. 0 = none.
    Full fine-tuning only (adapters do not average); needs ``keep_versions >= K``."""
    dispatch: Dispatch = "fill"
    """Which episodes are started. ``"fill"`` (SPO++ as published): every free rollout slot, within the admission
    bound of ``max_staleness``; under the ``current-version`` rule the episodes still in flight when a version is
    published are filed and not trained (about one per slot per publication). ``"trainable"``: only what the
    batch rule can still train at the current version (``BatchStrategy.trainable_room``: for
    ``current-version`` the version's remaining B x P minus what is buffered or in flight), and the slots a batch
    frees are refilled before an update that does not publish. Under ``current-version`` it trains every episode
    it starts, the slow ones too, where ``"fill"`` trains the first completed: it changes what SPO++ trains
    (docs/training.md, "Thrown-away work")."""
    balance_by: str | None = None
    """A task attribute (``RolloutSession.task_attributes``: ALFWorld's ``task_type``, Math-TIR's ``family`` or
    ``source``) over whose values the task sampler is balanced: each value gets an equal share of the dispatches,
    shared within it by the algorithm's own sampler (``EventTracker(strata=...)``). ``None`` (default): the
    algorithm's sampler over all tasks, as published (SPO/SPO++ lean towards tasks near v̂ = 1/2, and with them
    towards the kinds of task the policy half-solves)."""
    overlap: bool | None = None
    """Generate while the learner updates; ``None`` = only with an out-of-process backend (vLLM, Ray engines)."""
    env_workers: EnvWorkers = "subprocess"
    """Vector env workers: ``"subprocess"`` (default) or ``"inprocess"`` (debugging); with ``cluster="ray"``
    they are Ray actors."""
    cluster: Cluster = "local"
    """Where env workers, rollout engines and learner ranks 1..R-1 run: ``"local"`` (this process and its
    subprocesses) or ``"ray"`` (Ray actors on the cluster at ``address``: ``docs/scaling.md``). The runtime and
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

    @classmethod
    def for_env(cls, env: str, **overrides: Any) -> TrainConfig:
        """The config of env ``env``'s preset (``TRAIN_PRESETS``; the field defaults for an env without one) with
        ``overrides`` (``learner`` may be a mapping of ``LearnerConfig`` fields, laid over the preset's)."""
        return cls.from_dict(preset_values(env, overrides))

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

    def validate(self, algorithm: Algorithm, *, resume: bool = False) -> None:
        """``ConfigError`` naming the value and what is valid when this config cannot run ``algorithm``, or
        cannot start (``resume=False``) or continue (``resume=True``) the run in ``out``; before any work."""
        from streamrl.agents.env_specs import env_spec

        c = self
        if not c.out:
            raise ConfigError("out (the run directory) is required, e.g. out='runs/spo_pp-math'")
        try:
            spec = env_spec(c.env)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if c.eval_split is not None and c.eval_split not in spec.splits:
            raise ConfigError(
                f"unknown eval_split {c.eval_split!r} of env {c.env!r}; valid: {list(spec.splits)}"
            )
        if c.backend not in ("hf", "vllm"):
            raise ConfigError(f"unknown backend {c.backend!r}; valid: 'hf', 'vllm'")
        if c.init not in ("sft", "base"):
            raise ConfigError(f"init must be 'sft' or 'base', got {c.init!r}")
        if c.sft and c.init != "sft":
            raise ConfigError(f"sft overrides {dict(c.sft)} need init='sft', got init={c.init!r}")
        if c.init == "sft":  # the recipe exists (an env without an SFT preset needs init='base')
            try:
                sft_recipe(c.model, c.env, c.sft)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"sft={dict(c.sft)}: {exc}" if c.sft else str(exc)) from exc
        from streamrl.agents.models import model_dir_name

        try:
            model_dir_name(c.model)  # a known model (built only when a run needs it)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in (
            "updates",
            "batch",
            "threads",
            "keep_versions",
            "learner_ranks",
            "rollout_engines",
        ):
            if getattr(c, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(c, name)}")
        if c.schedule_updates is not None and c.schedule_updates < 1:
            raise ConfigError(
                f"schedule_updates must be >= 1 (or None: the run's updates), got {c.schedule_updates}"
            )
        for error in c.rollout_errors():
            raise ConfigError(error)
        self._validate_cluster()
        if c.dispatch not in ("fill", "trainable"):
            raise ConfigError(f"dispatch must be 'fill' or 'trainable', got {c.dispatch!r}")
        for name in ("max_staleness", "offline_rollouts", "eval_every", "eval_episodes", "checkpoint_every"):
            if getattr(c, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(c, name)}")
        if c.final_eval_episodes is not None and c.final_eval_episodes < c.eval_episodes:
            raise ConfigError(
                f"final_eval_episodes={c.final_eval_episodes} must be >= eval_episodes={c.eval_episodes} (the "
                "curve's evaluations play the first eval_episodes of the final ones), or None"
            )
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
        if c.average_last < 0:
            raise ConfigError(f"average_last must be >= 0 (0 = no averaged policy), got {c.average_last}")
        if c.average_last:
            if c.keep_versions < c.average_last:
                raise ConfigError(
                    f"average_last={c.average_last} averages the last {c.average_last} published versions, but "
                    f"keep_versions={c.keep_versions} keeps only that many on disk: use keep_versions >= "
                    f"{c.average_last}"
                )
            if c.learner.finetune == "lora":
                raise ConfigError(
                    "average_last > 0 averages full weights; LoRA adapters do not average (the mean of the A "
                    "and B matrices is not the mean of the policies): use finetune='full' or average_last=0"
                )
        if c.keep_versions < c.max_staleness + 1:
            raise ConfigError(
                f"keep_versions={c.keep_versions} must be >= max_staleness + 1 = {c.max_staleness + 1}"
            )
        if c.temperature <= 0:
            raise ConfigError(
                f"temperature must be > 0 for RL (the learner scores the sampling policy), got {c.temperature}"
            )
        if c.batch < algorithm.min_batch:
            raise ConfigError(
                f"batch={c.batch} is too small for {algorithm.name}: its advantages are standardized over "
                f"the batch, which needs batch >= {algorithm.min_batch}"
            )
        try:
            algorithm.batch_rule.check(batch=c.batch, num_envs=c.num_envs, algorithm=algorithm.name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if c.constrain_actions and c.backend == "vllm":
            raise ConfigError(
                "constrain_actions=True needs the hf backend: vLLM's structured outputs are not the token-level "
                "constraint the learner rescores"
            )
        if c.constrain_actions and not spec.lists_actions:
            raise ConfigError(
                f"constrain_actions=True: the {c.env} env's prompt format has no action_choices to choose among"
            )
        for error in c.constraint_errors():
            raise ConfigError(error)
        if c.backend == "vllm" and c.learner.finetune == "full":
            raise ConfigError(
                "the vllm backend loads LoRA adapters; use learner.finetune='lora' (or 'auto' on a large model)"
            )
        run = RunDir(c.out)
        if run.is_run():
            saved = run.read_config()
            if not resume:
                raise ConfigError(
                    f"{run.path} already holds a run; pass resume=True (--resume) or another out"
                )
            mine = json.loads(json.dumps(self.to_dict()))
            # saved before the field: it started from the preset of its time, which the checkpoint cannot tell
            # (no "start" in its state either), so it resumes only with the preset
            saved.setdefault("sft", {})
            saved.setdefault("constrain_actions", False)  # saved before the field: unconstrained
            saved.setdefault("avoid_repeats", False)  # saved before the field: repeats allowed
            saved.setdefault("dispatch", "fill")  # saved before the field: every free slot
            saved.setdefault("schedule_updates", None)  # saved before the field: the schedule spans updates
            saved.setdefault("average_last", 0)  # saved before the field: no averaged policy
            saved.setdefault("balance_by", None)  # saved before the field: the sampler over all tasks
            for values in (saved, mine):  # how the ranks hold the policy is placement: checkpoints are full
                (values.get("learner") or {}).pop("sharding", None)
            changed = sorted(
                k
                for k in set(saved) | set(mine)
                if saved.get(k) != mine.get(k)
                and k not in ("updates", "learner_ranks", "envs_per_worker", *PLACEMENT)
            )
            if changed:
                diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in changed)
                raise ConfigError(f"cannot resume {run.path} with a different config ({diffs})")

    def _validate_cluster(self) -> None:
        c = self
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
        if c.envs_per_worker is not None:
            raise ConfigError(
                f"envs_per_worker={c.envs_per_worker} is for cluster='local'; with cluster='ray' env_actors "
                "sets how many sub-envs an actor hosts (num_envs / env_actors)"
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


def preset_values(env: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (``TrainConfig.to_dict`` keys) laid over env ``env``'s preset (``TRAIN_PRESETS``), with ``env``
    set. A ``learner`` mapping merges into the preset's field by field; a ``LearnerConfig`` replaces it."""
    preset = TRAIN_PRESETS.get(env, {})
    merged = {**preset, **values, "env": env}
    learner = values.get("learner") or {}
    if not isinstance(learner, LearnerConfig):
        merged["learner"] = {**preset.get("learner", {}), **learner}
    return merged


class ConfigError(ValueError):
    """A training config that cannot run; raised before any work starts."""


def resolve_algorithm(config: TrainConfig, algorithm: Algorithm | None = None) -> Algorithm:
    """The algorithm of the run: built from ``config.algo`` (its env preset under ``config.algorithm``), or
    ``algorithm`` when given. A ready-made algorithm must be the one ``config.algo`` names (the run's config.json
    rebuilds it on resume), and its options live in its own config, not in ``config.algorithm``."""
    if algorithm is None:
        try:
            return make_algorithm(config.algo, env=config.env, **dict(config.algorithm))
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise ConfigError(str(exc)) from exc
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
    return algorithm


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
