"""Value pretraining for SAO (SAO §5.2; ``streamrl value-pretrain``): roll out the initial policy on the training
tasks and fit the critic (``streamrl.algorithms.critic``) to the outcomes before RL; an SAO run loads the result
with ``SAOConfig.critic_init``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from streamrl.algorithms.base import (
    SetupContext,
)
from streamrl.algorithms.critic import explained_variance
from streamrl.algorithms.runtime import Job
from streamrl.algorithms.sao import SAO, SAOConfig, value_targets
from streamrl.algorithms.session import (
    ActionConstraint,
    EnvWorkers,
    RolloutFields,
    RolloutSession,
    env_hosting,
)


@dataclass(frozen=True)
class ValuePretrainConfig(ActionConstraint, RolloutFields):
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
    rollouts: int = 8
    """Rollouts per task (the paper pretrains on 6k samples; n0 = 8 as the offline values of the tracker)."""
    epochs: int = 4
    """Passes of the critic over the episodes."""
    batch: int = 16
    """Episodes per critic step."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the RL run's)."""
    env_workers: EnvWorkers = "subprocess"
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
        for name in ("rollouts", "epochs", "batch", "micro_batch_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for error in self.rollout_errors() + self.constraint_errors():
            raise ValueError(error)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
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
    from streamrl.agents.env_specs import env_spec
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.models import load_tokenizer, resolve_model
    from streamrl.sft import SFTConfig, sft_checkpoint

    sao = sao if sao is not None else SAOConfig()
    out = Path(config.out)
    if (out / "critic.pt").exists():
        raise ValueError(f"{out} already holds a critic; choose another out")
    started = time.perf_counter()
    torch.set_num_threads(config.threads)
    if config.init == "sft":
        model_dir = sft_checkpoint(SFTConfig.for_env(config.env, model=config.model), log=log)
    else:
        model_dir = resolve_model(config.model)
    session = RolloutSession(
        config.env,
        env_spec(config.env).train_split,
        num_envs=config.num_envs,
        workers=env_hosting(config.env, config.env_workers, config.envs_per_worker),
    )
    task_ids = session.first_tasks(config.tasks)

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
        max_new_tokens=config.max_new_tokens or session.spec.max_new_tokens,
        seed=derive_seed(config.seed, "value"),
    )
    try:
        agent = session.llm_agent(
            backend,
            sampling,
            constrain_actions=config.constrain_actions,
            avoid_repeats=config.avoid_repeats,
            tokenizer=tokenizer,
        )
        jobs = [
            Job(t, i * config.rollouts + k) for i, t in enumerate(task_ids) for k in range(config.rollouts)
        ]
        done = session.play(agent, jobs, seed=derive_seed(config.seed, "value"))
    finally:
        session.close()
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
