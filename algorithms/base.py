"""The algorithm interface: what an RL algorithm decides, and nothing the runtime or learner already does.

An algorithm module (``spo.py``, ``spo_pp.py``, ``grpo.py``, ``sao.py``, or a user's own) answers five
questions, each a small method or config field next to its paper's equation:

1. **Which tracker.** ``tracker_config(seed)``: event-time memory (SPO++), receipt-order with drift (SPO) or
   bookkeeping only (GRPO, SAO).
2. **Which trajectories form a batch.** ``config.batch_rule`` names the rule, ``batch_rule`` is its strategy
   (``streamrl.algorithms.batching``): ``"current-version"`` (the first completed requests of the current
   policy version; older work is recorded in the tracker but not trained -- SPO++ §2.4), ``"any"`` (first
   completed, any version within the runtime's staleness bound -- SPO, SAO) or ``"groups"`` (complete groups
   of ``config.group_size`` rollouts of one task -- GRPO). An algorithm with a rule of its own overrides
   ``batch_rule``.
3. **When outcomes reach the tracker.** ``on_complete`` (default: when the episode returns, so later
   dispatches see it -- SPO++ Eq. 3) and ``after_update`` (SPO records after its update, with drift).
4. **The advantages.** ``advantages(episodes)``: one value per episode (broadcast to its action tokens) or
   one per action token (GAE), normalized as the paper says.
5. **The loss terms.** ``policy_loss(inputs)`` on one micro-batch, aggregated with the update batch's
   global counts (``inputs.agg``); an optional ``critic`` (SAO) brings its own model and loss.

Two hooks serve algorithms with a model of their own (SAO's critic): ``setup(context)`` is called once by
the trainer after its learner exists, with what is needed to build the model (``SetupContext``: the model
directory, device, tokenizer, ...); ``train_policy(update)`` says whether an update steps the policy (SAO's
critic-only warm-up: the update still counts, its batch is still consumed and ``after_update`` still runs).

Everything else -- dispatching, env stepping, batching, staleness, micro-batching, the optimizer,
publication, checkpoints -- is shared, so swapping the algorithm is one argument (``make_algorithm``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import torch
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.batching import RULES, BatchStrategy, batch_rule
from streamrl.algorithms.losses import (
    LossAggregation,
    PolicyLoss,
    ppo_policy_loss,
    rollout_importance_weights,
)
from streamrl.algorithms.tracker import EventTracker, Ticket, TrackerConfig
from streamrl.utils.modules import import_user_module

BatchRule = Literal["current-version", "any", "groups"]
BATCH_RULES: tuple[str, ...] = tuple(RULES)


@dataclass(frozen=True)
class AlgorithmConfig:
    """Fields every algorithm has; each algorithm's config adds its own hyperparameters."""

    batch_rule: BatchRule = "any"
    """Which finished trajectories form an update batch (module doc, point 2)."""
    group_size: int = 1
    """Rollouts dispatched together per task (GRPO's G); 1 = single-stream."""
    publish_every: int = 1
    """Updates per published policy version (SPO++ Table 3: 1 on ALFWorld, 2 on Math-TIR)."""

    def __post_init__(self) -> None:
        if self.batch_rule not in BATCH_RULES:
            raise ValueError(f"batch_rule must be one of {BATCH_RULES}, got {self.batch_rule!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.batch_rule == "groups" and self.group_size < 2:
            raise ValueError(f"batch_rule='groups' needs group_size >= 2, got {self.group_size}")
        if self.publish_every < 1:
            raise ValueError(f"publish_every must be >= 1, got {self.publish_every}")


@dataclass
class Episode:
    """A finished episode as the trainer sees it: the trajectory, the dispatcher's ticket, its group."""

    trajectory: Trajectory
    ticket: Ticket
    group: int | None = None
    """Dispatch group (GRPO: the G tickets of one task dispatched together); ``None`` for single-stream."""

    @property
    def task_id(self) -> str:
        return self.ticket.task_id

    @property
    def reward(self) -> float:
        return self.trajectory.reward

    @property
    def num_action_tokens(self) -> int:
        return self.trajectory.num_action_tokens

    @property
    def min_version(self) -> int:
        """The oldest policy version that generated any of its tokens (the ticket's, if none)."""
        versions = [
            v
            for seq in self.trajectory.sequences
            for v, m in zip(seq.token_versions, seq.action_mask, strict=True)
            if m
        ]
        return min(versions, default=self.ticket.version)

    @property
    def failed(self) -> bool:
        """A worker failure ended it (``info["error"]``): its outcome is not the policy's."""
        return self.trajectory.info.get("error") is not None


@dataclass(frozen=True)
class SetupContext:
    """What the trainer knows that an algorithm needs to build a model of its own (``Algorithm.setup``)."""

    model_dir: Path
    """The Hugging Face directory the policy was loaded from (its SFT checkpoint, or the base model)."""
    device: torch.device
    """Where the learner trains (CUDA when present, else CPU)."""
    pad_token_id: int
    tokenizer: Any
    micro_batch_tokens: int
    """The learner's padded-token budget per forward pass (``LearnerConfig.micro_batch_tokens``)."""
    seed: int
    """A seed for the algorithm's own initialization, derived from the run's seed."""
    log: Callable[[str], None] = print


class PolicyScorer(Protocol):
    """What an algorithm may ask of the policy after an update (``Algorithm.after_update``): the log-probs of
    trajectories' action tokens. The learner is one; the algorithm sees nothing else of it, and the learner
    sees of the algorithm only its loss (``aggregation``, ``policy_loss``): the calls go one way each."""

    def episode_logprobs(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]: ...


class PolicyObjective(Protocol):
    """What the learner asks of an algorithm (``Learner.update``): how a step's loss is aggregated and the loss
    of one micro-batch. ``Algorithm`` is one."""

    def aggregation(self, mask: torch.Tensor) -> LossAggregation: ...

    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss: ...


@dataclass
class PolicyInputs:
    """One micro-batch for ``Algorithm.policy_loss``: dense ``[b, T-1]`` tensors aligned with predictions.

    ``mask`` is 1.0 on action tokens. ``logp`` carries the gradient; ``old_logp`` is the policy at the start
    of the update (recomputed by the learner, the PPO ratio's denominator); ``rollout_logp`` what the
    inference engine reported when sampling (the behaviour policy). ``agg`` holds the counts of the whole
    (mini-)batch of this optimizer step, so the micro-batch losses sum to the full-batch loss.
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    agg: LossAggregation
    entropy: torch.Tensor | None = None
    """Per-token entropy of the policy (no grad; diagnostics), or ``None``."""


class Algorithm(ABC):
    """Base class of SPO, SPO++, GRPO, SAO and user algorithms (see the module doc)."""

    name: ClassVar[str] = ""
    """Registry name (``make_algorithm(name)``, ``streamrl train --algo name``)."""
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    min_batch: ClassVar[int] = 1
    """The fewest trajectories an update batch may hold: 2 where advantages are standardized over the batch
    (one trajectory has no spread); the trainer refuses a smaller ``batch`` before any work."""

    def __init__(self, config: AlgorithmConfig | None = None) -> None:
        config = config if config is not None else self.config_class()
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config

    def setup(self, context: SetupContext) -> None:  # noqa: B027 (optional hook)
        """Called once by the trainer after its learner exists and before any checkpoint is restored: build
        extra models here (SAO's critic), so that ``load_state_dict`` finds them. Default: nothing."""

    # -- 1. tracker ---------------------------------------------------------------------------------------
    @abstractmethod
    def tracker_config(self, seed: int) -> TrackerConfig:
        """The event tracker this algorithm needs."""

    # -- 3. outcomes -> tracker ---------------------------------------------------------------------------
    def on_complete(self, tracker: EventTracker, episode: Episode) -> None:
        """An episode returned (before any batch is formed). Default: file its outcome now (SPO++ Eq. 3),
        so the tasks' values are fresh for the next dispatches."""
        tracker.record(episode.ticket, episode.reward)

    def after_update(
        self, tracker: EventTracker, episodes: Sequence[Episode], learner: PolicyScorer
    ) -> dict[str, float]:
        """After the optimizer steps on ``episodes``; returns extra metrics. ``learner`` scores trajectories
        under the updated policy (SPO's drift). Default: nothing."""
        return {}

    # -- 4. advantages ------------------------------------------------------------------------------------
    @abstractmethod
    def advantages(self, episodes: Sequence[Episode]) -> list[float | torch.Tensor]:
        """Per episode: a scalar (broadcast to all its action tokens) or a 1-D tensor with one value per
        action token, in sequence order (as ``Trajectory.sequences`` holds them)."""

    @property
    def batch_rule(self) -> BatchStrategy:
        """The strategy of ``config.batch_rule`` (module doc, point 2); the trainer asks it, never the name."""
        return batch_rule(self.config.batch_rule, self.config.group_size)

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """``batch_rule="groups"`` only: whether a complete group enters the batch (DAPO drops groups whose
        rewards are all equal). Dropped groups are ledgered, never silently lost."""
        return True

    # -- 5. loss ------------------------------------------------------------------------------------------
    def aggregation(self, mask: torch.Tensor) -> LossAggregation:
        """How the loss of one optimizer step is aggregated, built from that step's whole action mask.
        Default: token-mean with the global token count (SPO, SPO++, SAO, DAPO)."""
        return LossAggregation.of_batch(mask, "token-mean")

    @abstractmethod
    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss:
        """The policy loss of one micro-batch (aggregated with ``inputs.agg``)."""

    def train_policy(self, update: int) -> bool:
        """Whether update number ``update`` (0-based) steps the policy. ``False`` (SAO's critic-only warm-up):
        the trainer skips ``advantages`` and the learner's step, but the update still counts (ledger,
        publication schedule, checkpoints) and ``after_update`` runs (the critic trains). Default: always."""
        return True

    critic: Any = None
    """An optional value model with its own optimizer (SAO); see ``streamrl.algorithms.sao``."""

    # -- resume -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint beyond the config (e.g. SPO's stored responses, SAO's critic weights and
        optimizer). JSON or ``torch.save``-able (the trainer saves it in ``checkpoint/learner.pt``)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what ``state_dict`` returned."""

    def describe(self) -> dict[str, Any]:
        """The resolved config, for the run directory."""
        return {"name": self.name, **{f.name: getattr(self.config, f.name) for f in fields(self.config)}}


# ---------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------

ALGORITHMS: dict[str, type[Algorithm]] = {}
"""Registered algorithms by name."""

A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(cls: A) -> A:
    """Class decorator: make ``cls`` available as ``make_algorithm(cls.name)`` and ``--algo cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a class attribute name = '...' to be registered")
    existing = ALGORITHMS.get(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"algorithm name {cls.name!r} is already taken by {existing.__qualname__}")
    ALGORITHMS[cls.name] = cls
    return cls


def _load_builtin() -> None:
    for module in ("spo", "spo_pp", "grpo", "sao"):
        importlib.import_module(f"streamrl.algorithms.{module}")


def algorithm_class(spec: str) -> type[Algorithm]:
    """An algorithm class by registry name (``"spo++"``), ``"package.module:Class"`` or ``"path.py:Class"``."""
    _load_builtin()
    if spec in ALGORITHMS:
        return ALGORITHMS[spec]
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") and not Path(where).is_file():
            raise FileNotFoundError(f"algorithm file {where!r} does not exist (from --algo {spec!r})")
        module = import_user_module(where)  # a file: one module per resolved path, run once
        cls = getattr(module, attr, None)
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise ValueError(f"{spec!r} does not name an Algorithm subclass (found {cls!r})")
        return cls
    raise ValueError(
        f"unknown algorithm {spec!r}; valid: {', '.join(sorted(ALGORITHMS))}, "
        "or 'module:Class' / 'file.py:Class' for your own"
    )


def make_algorithm(
    spec: str, config: AlgorithmConfig | None = None, *, env: str | None = None, **overrides: Any
) -> Algorithm:
    """Build an algorithm by name with ``config``, or its env preset (a classmethod of its config class named
    after ``env``, e.g. ``SPOPPConfig.math_tir()``), or its default config; then apply ``overrides``."""
    cls = algorithm_class(spec)
    preset = getattr(cls.config_class, env, None) if env is not None else None
    if config is not None:
        base = config
    elif callable(preset):
        base = preset()
    else:
        base = cls.config_class()
    if overrides:
        valid = {f.name for f in fields(base)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"{cls.name} has no option(s) {unknown}; valid: {sorted(valid)}")
        base = type(base)(**{**{f.name: getattr(base, f.name) for f in fields(base)}, **overrides})
    return cls(base)


def scalar_advantages(
    episodes: Sequence[Episode], compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[float | torch.Tensor]:
    """Apply a per-trajectory estimator ``compute(A, L)`` (A: raw advantages R - baseline, L: action tokens)
    and return one float per episode. Shared by SPO, SPO++ and user algorithms with a tracker baseline."""
    raw = torch.tensor([e.reward - (e.ticket.baseline or 0.0) for e in episodes], dtype=torch.float64)
    lengths = torch.tensor([e.num_action_tokens for e in episodes], dtype=torch.float64)
    return [float(a) for a in compute(raw, lengths)]


def truncated_is_ppo_loss(
    inputs: PolicyInputs, *, eps_low: float, eps_high: float, dual_clip_c: float, is_threshold: float
) -> PolicyLoss:
    """The actor loss of SPO and SPO++ (docs/reference.md §3.6, §4.4): PPO-clip on pi / pi_old with bounds
    [1 - eps_low, 1 + eps_high] and Dual-Clip c, each token's loss multiplied by the detached rollout importance
    weight min(pi_old / pi_rollout, is_threshold), aggregated with the step's global counts."""
    is_ = rollout_importance_weights(
        inputs.old_logp, inputs.rollout_logp, inputs.mask, threshold=is_threshold
    )
    return ppo_policy_loss(
        inputs.logp,
        inputs.old_logp,
        inputs.advantages,
        inputs.mask,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_c=dual_clip_c,
        is_weights=is_.weights,
        agg=inputs.agg,
    )
