"""Where a training run's parts run, as ``TrainConfig``'s placement fields say.

- the **learner**: this process alone, or data-parallel ranks 1..R-1 as local processes or Ray actors
  (``streamrl.algorithms.distributed``, ``streamrl.algorithms.ray_ranks``);
- the **rollout backend**: an in-process ``HFBackend``, a ``VLLMBackend`` engine, or ``RayEngines`` actors;
- the **env workers**: subprocesses, this process (debugging), or Ray actors (``VectorEnvConfig``).

The trainer builds each with the function here; none of them decides what is trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.algorithms.learner import Learner
from streamrl.algorithms.train_config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from streamrl.envs.vector import VectorEnvConfig


def make_learner(config: TrainConfig, policy: Any, model_dir: Path, pad_token_id: int) -> Learner:
    """The learner of ``policy`` (loaded from ``model_dir``): one process, or ``config.learner_ranks`` ranks of
    which this process is rank 0. ``ConfigError`` when Ray's ranks cannot match rank 0's device."""
    c = config
    total_steps = (c.schedule_updates or c.updates) * c.learner.mini_batches * c.learner.epochs
    if c.learner_ranks == 1:
        return Learner(
            policy, c.learner, pad_token_id=pad_token_id, total_steps=total_steps, temperature=c.temperature
        )
    from streamrl.algorithms.distributed import DistributedLearner, LearnerSpec

    spec = LearnerSpec(
        str(model_dir),
        c.learner,
        pad_token_id=pad_token_id,
        total_steps=total_steps,
        temperature=c.temperature,
        algorithm=c.algo,
        threads=c.threads,
    )
    if c.cluster != "ray":
        return DistributedLearner(policy, spec, c.learner_ranks)
    from streamrl.algorithms.ray_ranks import RayRanks

    ranks = RayRanks(num_cpus=c.learner_cpus, num_gpus=c.learner_gpus)
    try:
        return DistributedLearner(
            policy, spec, c.learner_ranks, init_method=ranks.init_method(), start_rank=ranks
        )
    except ValueError as exc:  # the ranks' devices do not fit rank 0's
        raise ConfigError(str(exc)) from exc


def make_backend(config: TrainConfig, model_dir: Path, tokenizer: Any) -> Any:
    """The rollout backend ``config.backend`` names, in this process or as Ray engines (``cluster="ray"``)."""
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.vllm_backend import VLLMBackend, VLLMBackendConfig

    c = config
    engine: HFBackendConfig | VLLMBackendConfig
    if c.backend == "vllm":
        engine = VLLMBackendConfig(max_lora_rank=c.learner.lora_rank, max_loras=c.keep_versions, seed=c.seed)
    else:  # an engine actor takes the device Ray gave it
        engine = HFBackendConfig(device=c.learner.device if c.cluster == "local" else "auto", seed=c.seed)
    if c.cluster == "ray":
        from streamrl.agents.ray_engines import RayEngines

        resources = {"num_cpus": c.engine_cpus, "num_gpus": c.engine_gpus}
        return RayEngines(
            model_dir, engine, engines=c.rollout_engines, actor_options=resources, tokenizer=tokenizer
        )
    if isinstance(engine, VLLMBackendConfig):
        return VLLMBackend(str(model_dir), config=engine)
    # The rollout backend has weights of its own: what it serves changes only at publication.
    return HFBackend(model_dir, tokenizer=tokenizer, config=engine)


def env_workers(config: TrainConfig) -> VectorEnvConfig:
    """How the sub-envs are hosted (``VectorEnvConfig``): local worker processes, or Ray actors."""
    from streamrl.algorithms.session import env_hosting
    from streamrl.envs.vector import VectorEnvConfig

    c = config
    if c.cluster == "local":
        return env_hosting(c.env, c.env_workers, c.envs_per_worker)
    per_actor = c.num_envs // (c.env_actors or c.num_envs)
    return VectorEnvConfig(
        backend="ray", envs_per_worker=per_actor, ray_actor_options={"num_cpus": c.env_actor_cpus}
    )
