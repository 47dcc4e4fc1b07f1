"""SPO++: Stream-Aligned Policy Optimization (Ruan et al., arXiv 2608.24870), the reference implementation.

On top of SPO's single-stream baseline (docs/reference.md, SPO++ section):

- **event-time prompt memory** (Eq. 3): the tracker weighs each outcome by rho^(k_q - k_i), rho = 0.875 per
  policy event; the baseline v̂ is frozen at dispatch and carried on the ticket; an outcome is filed when its
  episode returns, so it informs later dispatches only;
- **action-token-measure normalization** (Eq. 6): A_i = R_i - v̂ standardized with weights L_i (the action
  tokens of trajectory i), so the token-mean loss over the whole batch sees zero-mean advantages (Eq. 5);
- PPO-clip [0.2, 0.28] with **Dual-Clip c = 2** and the token-level rollout importance weight
  min(pi_old / pi_rollout, 2) (App. A, Table 3);
- batches of the **first completed requests within each policy version**; older work is drained: filed in
  the tracker at its own version, not trained; publication every ``publish_every`` updates (1 on ALFWorld,
  2 on Math-TIR).

``normalization="trajectory"`` is the paper's Table 2 ablation (SPO's Eq. 4 whitening, everything else fixed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from streamrl.algorithms.advantages import weighted_standardize
from streamrl.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    BatchRule,
    Episode,
    PolicyInputs,
    register_algorithm,
    scalar_advantages,
)
from streamrl.algorithms.losses import PolicyLoss, ppo_policy_loss, rollout_importance_weights
from streamrl.algorithms.tracker import TrackerConfig

Normalization = Literal["token", "trajectory"]


@dataclass(frozen=True)
class SPOPPConfig(AlgorithmConfig):
    """SPO++ hyperparameters (App. A, Table 3). Presets per env: :meth:`alfworld`, :meth:`math_tir`."""

    batch_rule: BatchRule = "current-version"
    """First completed requests within each policy version (§2.4)."""
    normalization: Normalization = "token"
    """``"token"``: action-token-measure normalization, Eq. 6. ``"trajectory"``: SPO's Eq. 4 (ablation)."""
    rho: float = 0.875
    """Retention per policy event of the event-time memory (Eq. 3)."""
    eps_low: float = 0.2
    """PPO clip below: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """PPO clip above (clip-higher): ratio <= 1 + eps_high."""
    dual_clip_c: float = 2.0
    """Dual-Clip bound on negative advantages (SPO: 10)."""
    is_threshold: float = 2.0
    """Token-level rollout importance weight min(pi_old / pi_rollout, threshold)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.normalization not in ("token", "trajectory"):
            raise ValueError(f"normalization must be 'token' or 'trajectory', got {self.normalization!r}")
        if self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")

    @classmethod
    def alfworld(cls, **overrides: object) -> SPOPPConfig:
        """ALFWorld: publish after every update."""
        return cls(**{"publish_every": 1, **overrides})  # type: ignore[arg-type]

    @classmethod
    def math_tir(cls, **overrides: object) -> SPOPPConfig:
        """Math-TIR: publish after every two updates."""
        return cls(**{"publish_every": 2, **overrides})  # type: ignore[arg-type]


@register_algorithm
class SPOPP(Algorithm):
    name = "spo++"
    config_class = SPOPPConfig
    min_batch = 2  # standardized under the action-token measure (Eq. 6)
    config: SPOPPConfig

    def tracker_config(self, seed: int) -> TrackerConfig:
        return TrackerConfig.spo_pp(rho=self.config.rho, seed=seed)

    def advantages(self, episodes: Sequence[Episode]) -> list[float | torch.Tensor]:
        if self.config.normalization == "token":  # Eq. 6: weights L_i
            return scalar_advantages(episodes, weighted_standardize)
        return scalar_advantages(episodes, lambda a, lengths: weighted_standardize(a, torch.ones_like(a)))

    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss:
        c = self.config
        is_ = rollout_importance_weights(
            inputs.old_logp, inputs.rollout_logp, inputs.mask, threshold=c.is_threshold
        )
        return ppo_policy_loss(
            inputs.logp,
            inputs.old_logp,
            inputs.advantages,
            inputs.mask,
            eps_low=c.eps_low,
            eps_high=c.eps_high,
            dual_clip_c=c.dual_clip_c,
            is_weights=is_.weights,
            agg=inputs.agg,
        )
