"""``benchmarks/gpu_check.py`` on a machine without a GPU (CI): it says so and exits 0, and its learner part --
the code a GPU run depends on -- runs on the CPU when forced, so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _run(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    proc = _run("--out", str(tmp_path / "gpu.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no GPU present" in proc.stdout
    assert not (tmp_path / "gpu.json").exists()  # nothing measured, nothing written


def test_cpu_dry_run_of_the_learner_part(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check_cpu.json"
    proc = _run("--device", "cpu", "--skip-vllm", "--episodes", "2", "--updates", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["vllm"] == "skipped: --skip-vllm"
    assert set(report["checks"]) == {"losses_finite", "ratio_one_before_first_step", "adapter_moved"}
    assert all(report["checks"].values())
    learner = report["learner"]
    assert learner["finetune"] == "lora" and len(learner["updates"]) == 2
    assert learner["lora_layer_output_dtypes"] == ["torch.float32"]  # no autocast on the CPU
    assert learner["probe_shift_from_base_mean"] > 0
    assert report["batch"]["episodes"] == 2 and report["batch"]["action_tokens"] > 0
