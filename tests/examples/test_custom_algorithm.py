"""``examples/custom_algorithm.py``: a user's own algorithm (REINFORCE with the tracker's baseline) on the shared
interface -- its math in process, and the script trained from Python and from ``streamrl train`` as a user
runs them (subprocesses, tiny model, ``init="base"``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from streamrl.agents.models import resolve_model
from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms import base
from streamrl.algorithms.base import Episode, PolicyInputs, algorithm_class, make_algorithm
from streamrl.algorithms.losses import LossAggregation
from streamrl.algorithms.tracker import EventTracker

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_algorithm.py"
TINY_FLAGS = (
    "--init base --updates 2 --batch 4 --num-envs 4 --tasks 8 --offline-rollouts 1 --eval-episodes 4 "
    "--max-new-tokens 16 --env-workers inprocess --no-progress"
).split()


@pytest.fixture
def registry() -> Iterator[None]:
    """Loading the example registers ``reinforce``; keep the process-wide registry as other tests see it. The
    built-in algorithms are registered first: their modules register once, at import, so a registry saved
    before they load would lose them for every later test of the process."""
    base._load_builtin()
    saved = dict(base.ALGORITHMS)
    yield
    base.ALGORITHMS.clear()
    base.ALGORITHMS.update(saved)


def test_loads_by_file_and_by_registry_name(registry: None) -> None:
    cls = algorithm_class(f"{EXAMPLE}:Reinforce")
    assert cls.name == "reinforce" and algorithm_class("reinforce") is cls
    algo = make_algorithm("reinforce", env="math_tir", rho=0.5)
    assert algo.tracker_config(seed=0).rho == 0.5 and algo.tracker_config(seed=0).mode == "event-time"
    with pytest.raises(ValueError, match="has no option"):
        make_algorithm("reinforce", eps_high=0.3)  # a PPO knob it does not have


def test_advantage_is_reward_minus_baseline_frozen_at_dispatch(registry: None) -> None:
    algo = make_algorithm(f"{EXAMPLE}:Reinforce")
    tracker = EventTracker(["a", "b"], algo.tracker_config(seed=0))
    tracker.init_offline({"a": [1.0, 1.0, 1.0, 0.0], "b": [0.0, 0.0, 0.0, 0.0]})
    tickets = [tracker.dispatch("a"), tracker.dispatch("b")]
    tracker.record(tickets[0], 0.0)  # a later outcome must not move the frozen baseline
    episodes = [
        Episode(Trajectory(task_id=t.task_id, ticket=t).set_outcome(r, bool(r), True, False), t)
        for t, r in zip(tickets, (0.0, 1.0), strict=True)
    ]
    assert all(t.baseline is not None for t in tickets)
    expected = [r - (t.baseline or 0.0) for t, r in zip(tickets, (0.0, 1.0), strict=True)]
    assert algo.advantages(episodes) == pytest.approx(expected)
    assert expected[0] < -0.5 and expected[1] > 0.5  # the baselines are the tasks' values, not 0


def test_loss_is_token_mean_of_minus_a_logp_over_the_whole_batch(registry: None) -> None:
    """Two micro-batches with the batch's global token count sum to the full-batch loss; the gradient of
    each token's log-prob is -A / N_tok (REINFORCE, no clipping)."""
    algo = make_algorithm(f"{EXAMPLE}:Reinforce")
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    adv = torch.randn(4, 1, generator=gen).expand(4, 6) * mask
    logp = (-torch.rand(4, 6, generator=gen) * 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(4, 6, generator=gen)
    agg = LossAggregation.of_batch(mask)

    def loss(rows: slice) -> Any:
        return algo.policy_loss(
            PolicyInputs(logp[rows], old[rows], old[rows], adv[rows], mask[rows], agg)  # type: ignore[arg-type]
        )

    parts = [loss(slice(0, 1)), loss(slice(1, 4))]
    total = parts[0].loss + parts[1].loss
    assert float(total.detach()) == pytest.approx(
        float(-(adv * logp.detach() * mask).sum() / mask.sum()), rel=1e-6
    )
    total.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -adv * mask / mask.sum())
    whole = loss(slice(0, 4))
    assert float(whole.clip_frac) == 0.0 and float(whole.masked_frac) == 0.0
    assert float(whole.ppo_kl) == pytest.approx(
        float(((old - logp.detach()) * mask).sum() / mask.sum()), rel=1e-5
    )


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _check_run(run: Path, algo: str, rho: float) -> None:
    """Two updates of REINFORCE trained and published; the user's config reached the tracker."""
    config = json.loads((run / "config.json").read_text())
    assert config["algo"] == algo and config["algorithm"] == {"rho": rho}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if r.get("learner/loss") is not None]
    assert [r["update"] for r in updates] == [1, 2] and [r["version"] for r in updates] == [1, 2]
    for row in updates:
        assert math.isfinite(row["learner/loss"]) and row["learner/grad_norm"] > 0
        assert row["learner/clip_frac"] == 0.0
        assert row["staleness"] == {"0": 4}  # batch_rule current-version: on-policy only
    assert "eval/success" in rows[0] and "eval/success" in rows[-1]
    tracker = json.loads((run / "checkpoint" / "state.json").read_text())["tracker"]
    assert tracker["config"]["rho"] == rho and tracker["version"] == 2
    from safetensors.torch import load_file

    start = load_file(str(resolve_model("tiny") / "model.safetensors"))
    trained = load_file(str(run / "policy" / "v2" / "model.safetensors"))
    assert any(not torch.equal(start[k], v) for k, v in trained.items() if k in start)


def test_example_trains_from_python(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _run([sys.executable, str(EXAMPLE), "--out", str(run), "--rho", "0.5"], cwd=tmp_path)
    assert "'updates': 2" in proc.stdout
    _check_run(run, "reinforce", 0.5)


def test_example_trains_from_the_cli_with_its_own_flags(tmp_path: Path) -> None:
    run = tmp_path / "run"
    spec = "examples/custom_algorithm.py:Reinforce"  # as a user types it, from the repository root
    cli = [sys.executable, "-m", "streamrl.cli", "train", "--algo", spec, "--rho", "0.5"]
    help_text = _run([*cli[:-2], "--help"], cwd=ROOT).stdout
    assert "--rho RHO" in help_text and "ReinforceConfig" in help_text
    _run([*cli, *TINY_FLAGS, "--out", str(run)], cwd=ROOT)
    _check_run(run, spec, 0.5)
