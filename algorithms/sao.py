"""SAO: Single-rollout Asynchronous Optimization (Hou, Li, Tang, Dong, arXiv 2607.07508; docs/reference.md §5).

- **one rollout per task**, any finished trajectory trainable (``batch_rule="any"``), bookkeeping tracker;
- **a critic** V_phi (``Critic``): a second copy of the policy's starting backbone with its own LoRA on the
  MLP projections only -- the attention stays frozen (decision D13) -- and a scalar value head, trained with
  the clipped value loss (decision D12) on action tokens towards lambda = 1 returns, **K = 2 critic steps per
  policy update** (two time-scales), and **critic-only warm-up** (``train_policy``: the first
  ``warmup_updates`` updates train the critic alone);
- **skip-observation token GAE** (SAO Eq. 4-5) with the **length-adaptive lambda** = 1 - 1/(alpha l), l the
  episode's action tokens (decision D10), gamma = 1 (D11), whitened over the batch's action tokens (D14);
- **DIS** (SAO Eq. 1-3, ``dis_policy_loss``): r = pi_theta / pi_rollout against the *rollout* log-probs (no
  pi_old), tokens outside 1 - eps_l < r < 1 + eps_h get no gradient, token-mean over the batch's action tokens
  with the global count (decisions D8, D9); eps per env (``SAOConfig.math_tir``, ``SAOConfig.alfworld``);
- **value pretraining** (``pretrain_critic``, ``streamrl value-pretrain``): the initial policy's rollouts on
  the training tasks fit the critic before RL; ``SAOConfig.critic_init`` loads the result.

Skip-observation GAE over an episode's action tokens in sequence order is plain GAE on the compacted
sequence of its action tokens: observation tokens pass values and advantages through unchanged (reference
§1.4), so the last token of turn i bootstraps from the first token of turn i + 1 whether the turns share one
row (full context) or sit in rows of their own (window context). ``SAO.advantages`` therefore computes GAE
on the compacted form and returns one value per action token, which the learner spreads over the rows.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from streamrl.agents.batch import TokenBatch, collate
from streamrl.agents.logprobs import last_hidden_states
from streamrl.agents.lora import LoRAConfig, trainable_parameters, wrap_lora
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.advantages import (
    discounted_returns,
    gae,
    length_adaptive_lambda,
    masked_whiten,
    outcome_token_rewards,
)
from streamrl.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    BatchRule,
    Episode,
    PolicyInputs,
    SetupContext,
    register_algorithm,
)
from streamrl.algorithms.learner import (
    TrainingRow,
    length_sorted_chunks,
    per_episode,
    score_rows,
    training_rows,
)
from streamrl.algorithms.losses import LossAggregation, PolicyLoss, clipped_value_loss, dis_policy_loss
from streamrl.algorithms.tracker import EventTracker, TrackerConfig

if TYPE_CHECKING:
    from streamrl.algorithms.learner import Learner

MLP_PROJECTIONS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
"""The MLP (FFN) projections of Qwen2/Llama-style decoders: the only modules the critic's LoRA adapts."""


