"""SPO: Single-stream Policy Optimization (Xu & Ding, arXiv 2509.13232), as its released recipe runs it
(verl-recipe ``spo``; docs/reference.md, SPO section).

- one rollout per task, baseline v̂ from a per-task Beta tracker applied in **learner receipt order** (Eq. 2);
- retention **derived from policy drift**: after the update, D(x) = mean |log pi_stored(y_prev) -
  log pi_new(y_prev)| on the task's previously stored response, rho = clamp(2^(-D/0.06), 0.875, 0.96); the
  outcome is filed then, and the response is stored with its post-update log-probs for the next visit;
- **trajectory whitening** of A = R - v̂ over the batch (Eq. 4), broadcast to action tokens;
- PPO-clip [0.2, 0.28], Dual-Clip c = 10, token-mean, rollout importance weights truncated at 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.advantages import trajectory_whiten
from streamrl.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    BatchRule,
    Episode,
    PolicyInputs,
    PolicyScorer,
    register_algorithm,
    scalar_advantages,
    truncated_is_ppo_loss,
)
from streamrl.algorithms.losses import PolicyLoss
from streamrl.algorithms.tracker import EventTracker, TrackerConfig, logprob_drift


@dataclass(frozen=True)
class SPOConfig(AlgorithmConfig):
    """SPO recipe hyperparameters (``run_spo.sh`` and verl defaults)."""

    batch_rule: BatchRule = "any"
    rho_min: float = 0.875
    """Lower clamp of the drift-derived retention (recipe ``clip_lower``)."""
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float = 10.0
    """Dual-Clip bound (recipe ``clip_ratio_c=10``)."""
    is_threshold: float = 2.0
    """Token-level rollout importance weight min(pi_old / pi_rollout, threshold), as in SPO++'s comparison."""


@register_algorithm
class SPO(Algorithm):
    name = "spo"
    config_class = SPOConfig
    min_batch = 2  # trajectory whitening (Eq. 4)
    config: SPOConfig

    def __init__(self, config: SPOConfig | None = None) -> None:
        super().__init__(config)
        self._stored: dict[str, tuple[Trajectory, torch.Tensor]] = {}
        """Per task: the last trained response and its log-probs right after that update."""

    def tracker_config(self, seed: int) -> TrackerConfig:
        return TrackerConfig.spo(rho_min=self.config.rho_min, seed=seed)

    def on_complete(self, tracker: EventTracker, episode: Episode) -> None:
        """SPO files outcomes after the update that trains them (``after_update``), not on return."""

    def advantages(self, episodes: Sequence[Episode]) -> list[float | torch.Tensor]:
        return scalar_advantages(episodes, lambda a, lengths: trajectory_whiten(a))

    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss:
        c = self.config
        return truncated_is_ppo_loss(
            inputs,
            eps_low=c.eps_low,
            eps_high=c.eps_high,
            dual_clip_c=c.dual_clip_c,
            is_threshold=c.is_threshold,
        )

    def after_update(
        self, tracker: EventTracker, episodes: Sequence[Episode], learner: PolicyScorer
    ) -> dict[str, float]:
        """File each outcome with the drift of its task's stored response, then store the new response."""
        previous = [self._stored.get(e.task_id) for e in episodes]
        stored = [p for p in previous if p is not None]
        rescored = iter(learner.episode_logprobs([p[0] for p in stored]))
        drifts: list[float] = []
        for episode, prev in zip(episodes, previous, strict=True):
            if prev is None:
                drift = 0.0  # first visit (recipe)
            else:
                new = next(rescored)
                mask = torch.ones(1, new.numel())
                drift = float(logprob_drift(prev[1][None], new[None], mask)[0]) if new.numel() else 0.0
            drifts.append(drift)
            tracker.record(episode.ticket, episode.reward, drift=drift)
        # last write wins when a task appears twice in one batch (recipe)
        for episode, logp in zip(
            episodes, learner.episode_logprobs([e.trajectory for e in episodes]), strict=True
        ):
            self._stored[episode.task_id] = (episode.trajectory, logp)
        return {"spo/drift_mean": sum(drifts) / len(drifts) if drifts else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {
            "stored": {
                task: {"trajectory": traj.to_dict(), "logprobs": logp.tolist()}
                for task, (traj, logp) in self._stored.items()
            }
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._stored = {
            task: (
                Trajectory.from_dict(item["trajectory"]),
                torch.tensor(item["logprobs"], dtype=torch.float32),
            )
            for task, item in state.get("stored", {}).items()
        }
