"""Write your own algorithm: REINFORCE with the tracker's baseline, on the runtime and learner SPO++ uses.

It answers ``streamrl/algorithms/base.py``'s questions: SPO++'s tracker (v̂ frozen on each ticket at dispatch),
batches of the current version (REINFORCE is on-policy), A = R - v̂, loss -A log pi (token-mean, no clip)::

    python examples/custom_algorithm.py               # 2 updates on tiny (TINY); --long for a real run
    streamrl train --algo examples/custom_algorithm.py:Reinforce --rho 0.9 --init base --updates 2 --batch 4
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from streamrl.algorithms.base import Algorithm, AlgorithmConfig, BatchRule, Episode, PolicyInputs
from streamrl.algorithms.base import register_algorithm as register
from streamrl.algorithms.losses import PolicyLoss, aggregate_loss
from streamrl.algorithms.tracker import TrackerConfig
from streamrl.algorithms.train import TrainConfig, train


@dataclass(frozen=True)
class ReinforceConfig(AlgorithmConfig):
    batch_rule: BatchRule = "current-version"
    """Train the current version's episodes only; older ones still inform the baseline."""
    rho: float = 0.875
    """Retention per policy event of the baseline's memory (SPO++ Eq. 3)."""


@register  # now make_algorithm("reinforce") and TrainConfig(algo="reinforce") find it
class Reinforce(Algorithm):
    name = "reinforce"
    config_class = ReinforceConfig
    config: ReinforceConfig

    def tracker_config(self, seed: int) -> TrackerConfig:
        return TrackerConfig.spo_pp(rho=self.config.rho, seed=seed)

    def advantages(self, episodes: Sequence[Episode]) -> list[float | torch.Tensor]:
        return [e.reward - (e.ticket.baseline or 0.0) for e in episodes]

    def policy_loss(self, inputs: PolicyInputs) -> PolicyLoss:
        loss = aggregate_loss(-inputs.advantages * inputs.logp, inputs.mask, inputs.agg)
        return PolicyLoss.unclipped(loss, inputs.logp, inputs.old_logp, inputs.mask)


TINY: dict[str, Any] = {"updates": 2, "batch": 4, "num_envs": 4, "tasks": 8, "offline_rollouts": 1}
TINY |= {"max_new_tokens": 16, "eval_episodes": 4, "init": "base", "env_workers": "inprocess"}
if __name__ == "__main__":  # TINY: seconds on a CPU, no SFT build; --long: TrainConfig's defaults
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="run directory (default: a new temporary one)")
    parser.add_argument("--rho", type=float, default=0.875, help="ReinforceConfig.rho")
    parser.add_argument("--long", action="store_true", help="60 updates of 64 from the SFT checkpoint")
    a = parser.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="reinforce-")
    print(train(TrainConfig(out=out, algo="reinforce", algorithm={"rho": a.rho}, **({} if a.long else TINY))))