@dataclass(frozen=True)
class SAOConfig(AlgorithmConfig):
    """SAO hyperparameters (reference §5). Presets per env: :meth:`math_tir`, :meth:`alfworld`.

    The paper trains a 30B MoE at policy lr 1e-6 and critic lr 5e-6 for about 1000 steps with 10 critic-only
    warm-up steps; the defaults below are scaled to this project's runs (``tiny``, tens of updates on CPU),
    each field says how.
    """

    batch_rule: BatchRule = "any"
    """Any finished trajectory within the staleness bound is trainable as soon as it completes (§5.2)."""
    eps_low: float = 0.3
    """DIS band below: tokens with r <= 1 - eps_low get no gradient (math/TIR 0.3, SWE 0.8)."""
    eps_high: float = 5.0
    """DIS band above: tokens with r >= 1 + eps_high get no gradient (math/TIR 5.0, SWE 3.0)."""
    gamma: float = 1.0
    """Discount of the policy and critic GAE (decision D11)."""
    alpha: float = 1.5
    """Length-adaptive GAE: lambda = 1 - 1 / (alpha * l), l the episode's action tokens (VAPO; decision D10)."""
    whiten: bool = True
    """Whiten the GAE advantages over the update batch's action tokens (verl ``masked_whiten``; decision D14)."""
    critic_updates: int = 2
    """K: critic optimizer steps per policy update, on the same batch (the faster value update, §5.2)."""
    warmup_updates: int = 2
    """Updates at the start of a run that train the critic only (the paper: 10 of ~1000 steps). A CPU run
    here is 2-100 updates, where 10 would freeze the policy for most of it; 2 (4 critic steps at K = 2) take
    the freshly initialized head from noise to the batch's returns before the first policy step. Use 0 with a
    pretrained critic (``critic_init``)."""
    critic_lr: float = 1e-3
    """Critic AdamW learning rate (the paper: 5e-6, 5x its policy lr of 1e-6, for full-parameter FFN
    training of a 30B model). Here the critic trains a LoRA (zero-initialized B, scaled by alpha / rank) and
    a fresh value head, which need a rate about 10x a full fine-tune's: 1e-3 against ``tiny``'s policy lr of
    1e-4 keeps the paper's critic-faster-than-policy ratio."""
    critic_weight_decay: float = 0.0
    """Critic AdamW decoupled weight decay."""
    critic_max_grad_norm: float = 1.0
    """Gradient-norm clipping of each critic step (the paper freezes attention because of critic grad-norm
    spikes; clipping bounds what is left)."""
    critic_lora_rank: int = 16
    """Rank of the critic's LoRA on the MLP projections."""
    critic_lora_alpha: int = 32
    """LoRA scale numerator of the critic (update scaled by alpha / rank)."""
    critic_lora_targets: tuple[str, ...] = MLP_PROJECTIONS
    """Module names the critic's LoRA adapts: the MLP projections only, so attention stays frozen (D13)."""
    value_clip: float | None = 0.5
    """Clip range of the value loss around the values at the start of the update (decision D12); ``None``
    gives the plain squared error."""
    critic_init: str | None = None
    """A directory written by ``streamrl value-pretrain`` (``pretrain_critic``): start the critic from it.
    It must have been fitted on the same starting model and with the same LoRA shape."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_rule == "groups" or self.group_size != 1:
            raise ValueError(
                f"SAO trains one rollout per task: batch_rule must be 'any' or 'current-version' and "
                f"group_size 1, got batch_rule={self.batch_rule!r}, group_size={self.group_size}"
            )
        if not 0 < self.eps_low <= 1 or self.eps_high <= 0:
            raise ValueError(
                f"need 0 < eps_low <= 1 and eps_high > 0, got eps_low={self.eps_low}, eps_high={self.eps_high}"
            )
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.critic_updates < 1:
            raise ValueError(f"critic_updates must be >= 1, got {self.critic_updates}")
        if self.warmup_updates < 0:
            raise ValueError(f"warmup_updates must be >= 0, got {self.warmup_updates}")
        if self.critic_lr < 0 or self.critic_weight_decay < 0 or self.critic_max_grad_norm <= 0:
            raise ValueError(
                "need critic_lr >= 0, critic_weight_decay >= 0 and critic_max_grad_norm > 0, got "
                f"{self.critic_lr}, {self.critic_weight_decay}, {self.critic_max_grad_norm}"
            )
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")
        if isinstance(self.critic_lora_targets, str) or not self.critic_lora_targets:
            raise ValueError(
                f"critic_lora_targets must be a non-empty tuple of module names, got {self.critic_lora_targets!r}"
            )
        object.__setattr__(self, "critic_lora_targets", tuple(self.critic_lora_targets))  # YAML gives lists
        LoRAConfig(rank=self.critic_lora_rank, alpha=self.critic_lora_alpha)  # validates rank and alpha

    @classmethod
    def math_tir(cls, **overrides: Any) -> SAOConfig:
        """Math-TIR: the paper's math/TIR band, eps_l = 0.3, eps_h = 5.0 (accept 0.7 < r < 6)."""
        return cls(**{"eps_low": 0.3, "eps_high": 5.0, **overrides})

    @classmethod
    def alfworld(cls, **overrides: Any) -> SAOConfig:
        """ALFWorld: the paper's agentic (SWE) band, eps_l = 0.8, eps_h = 3.0 (accept 0.2 < r < 4), decision
        D19: a multi-turn agent env whose long episodes span more policy versions, like SWE's."""
        return cls(**{"eps_low": 0.8, "eps_high": 3.0, **overrides})


