"""``streamrl train --backend vllm``: SPO++ and GRPO with a real (CPU) vLLM engine serving LoRA adapters.

The policy starts from the ``primed`` tiny (conftest.py): on each of the eight Math-TIR training tasks it trains
on, it answers at once, and right, about half the time, so rewards vary within every GRPO group and updates
are non-zero. Each publication saves the adapter with its probe, hot-loads it into the engine (which checks the
probe) and compares the served log-probs with the learner's. Generation overlaps the learner's updates (the
engine runs in its own processes).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (install the `vllm` extra: pip install 'streamrl[vllm]')",
    ),
]

from safetensors.torch import load_file  # noqa: E402
from streamrl.algorithms.learner import LearnerConfig  # noqa: E402
from streamrl.algorithms.train import TrainConfig, train  # noqa: E402


@pytest.mark.parametrize("algo", ["spo++", "grpo"])
def test_train_with_vllm_backend(algo: str, primed: Path, tmp_path: Path) -> None:
    config = TrainConfig(
        out=str(tmp_path / "run"),
        env="math_tir",
        algo=algo,
        model=str(primed),
        init="base",
        backend="vllm",
        updates=2,
        batch=8,
        num_envs=8,
        tasks=8,
        offline_rollouts=1,
        eval_every=0,
        max_new_tokens=16,
        learner=LearnerConfig(finetune="lora", lr=1e-2),
        max_staleness=0 if algo == "grpo" else 1,  # GRPO as it usually runs: synchronous groups
        algorithm={"publish_every": 1, **({"group_size": 4} if algo == "grpo" else {})},
    )
    summary = train(config, progress=False)
    assert summary["updates"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    assert any(r["learner/grad_norm"] > 0 for r in rows), "rewards never varied: no update to see"
    for r in rows:  # fresh rollouts of the served adapter agree with the learner's recomputation
        assert r["staleness"] == {"0": 8}, "SPO++ trains only current-version work; GRPO here is synchronous"
        assert r["learner/rollout_kl"] < 1e-3
    adapter = load_file(str(tmp_path / "run" / "policy" / "v2" / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for name, t in adapter.items() if "lora_B" in name)  # B starts at 0
