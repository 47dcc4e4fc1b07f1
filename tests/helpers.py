"""What several test modules share (no test module imports another): the watched trainer of the training tests
(``run_config``, ``start``, ``assert_ledger_closes``), the one-rank / two-rank learner comparison
(``spec_for``, ``train_both``, ``assert_same_update``), the chaos driver of the vector env tests
(``scripted_env``, ``drive_episodes``, ``assert_exactly_once``) and a LoRA adapter with its probe log-probs
(``make_adapter``, ``adapter_logprobs``). Fixtures live in ``conftest.py``; ``tests/`` is on ``sys.path``
(``conftest.py``), so a test module imports these with ``from helpers import ...``."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from streamrl.agents.logprobs import token_logprobs
from streamrl.agents.lora import LoRAConfig, save_adapter, wrap_lora
from streamrl.agents.models import load_model, load_tokenizer, resolve_model
from streamrl.algorithms.base import Algorithm, Episode
from streamrl.algorithms.distributed import DistributedLearner, LearnerSpec
from streamrl.algorithms.learner import Learner, LearnerConfig
from streamrl.algorithms.tracker import Receipt, Ticket
from streamrl.algorithms.train import TrainConfig, Trainer
from streamrl.envs.vector import EnvResult, StreamingVectorEnv
from torch.distributed.tensor import DTensor
from vector_testenvs import ScriptedTextEnv

# ---------------------------------------------------------------------------------------------------------
# Training runs, watched from outside the trainer (test_train, test_ray, test_learner_ddp)
# ---------------------------------------------------------------------------------------------------------

QUIET: Callable[[str], None] = lambda _: None  # noqa: E731


def run_config(out: Path, model: Path | str = "tiny", **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = dict(
        out=str(out),
        env="math_tir",
        model=str(model),
        init="base",
        updates=2,
        batch=4,
        num_envs=4,
        tasks=4,
        offline_rollouts=1,
        eval_every=0,
        max_new_tokens=16,
        env_workers="inprocess",
        checkpoint_every=0,
    )
    values.update(overrides)
    return TrainConfig(**values)


@dataclass
class Update:
    """What the learner was given in one update, seen from outside the trainer."""

    version: int
    """The tracker's (served) policy version when the learner trained."""
    episodes: list[Episode]
    advantages: list[float]


@dataclass
class Run:
    trainer: Trainer
    updates: list[Update] = field(default_factory=list)
    receipts: list[tuple[int, Receipt]] = field(default_factory=list)
    """(tracker version when filed, receipt) for every outcome filed in the tracker."""
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    first_update: int = 1
    """The number of the first update this trainer runs (after the checkpoint's, when resumed)."""

    @property
    def rows(self) -> list[dict[str, Any]]:
        return update_rows(self.trainer.run_dir)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.learner.state_dict()["weights"]


def update_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "ledger/dispatched" in r]


def start(config: TrainConfig, *, resume: bool = False, cls: type[Trainer] = Trainer) -> Run:
    """A trainer whose learner updates and tracker records are watched (the calls go through unchanged)."""
    trainer = cls(config, resume=resume, progress=False, log=QUIET)
    initial = {k: v.clone() for k, v in trainer.learner.state_dict()["weights"].items()}
    run = Run(trainer, initial=initial, first_update=trainer.updates + 1)
    learner_update, record = trainer.learner.update, trainer.tracker.record

    def update(episodes: Sequence[Episode], advantages: Sequence[Any], algorithm: Any) -> dict[str, float]:
        values = [float(a) if not isinstance(a, torch.Tensor) else float(a.abs().max()) for a in advantages]
        run.updates.append(Update(trainer.tracker.version, list(episodes), values))
        return learner_update(episodes, advantages, algorithm)

    def watched_record(ticket: Ticket, reward: float, **kwargs: Any) -> Receipt:
        receipt = record(ticket, reward, **kwargs)
        run.receipts.append((trainer.tracker.version, receipt))
        return receipt

    trainer.learner.update = update  # type: ignore[method-assign]
    trainer.tracker.record = watched_record  # type: ignore[method-assign]
    return run