# ---------------------------------------------------------------------------------------------------------
# Advantages and value targets on the compacted action-token sequences
# ---------------------------------------------------------------------------------------------------------


def _pack(per_episode_values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-pad 1-D tensors into ``(values [B, L_max] float64, mask [B, L_max], kept episode indices)``,
    leaving out episodes without action tokens."""
    kept = [i for i, v in enumerate(per_episode_values) if v.numel()]
    width = max((per_episode_values[i].numel() for i in kept), default=0)
    values = torch.zeros(len(kept), width, dtype=torch.float64)
    mask = torch.zeros(len(kept), width, dtype=torch.float64)
    for row, i in enumerate(kept):
        n = per_episode_values[i].numel()
        values[row, :n] = per_episode_values[i].double()
        mask[row, :n] = 1.0
    return values, mask, kept


def _unpack(
    padded: torch.Tensor, mask: torch.Tensor, kept: Sequence[int], episodes: int
) -> list[torch.Tensor]:
    out = [torch.empty(0) for _ in range(episodes)]
    for row, i in enumerate(kept):
        out[i] = padded[row][mask[row].bool()].float()
    return out


def skip_observation_gae(
    values: Sequence[torch.Tensor],
    rewards: Sequence[float],
    *,
    gamma: float = 1.0,
    alpha: float = 1.5,
    whiten: bool = True,
) -> list[torch.Tensor]:
    """SAO's policy advantages (reference §5.3-5.4), one 1-D tensor per episode with one value per action token.

    ``values[i]`` holds V at each action token of episode i in sequence order (the value of the state before
    the token), ``rewards[i]`` its outcome, placed on its last action token. GAE runs on the compacted action
    tokens (module doc) with gamma and lambda_i = 1 - 1/(alpha L_i) (``length_adaptive_lambda``); with
    ``whiten`` the advantages are standardized over all action tokens of the batch (``masked_whiten``, D14;
    skipped when the batch has a single action token). Episodes without action tokens get an empty tensor.
    """
    if len(values) != len(rewards):
        raise ValueError(f"{len(values)} value sequences for {len(rewards)} rewards")
    padded, mask, kept = _pack(values)
    if not kept:
        return [torch.empty(0) for _ in values]
    token_rewards = outcome_token_rewards(
        torch.tensor([float(rewards[i]) for i in kept], dtype=torch.float64), mask
    )
    lam = length_adaptive_lambda(mask.sum(-1), alpha)
    advantages = gae(token_rewards, padded, mask, gamma=gamma, lam=lam).advantages
    if whiten and float(mask.sum()) > 1:
        advantages = masked_whiten(advantages, mask)
    return _unpack(advantages, mask, kept, len(values))


def value_targets(
    lengths: Sequence[int], rewards: Sequence[float], *, gamma: float = 1.0
) -> list[torch.Tensor]:
    """The critic's targets: lambda = 1 returns per action token (``discounted_returns``; with gamma = 1 the
    outcome reward on every action token), one 1-D tensor per episode of ``lengths[i]`` action tokens."""
    _, mask, kept = _pack([torch.zeros(n) for n in lengths])
    if not kept:
        return [torch.empty(0) for _ in lengths]
    token_rewards = outcome_token_rewards(
        torch.tensor([float(rewards[i]) for i in kept], dtype=torch.float64), mask
    )
    return _unpack(discounted_returns(token_rewards, mask, gamma=gamma), mask, kept, len(lengths))


def _split_rows(
    per_episode_values: Sequence[torch.Tensor], rows: Sequence[TrainingRow]
) -> list[torch.Tensor]:
    """Each row's slice of its episode's per-action-token values (rows in ``training_rows`` order)."""
    cursor = [0] * len(per_episode_values)
    out = []
    for row in rows:
        n = row.sequence.num_action_tokens
        out.append(per_episode_values[row.episode][cursor[row.episode] : cursor[row.episode] + n])
        cursor[row.episode] += n
    return out


# ---------------------------------------------------------------------------------------------------------
# The critic
# ---------------------------------------------------------------------------------------------------------


class Critic:
    """V_phi: the starting backbone (its own copy) + a LoRA on the MLP projections + a scalar value head.

    ``values`` gives, for every action token, the value of the state before it: the head applied to the last
    hidden state at the position that predicts the token (``TokenBatch.action_mask``'s alignment). Only the
    LoRA and the head train (the backbone, its attention included, is frozen: decision D13). The head starts
    like a Hugging Face score head (normal, std = the model's ``initializer_range``, zero bias, seeded).

    The copy is separate from the policy because the policy's weights move (full fine-tuning on ``tiny``)
    while the critic's backbone must stay the starting checkpoint.
    """

    def __init__(
        self,
        model_dir: str | Path,
        config: SAOConfig,
        *,
        device: torch.device | str = "cpu",
        pad_token_id: int,
        micro_batch_tokens: int = 16384,
        seed: int = 0,
    ) -> None:
        from streamrl.agents.models import load_model

        self.model_dir = Path(model_dir)
        self.config = config
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.micro_batch_tokens = micro_batch_tokens
        lora = LoRAConfig(
            rank=config.critic_lora_rank,
            alpha=config.critic_lora_alpha,
            target_modules=config.critic_lora_targets,
            seed=seed,
        )
        with torch.random.fork_rng(devices=[]):  # the run's global generator is not touched
            torch.manual_seed(seed)
            backbone = load_model(self.model_dir)
            hidden = int(backbone.config.hidden_size)
            self.head = torch.nn.Linear(hidden, 1)
            torch.nn.init.normal_(
                self.head.weight, std=float(getattr(backbone.config, "initializer_range", 0.02))
            )
            torch.nn.init.zeros_(self.head.bias)
        self.model = wrap_lora(backbone, lora).to(self.device).eval()
        self.head.to(self.device)
        self.params = [*trainable_parameters(self.model), *self.head.parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.critic_lr, weight_decay=config.critic_weight_decay
        )
        self.steps = 0
        """Critic optimizer steps taken."""
        self._autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        )

    def trainable_names(self) -> list[str]:
        """Names of the backbone parameters that train (the LoRA matrices; the head is ``head.*``)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    # -- values ---------------------------------------------------------------------------------------------
    def _forward(self, batch: TokenBatch) -> torch.Tensor:
        """Values at ``batch.action_mask`` positions, flat, fp32 (the head runs outside autocast)."""
        with self._autocast:
            hidden = last_hidden_states(self.model, batch.input_ids, batch.attention_mask)
        return self.head(hidden[:, :-1][batch.action_mask].float()).squeeze(-1)

    def _score(self, rows: Sequence[TrainingRow]) -> list[torch.Tensor]:
        return score_rows(
            rows,
            self._forward,
            pad_token_id=self.pad_token_id,
            max_tokens=self.micro_batch_tokens,
            device=self.device,
        )

    def values(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
        """Per trajectory, V at each of its action tokens in sequence order (fp32, CPU, no grad)."""
        rows = training_rows(trajectories)
        return per_episode(rows, self._score(rows), len(trajectories))

    # -- training -------------------------------------------------------------------------------------------
    def update(
        self,
        trajectories: Sequence[Trajectory],
        returns: Sequence[torch.Tensor],
        *,
        steps: int,
        clip_range: float | None,
    ) -> dict[str, float]:
        """``steps`` optimizer steps on ``trajectories`` towards ``returns`` (one 1-D tensor per trajectory,
        one target per action token), each over the whole batch: ``clipped_value_loss`` around the values at
        the start of the update, token-mean with the batch's token count across length-sorted micro-batches
        (gradient accumulation), gradient-norm clipping. Returns diagnostics (explained variance of the
        returns by the starting values, the mean loss over the steps, ...)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        rows = training_rows(trajectories)
        if not rows:
            raise ValueError("the critic's batch has no action tokens")
        for traj, ret in zip(trajectories, returns, strict=True):
            if ret.numel() != traj.num_action_tokens:
                raise ValueError(
                    f"trajectory of task {traj.task_id!r} has {traj.num_action_tokens} action tokens but "
                    f"{ret.numel()} returns"
                )
        row_returns = _split_rows(returns, rows)
        old = self._score(rows)
        flat_old, flat_ret = torch.cat(old), torch.cat(row_returns).float()
        total = flat_ret.numel()
        agg = LossAggregation("token-mean", num_tokens=float(total))
        losses: list[float] = []
        clip_fracs: list[float] = []
        norms: list[float] = []
        for _ in range(steps):
            loss_sum = clipped = 0.0
            for chunk in length_sorted_chunks(rows, self.micro_batch_tokens):
                batch = collate([rows[i].sequence for i in chunk], self.pad_token_id).to(self.device)
                values = batch.scatter(self._forward(batch))
                out = clipped_value_loss(
                    values,
                    batch.scatter(torch.cat([old[i] for i in chunk]).to(self.device)),
                    batch.scatter(torch.cat([row_returns[i] for i in chunk]).float().to(self.device)),
                    batch.action_mask,
                    clip_range=clip_range,
                    agg=agg,
                )
                out.loss.backward()
                loss_sum += float(out.loss.detach())
                clipped += float(out.clip_frac) * out.num_tokens
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, self.config.critic_max_grad_norm)))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
            losses.append(loss_sum)
            clip_fracs.append(clipped / total)
        return {
            "value_loss": sum(losses) / len(losses),
            "value_loss_first_step": losses[0],
            "value_clip_frac": sum(clip_fracs) / len(clip_fracs),
            "explained_variance": explained_variance(flat_old, flat_ret),
            "values_mean": float(flat_old.mean()),
            "returns_mean": float(flat_ret.mean()),
            "grad_norm": sum(norms) / len(norms),
            "steps": float(self.steps),
        }

    # -- state ----------------------------------------------------------------------------------------------
    def _weights(self) -> dict[str, torch.Tensor]:
        names = set(self.trainable_names())
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if k in names}

    def _load_weights(self, weights: Mapping[str, torch.Tensor], head: Mapping[str, torch.Tensor]) -> None:
        expected = set(self.trainable_names())
        if set(weights) != expected:
            missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
            raise ValueError(
                f"critic weights do not fit this critic's LoRA (missing {missing[:3]}, unexpected {extra[:3]})"
            )
        self.model.load_state_dict(dict(weights), strict=False)
        self.head.load_state_dict(dict(head))

    def state_dict(self) -> dict[str, Any]:
        """Trainable weights (LoRA + head), optimizer state and step count (``torch.save``-able)."""
        return {
            "weights": self._weights(),
            "head": {k: v.detach().cpu().clone() for k, v in self.head.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_weights(state["weights"], state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def _identity(self) -> dict[str, Any]:
        from streamrl.agents.models import weights_fingerprint

        return {
            "weights_fingerprint": weights_fingerprint(self.model_dir, head_bytes=None),
            "lora_rank": self.config.critic_lora_rank,
            "lora_alpha": self.config.critic_lora_alpha,
            "lora_targets": list(self.config.critic_lora_targets),
        }

    def save(self, directory: str | Path, report: Mapping[str, Any] | None = None) -> Path:
        """Write ``critic.pt`` (LoRA + head weights) and ``critic.json`` (the starting model's weights
        fingerprint, the LoRA shape, ``report``) into ``directory``: what ``SAOConfig.critic_init`` loads."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        torch.save({"weights": state["weights"], "head": state["head"]}, path / "critic.pt")
        meta = {**self._identity(), "model_dir": str(self.model_dir), "report": dict(report or {})}
        (path / "critic.json").write_text(json.dumps(meta, indent=2))
        return path

    def load_pretrained(self, directory: str | Path) -> dict[str, Any]:
        """Load weights written by ``save`` (the optimizer starts fresh); returns the saved metadata. Raises
        ``ValueError`` if they were fitted on other starting weights or with another LoRA shape."""
        path = Path(directory)
        if not (path / "critic.pt").is_file() or not (path / "critic.json").is_file():
            raise ValueError(
                f"critic_init={str(directory)!r} holds no critic (critic.pt, critic.json); write one with "
                "`streamrl value-pretrain --out DIR`"
            )
        meta = json.loads((path / "critic.json").read_text())
        mine = self._identity()
        differ = sorted(k for k in mine if meta.get(k) != mine[k])
        if differ:
            diffs = ", ".join(f"{k}: saved {meta.get(k)!r}, here {mine[k]!r}" for k in differ)
            raise ValueError(
                f"critic_init={str(directory)!r} does not fit this run's critic ({diffs}); it was fitted on "
                f"{meta.get('model_dir')!r}: pretrain it on the run's starting model and LoRA shape"
            )
        blob = torch.load(path / "critic.pt", weights_only=True)
        self._load_weights(blob["weights"], blob["head"])
        return dict(meta)


# ---------------------------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------------------------


@register_algorithm
class SAO(Algorithm):
    name = "sao"
    config_class = SAOConfig
    config: SAOConfig
    critic: Critic | None

    def __init__(self, config: SAOConfig | None = None) -> None:
        super().__init__(config)
        self.critic = None

    def setup(self, context: SetupContext) -> None:
        """Build the critic from the policy's starting model (and ``critic_init``, if set)."""
        self.critic = Critic(
            context.model_dir,
            self.config,
            device=context.device,
            pad_token_id=context.pad_token_id,
            micro_batch_tokens=context.micro_batch_tokens,
            seed=context.seed,
        )
        if self.config.critic_init is not None:
            meta = self.critic.load_pretrained(self.config.critic_init)
            context.log(
                f"critic: from {self.config.critic_init} ({meta.get('report', {}).get('episodes', '?')} episodes)"
            )

    def _critic(self) -> Critic:
        if self.critic is None:
            raise RuntimeError(
                "SAO's critic is not built: call SAO.setup(SetupContext(...)) first (the Trainer does)"
            )
        return self.critic

    def tracker_config(self, seed: int) -> TrackerConfig:
        return TrackerConfig.bookkeeping(seed=seed)

    def train_policy(self, update: int) -> bool:
        """Critic-only warm-up: the first ``warmup_updates`` updates leave the policy as it is."""
        return update >= self.config.warmup_updates

    def advantages(self, episodes: Sequence[Episode]) -> list[float | torch.Tensor]:
        """Skip-observation GAE with length-adaptive lambda on the critic's values (``skip_observation_gae``)."""
        c = self.config
        values = self._critic().values([e.trajectory for e in episodes])
        return list(
            skip_observation_gae(
                values, [e.reward for e in episodes], gamma=c.gamma, alpha=c.alpha, whiten=c.whiten
            )
        )

    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss:
        """DIS against the rollout log-probs (SAO drops pi_old); ``inputs.agg`` is the global token-mean."""
        return dis_policy_loss(
            inputs.logp,
            inputs.rollout_logp,
            inputs.advantages,
            inputs.mask,
            eps_low=self.config.eps_low,
            eps_high=self.config.eps_high,
            agg=inputs.agg,
        )

    def after_update(
        self, tracker: EventTracker, episodes: Sequence[Episode], learner: Learner
    ) -> dict[str, float]:
        """K critic steps on the batch towards lambda = 1 returns (also during the warm-up)."""
        c = self.config
        trajectories = [e.trajectory for e in episodes]
        returns = value_targets(
            [t.num_action_tokens for t in trajectories], [e.reward for e in episodes], gamma=c.gamma
        )
        metrics = self._critic().update(
            trajectories, returns, steps=c.critic_updates, clip_range=c.value_clip
        )
        return {f"critic/{k}": v for k, v in metrics.items()}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.critic is None else {"critic": self.critic.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "critic" in state:
            self._critic().load_state_dict(state["critic"])


# ---------------------------------------------------------------------------------------------------------
# Value pretraining
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValuePretrainConfig:
    """Value pretraining (SAO §5.2; ``streamrl value-pretrain``): roll out the initial policy on the training
    tasks and fit the critic to the outcomes, before RL. The critic's shape and optimizer are ``SAOConfig``'s
    ``critic_*`` fields, so the result fits an SAO run with the same ones (``SAOConfig.critic_init``)."""

    out: str = ""
    """Directory to write the critic into (``critic.pt``, ``critic.json``); required, must not hold one."""
    env: Literal["math_tir", "alfworld"] = "math_tir"
    """The env whose training tasks are rolled out."""
    model: str = "tiny"
    """Registry name or local Hugging Face directory (as ``streamrl train --model``)."""
    init: Literal["sft", "base"] = "sft"
    """The starting policy, as ``streamrl train --init``: the env's SFT checkpoint or the bare model. The RL
    run must start from the same one."""
    tasks: int | None = None
    """Roll out the first N training tasks (``None`` = all)."""
    rollouts: int = 8
    """Rollouts per task (the paper pretrains on 6k samples; n0 = 8 as the offline values of the tracker)."""
    epochs: int = 4
    """Passes of the critic over the episodes."""
    batch: int = 16
    """Episodes per critic step."""
    num_envs: int = 16
    """Episodes in flight at once during the rollouts."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the RL run's)."""
    constrain_actions: bool = False
    """Roll out choosing among the env's actions (``LLMAgent(constrain_actions=True)``), as ``streamrl train
    --constrain-actions`` does: the critic learns the returns of the policy it rolls out, so set this (and
    ``avoid_repeats``) as the SAO run will."""
    avoid_repeats: bool = False
    """With ``constrain_actions``: no command twice from one state (``LLMAgent(avoid_repeats=True)``)."""
    max_new_tokens: int | None = None
    """Tokens per turn; ``None`` = the env's default."""
    env_workers: Literal["subprocess", "inprocess"] = "subprocess"
    """Vector env workers."""
    device: str = "auto"
    """Where the policy generates and the critic trains (``"auto"`` = CUDA when present)."""
    micro_batch_tokens: int = 16384
    """Padded tokens per critic forward pass."""
    threads: int = 1
    """torch threads."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("out (the critic's directory) is required, e.g. out='critics/math_tir'")
        if self.env not in ("math_tir", "alfworld"):
            raise ValueError(f"unknown env {self.env!r}; valid: 'math_tir', 'alfworld'")
        if self.init not in ("sft", "base"):
            raise ValueError(f"init must be 'sft' or 'base', got {self.init!r}")
        for name in ("rollouts", "epochs", "batch", "num_envs", "micro_batch_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tasks is not None and self.tasks < 1:
            raise ValueError(f"tasks must be >= 1 or None, got {self.tasks}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.avoid_repeats and not self.constrain_actions:
            raise ValueError("avoid_repeats=True needs constrain_actions=True: it removes choices")
        if self.constrain_actions:
            from streamrl.agents.env_specs import env_spec

            if not env_spec(self.env).lists_actions:
                raise ValueError(
                    f"constrain_actions=True: the {self.env} env's prompt format has no action_choices to "
                    "choose among"
                )


def pretrain_critic(
    config: ValuePretrainConfig,
    sao: SAOConfig | None = None,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Roll out the initial policy ``config.rollouts`` times on each training task, fit a fresh critic (or
    ``sao.critic_init``) on the episodes for ``config.epochs`` epochs of steps of ``config.batch`` episodes
    (plain squared error towards the lambda = 1 returns: no clipping, nothing to stay close to), and save it
    to ``config.out``. Returns the report that ``critic.json`` also holds."""
    from streamrl.agents.base import SamplingParams, derive_seed
    from streamrl.agents.env_specs import env_spec, make_env, task_ids_of
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.models import load_tokenizer, resolve_model
    from streamrl.algorithms.runtime import Job, Rollouts, collect
    from streamrl.algorithms.sft import SFTConfig, sft_checkpoint
    from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

    sao = sao if sao is not None else SAOConfig()
    out = Path(config.out)
    if (out / "critic.pt").exists():
        raise ValueError(f"{out} already holds a critic; choose another out")
    started = time.perf_counter()
    torch.set_num_threads(config.threads)
    spec = env_spec(config.env)
    if config.init == "sft":
        model_dir = sft_checkpoint(SFTConfig.for_env(config.env, model=config.model), log=log)
    else:
        model_dir = resolve_model(config.model)
    probe = make_env(config.env, spec.train_split)
    task_ids = task_ids_of(probe, config.env)
    probe.close()
    if config.tasks is not None:
        if config.tasks > len(task_ids):
            raise ValueError(
                f"tasks={config.tasks} must be in [1, {len(task_ids)}] (the {config.env} training tasks)"
            )
        task_ids = task_ids[: config.tasks]

    tokenizer = load_tokenizer(model_dir)
    # the critic first: a critic_init that does not fit fails before the rollouts
    algorithm = SAO(sao)
    algorithm.setup(
        SetupContext(
            model_dir=Path(model_dir),
            device=HFBackendConfig(device=config.device).torch_device(),
            pad_token_id=int(tokenizer.pad_token_id),
            tokenizer=tokenizer,
            micro_batch_tokens=config.micro_batch_tokens,
            seed=derive_seed(config.seed, "algorithm"),
            log=log,
        )
    )
    critic = algorithm._critic()
    backend = HFBackend(
        model_dir, tokenizer=tokenizer, config=HFBackendConfig(device=config.device, seed=config.seed)
    )
    sampling = SamplingParams(  # the run seed: each (episode, turn) samples with a seed derived from it
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens or spec.max_new_tokens,
        seed=derive_seed(config.seed, "value"),
    )
    venv = StreamingVectorEnv.from_env(
        spec.gym_id,
        config.num_envs,
        config=VectorEnvConfig(backend=config.env_workers),
        split=spec.train_split,
        **dict(spec.env_kwargs),
    )
    try:
        rollouts = Rollouts(
            venv,
            spec.llm_agent(
                backend,
                sampling,
                constrain_actions=config.constrain_actions,
                avoid_repeats=config.avoid_repeats,
                tokenizer=tokenizer,
            ),
            seed=derive_seed(config.seed, "value"),
            lockstep=True,
        )
        jobs = [
            Job(t, i * config.rollouts + k) for i, t in enumerate(task_ids) for k in range(config.rollouts)
        ]
        done = collect(rollouts, jobs)
    finally:
        venv.close()
        backend.close()
    episodes = [
        d.trajectory
        for d in done
        if d.trajectory.info.get("error") is None and d.trajectory.num_action_tokens
    ]
    if not episodes:
        raise RuntimeError("value pretraining: no episode with action tokens came back")
    rollout_s = time.perf_counter() - started
    log(f"value pretraining: {len(episodes)} episodes in {rollout_s:.0f}s")

    returns = value_targets(
        [t.num_action_tokens for t in episodes], [t.reward for t in episodes], gamma=sao.gamma
    )
    rng = random.Random(derive_seed(config.seed, "value-batches"))
    history: list[dict[str, float]] = []
    for epoch in range(config.epochs):
        order = list(range(len(episodes)))
        rng.shuffle(order)
        steps = []
        for start in range(0, len(order), config.batch):
            idx = order[start : start + config.batch]
            steps.append(
                critic.update([episodes[i] for i in idx], [returns[i] for i in idx], steps=1, clip_range=None)
            )
        row = {
            "epoch": float(epoch + 1),
            **{k: sum(s[k] for s in steps) / len(steps) for k in ("value_loss", "grad_norm")},
            "explained_variance": explained_variance(
                torch.cat(critic.values(episodes)), torch.cat(list(returns))
            ),
        }
        history.append(row)
        log(f"value pretraining: epoch {epoch + 1}: {json.dumps(row)}")
    report = {
        "config": asdict(config),
        "episodes": len(episodes),
        "tasks": len(task_ids),
        "mean_reward": sum(t.reward for t in episodes) / len(episodes),
        "action_tokens": sum(t.num_action_tokens for t in episodes),
        "valid_action_rate": valid_action_rate(episodes),
        "epochs": history,
        "rollout_s": rollout_s,
        "seconds": time.perf_counter() - started,
    }
    critic.save(out, report)
    return {"out": str(out), **report}


def valid_action_rate(episodes: Sequence[Any]) -> float | None:
    """The share of the episodes' turns whose action the env accepted, over the turns with a verdict
    (``Turn.action_valid``); ``None`` when no turn has one (an env that does not judge its actions)."""
    verdicts = [t.action_valid for e in episodes for t in e.turns if t.action_valid is not None]
    return sum(verdicts) / len(verdicts) if verdicts else None


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over flat action-token values and returns (1: perfect; 0: no better than the
    mean; NaN when the returns do not vary)."""
    var = float(returns.float().var(unbiased=False))
    residual = float((returns.float() - values.float()).var(unbiased=False))
    return 1 - residual / var if var > 0 else math.nan
