"""SAO: Single-rollout Asynchronous Optimization (Hou, Li, Tang, Dong, arXiv 2607.07508; docs/reference.md §5).

- **one rollout per task**, any finished trajectory trainable (``batch_rule="any"``), bookkeeping tracker;
- **a critic** V_phi (``Critic``, ``streamrl.algorithms.critic``): a second copy of the policy's starting
  backbone with its own LoRA on the MLP projections only -- the attention stays frozen (decision D13) -- and a
  scalar value head, trained with the clipped value loss (decision D12) on action tokens towards lambda = 1
  returns, **K = 2 critic steps per policy update** (two time-scales), and **critic-only warm-up**
  (``train_policy``: the first ``warmup_updates`` updates train the critic alone);
- **skip-observation token GAE** (SAO Eq. 4-5) with the **length-adaptive lambda** = 1 - 1/(alpha l), l the
  episode's action tokens (decision D10), gamma = 1 (D11), whitened over the batch's action tokens (D14);
- **DIS** (SAO Eq. 1-3, ``dis_policy_loss``): r = pi_theta / pi_rollout against the *rollout* log-probs (no
  pi_old), tokens outside 1 - eps_l < r < 1 + eps_h get no gradient, token-mean over the batch's action tokens
  with the global count (decisions D8, D9); eps per env (``SAOConfig.math_tir``, ``SAOConfig.alfworld``);
- **value pretraining** (``pretrain_critic`` in ``streamrl.algorithms.value_pretrain``, ``streamrl
  value-pretrain``): the initial policy's rollouts on the training tasks fit the critic before RL;
  ``SAOConfig.critic_init`` loads the result.

Skip-observation GAE over an episode's action tokens in sequence order is plain GAE on the compacted
sequence of its action tokens: observation tokens pass values and advantages through unchanged (reference
§1.4), so the last token of turn i bootstraps from the first token of turn i + 1 whether the turns share one
row (full context) or sit in rows of their own (window context). ``SAO.advantages`` therefore computes GAE
on the compacted form and returns one value per action token, which the learner spreads over the rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from streamrl.agents.lora import LoRAConfig
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
    PolicyScorer,
    SetupContext,
    register_algorithm,
)
from streamrl.algorithms.critic import Critic
from streamrl.algorithms.losses import PolicyLoss, dis_policy_loss
from streamrl.algorithms.tracker import EventTracker, TrackerConfig

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
        self, tracker: EventTracker, episodes: Sequence[Episode], learner: PolicyScorer
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