def assert_ledger_closes(rows: Sequence[Mapping[str, Any]]) -> None:
    assert rows
    for row in rows:
        ledger = {k.removeprefix("ledger/"): v for k, v in row.items() if k.startswith("ledger/")}
        settled = (
            ledger["trained"]
            + ledger["dropped_stale"]
            + ledger["dropped_group"]
            + ledger["failed"]
            + ledger["buffered"]
        )
        assert ledger["finished"] == settled, (row["update"], ledger)
        assert ledger["dispatched"] == settled + ledger["in_flight"], (row["update"], ledger)
        tokens = (
            ledger["trained_tokens"]
            + ledger["dropped_tokens"]
            + ledger["failed_tokens"]
            + ledger["buffered_tokens"]
            + ledger["in_flight_tokens"]
        )
        assert ledger["generated_tokens"] == tokens, (row["update"], ledger)
        assert ledger["trained"] == sum(
            len(r["batch/dispatch_indices"]) for r in rows if r["update"] <= row["update"]
        )


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------------------
# One rank against two on the same batch (test_learner_ddp, test_ray)
# ---------------------------------------------------------------------------------------------------------


def spec_for(algorithm: str, **config: Any) -> LearnerSpec:
    return LearnerSpec(
        model_dir=str(resolve_model("tiny")),
        config=LearnerConfig(**{"finetune": "full", "device": "cpu", **config}),
        pad_token_id=int(load_tokenizer(resolve_model("tiny")).pad_token_id),
        total_steps=4,
        algorithm=algorithm,
    )


