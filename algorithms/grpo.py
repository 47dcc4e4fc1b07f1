"""GRPO (Shao et al. 2024, arXiv 2402.03300) and its variants Dr. GRPO (arXiv 2503.20783) and DAPO
(arXiv 2503.14476), on the same runtime as the single-stream methods (docs/reference.md, GRPO section).

G rollouts of one task are dispatched together (group seeding on the vector env) and trained only as a
complete group; each rollout's advantage is its reward standardized within its group, broadcast to its
action tokens. This is the synchronous-groups baseline the single-stream methods are measured against: a
group is as slow as its slowest member.

- ``variant="grpo"``: A = (r - mean_g) / (std_g + 1e-6), sequence-mean-token-mean loss (the paper's 1/|o_i|).
- ``variant="dr-grpo"``: A = r - mean_g (no std), loss sum / (B * T_max) (TRL ``dr_grpo``).
- ``variant="dapo"``: clip-higher [0.2, 0.28], token-mean loss, groups whose rewards are all equal (all 0
  or all 1) dropped from the batch (dynamic sampling; their advantages are 0 anyway).

The paper's ``- beta D_KL[pi_theta || pi_ref]`` term is the learner's (``LearnerConfig.kl_coef``, k3 by default,
``streamrl train --kl-coef 0.04``): 0 by default, as in Dr. GRPO and DAPO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from streamrl.algorithms.advantages import group_advantages
from streamrl.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    BatchRule,
    Episode,
    PolicyInputs,
    register_algorithm,
)
from streamrl.algorithms.losses import LossAggregation, PolicyLoss, ppo_policy_loss
from streamrl.algorithms.tracker import TrackerConfig

Variant = Literal["grpo", "dr-grpo", "dapo"]


@dataclass(frozen=True)
class GRPOConfig(AlgorithmConfig):
    """GRPO hyperparameters; ``variant`` picks the advantage scale, loss aggregation and clip bounds."""

    batch_rule: BatchRule = "groups"
    group_size: int = 8
    """G: rollouts per task (DeepSeekMath: 64; SPO's comparison arm: 8)."""
    variant: Variant = "grpo"
    """``"grpo"``, ``"dr-grpo"`` or ``"dapo"`` (module doc)."""
    eps_low: float = 0.2
    eps_high: float | None = None
    """Upper clip; ``None`` = ``eps_low`` for grpo / dr-grpo, 0.28 for dapo (clip-higher)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in ("grpo", "dr-grpo", "dapo"):
            raise ValueError(f"variant must be 'grpo', 'dr-grpo' or 'dapo', got {self.variant!r}")
        if self.batch_rule != "groups":
            raise ValueError(
                f"GRPO trains complete groups: batch_rule must be 'groups', got {self.batch_rule!r}"
            )


@register_algorithm
class GRPO(Algorithm):
    name = "grpo"
    config_class = GRPOConfig
    config: GRPOConfig

    def tracker_config(self, seed: int) -> TrackerConfig:
        return TrackerConfig.bookkeeping(seed=seed)

    def keep_group(self, rewards: Sequence[float]) -> bool:
        """DAPO's dynamic sampling drops groups with no reward variance; GRPO keeps every group."""
        return self.config.variant != "dapo" or len(set(rewards)) > 1

    def advantages(self, episodes: Sequence[Episode]) -> list[float | torch.Tensor]:
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
        groups = [e.group if e.group is not None else -1 - i for i, e in enumerate(episodes)]
        scale = "none" if self.config.variant == "dr-grpo" else "group"
        return [float(a) for a in group_advantages(rewards, groups, scale=scale)]

    def aggregation(self, mask: torch.Tensor) -> LossAggregation:
        mode = {"grpo": "seq-mean-token-mean", "dr-grpo": "dr-grpo", "dapo": "token-mean"}[
            self.config.variant
        ]
        return LossAggregation.of_batch(mask, mode)  # type: ignore[arg-type]

    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss:
        c = self.config
        eps_high = c.eps_high if c.eps_high is not None else (0.28 if c.variant == "dapo" else c.eps_low)
        return ppo_policy_loss(
            inputs.logp,
            inputs.old_logp,
            inputs.advantages,
            inputs.mask,
            eps_low=c.eps_low,
            eps_high=eps_high,
            agg=inputs.agg,
        )
