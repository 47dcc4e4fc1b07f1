"""SAO's critic V_phi (``Critic``): a second copy of the policy's starting backbone with its own LoRA on the MLP
projections (the attention stays frozen, decision D13) and a scalar value head, trained with the clipped value
loss (decision D12) towards per-action-token targets; saved and loaded for value pretraining
(``streamrl.algorithms.value_pretrain``, ``SAOConfig.critic_init``). Its shape and optimizer are ``SAOConfig``'s
``critic_*`` fields; the algorithm that uses it is ``streamrl.algorithms.sao``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from streamrl.agents.batch import TokenBatch, collate
from streamrl.agents.logprobs import last_hidden_states
from streamrl.agents.lora import LoRAConfig, trainable_parameters, wrap_lora
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.learner import (
    TrainingRow,
    length_sorted_chunks,
    per_episode,
    score_rows,
    training_rows,
)
from streamrl.algorithms.losses import LossAggregation, clipped_value_loss

if TYPE_CHECKING:
    from streamrl.algorithms.sao import SAOConfig


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


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over flat action-token values and returns (1: perfect; 0: no better than the
    mean; NaN when the returns do not vary)."""
    var = float(returns.float().var(unbiased=False))
    residual = float((returns.float() - values.float()).var(unbiased=False))
    return 1 - residual / var if var > 0 else math.nan