def single_rank(spec: LearnerSpec) -> Learner:
    """The learner of one rank (replicated: a single learner holds the whole model) that ``spec``'s ranks make."""
    config = replace(spec.config, sharding="replicate")
    return Learner(
        load_model(spec.model_dir), config, pad_token_id=spec.pad_token_id, total_steps=spec.total_steps
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its FSDP shard (of a DTensor), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def record_steps(learner: Learner) -> list[list[torch.Tensor]]:
    """The gradient of every optimizer step, as the optimizer sees it (summed over ranks, clipped; with FSDP,
    rank 0's shard of it)."""
    grads: list[list[torch.Tensor]] = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        grads.append([local(p.grad).detach().clone() for p in learner.params])  # type: ignore[arg-type]

    learner.optimizer.register_step_pre_hook(hook)
    return grads


def train_both(
    spec: LearnerSpec, episodes: list[Episode], advantages: list[float], algorithm: Algorithm, **launch: Any
) -> tuple[dict[str, Any], dict[str, Any], DistributedLearner]:
    """The update of one rank and of two ranks (left running: the caller closes it) on the same batch;
    ``launch``: how ``DistributedLearner`` starts rank 1 (``start_rank``, ``init_method``)."""
    runs = []
    single = single_rank(spec)
    two = DistributedLearner(load_model(spec.model_dir), spec, 2, **launch)
    try:
        for learner in (single, two):
            grads = record_steps(learner)
            before = [p.detach().clone() for p in learner.params]
            metrics = learner.update(episodes, advantages, algorithm)
            runs.append({"grads": grads, "before": before, "after": list(learner.params), "metrics": metrics})
    except BaseException:
        two.close()
        raise
    return runs[0], runs[1], two


def assert_same_update(one: dict[str, Any], two: dict[str, Any], grads: float = 1e-5) -> None:
    """The same gradients at every step (to ``grads`` of their largest entry: float32 sums in another order),
    the same weights after the steps, and the same metrics.

    Weights: to 1e-6 relative in norm, and elementwise to 1e-6 of the largest weight wherever no step's
    gradient is within 100 x Adam's eps (1e-8) of 0 without being 0. There, Adam's first step
    lr g / (|g| + eps) has a slope of up to lr / eps = 1e4 and turns the 1e-10 rounding of a gradient entry
    into 1e-6 of a weight.
    """
    assert len(one["grads"]) == len(two["grads"]) >= 1
    for step_one, step_two in zip(one["grads"], two["grads"], strict=True):
        scale = max(float(g.abs().max()) for g in step_one)
        assert scale > 0
        worst = max(float((a - b).abs().max()) for a, b in zip(step_one, step_two, strict=True))
        assert worst <= grads * scale, (worst, scale)
    for a, b in zip(one["before"], two["before"], strict=True):
        assert torch.equal(a, b)
    after_one = [p.detach() for p in one["after"]]
    after_two = [p.detach() for p in two["after"]]
    moved = max(float((a - b).abs().max()) for a, b in zip(after_one, one["before"], strict=True))
    assert moved > 1e-5  # the steps moved the weights (lr 1e-4) ...
    diff = torch.cat([(a - b).flatten() for a, b in zip(after_one, after_two, strict=True)])
    norm = torch.cat([a.flatten() for a in after_one]).norm()
    assert float(diff.norm()) <= 1e-6 * float(norm)  # ... the same way on both
    flat = [torch.cat([g.flatten() for g in step]) for step in one["grads"]]
    steady = torch.stack([(g.abs() > 1e-6) | (g == 0) for g in flat]).all(0)
    assert float(steady.float().mean()) > 0.5
    scale = max(float(a.abs().max()) for a in after_one)
    assert float(diff[steady].abs().max()) <= 1e-6 * scale
    for key in ("loss", "grad_norm", "clip_frac", "ppo_kl", "approx_kl", "entropy", "rollout_kl"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key
    assert two["metrics"]["action_tokens"] == one["metrics"]["action_tokens"]


# ---------------------------------------------------------------------------------------------------------
# The vector env under faults: every episode comes back exactly once (test_vector_chaos, test_ray)
# ---------------------------------------------------------------------------------------------------------

EPISODE_LEN = 3


def scripted_env(**kwargs: Any) -> functools.partial[ScriptedTextEnv]:
    return functools.partial(ScriptedTextEnv, episode_len=EPISODE_LEN, latency=0.002, **kwargs)


def drive_episodes(
    venv: StreamingVectorEnv, episodes: int, kill_every: int, rng: random.Random
) -> dict[str, Any]:
    """Run ``episodes`` episodes first-ready over all sub-envs, SIGKILLing a random worker every
    ``kill_every`` recv calls (0 = never). Returns what was started, returned and seen."""
    started: list[int] = []
    finals: Counter[int] = Counter()
    steps: defaultdict[int, list[int]] = defaultdict(list)
    kinds: Counter[str] = Counter()
    kills = 0
    started += venv.reset_async(range(venv.num_envs))
    calls = 0
    while venv.num_pending:
        results: list[EnvResult] = venv.recv(timeout=60)
        assert results, f"no result within 60 s with {venv.num_pending} calls pending"
        calls += 1
        for r in results:
            assert r.episode_id in started, f"result for an episode never started: {r}"
            assert finals[r.episode_id] == 0, f"result after the final one: {r}"
            steps[r.episode_id].append(r.step)
            if r.error is not None:
                assert r.truncated and not r.terminated and r.reward == 0.0, r
                kinds[r.info["error_kind"]] += 1
            if r.done:
                finals[r.episode_id] += 1
                if len(started) < episodes:
                    started += venv.reset_async([r.env_id], options={"task_id": f"t{len(started) % 7}"})
            else:
                venv.send([r.env_id], [rng.choice(["go", "win"])])
        if kill_every and calls % kill_every == 0:
            pid = rng.choice(venv.worker_pids())
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            kills += 1
    return {"started": started, "finals": finals, "steps": steps, "kinds": kinds, "kills": kills}


def assert_exactly_once(run: dict[str, Any]) -> None:
    started, finals = run["started"], run["finals"]
    assert len(set(started)) == len(started), "an episode id was handed out twice"
    assert set(finals) == set(started), f"episodes never returned: {sorted(set(started) - set(finals))}"
    assert set(finals.values()) == {1}, f"episodes returned twice: {[e for e, n in finals.items() if n > 1]}"
    for eid, seen in run["steps"].items():
        assert seen == list(range(len(seen))), f"episode {eid} steps {seen}"
        assert len(seen) <= EPISODE_LEN + 1


# ---------------------------------------------------------------------------------------------------------
# A published LoRA adapter and its probe (test_agents_vllm, test_ray, test_evaluation_harness)
# ---------------------------------------------------------------------------------------------------------


def make_adapter(directory: Path, seed: int) -> Any:
    """A peft adapter on ``tiny`` whose ``B`` is non-zero (a fresh LoRA is a no-op: B = 0), saved in peft's
    format; returns the in-memory peft model, as the learner that published it would hold it."""
    model = wrap_lora(load_model(resolve_model("tiny")), LoRAConfig(rank=8, seed=seed))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    save_adapter(model, directory)
    return model.eval()


def adapter_logprobs(model: Any, ids: list[int]) -> list[float]:
    """What a publisher writes into its probe file: the adapted model's log-probs of ``ids[1:]``."""
    with torch.no_grad():
        x = torch.tensor([ids])
        return token_logprobs(model, x, torch.ones_like(x))[0].tolist()
