"""The example scripts run as written (subprocesses, as a user runs them), at their smoke size: the untrained
``tiny`` (no SFT build), a few updates of a few episodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamrl.utils.stats import t_interval

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("algo", ["grpo", "sao"])
def test_swap_algorithms_runs_each_algorithm_with_one_argument(algo: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    printed = run_example("swap_algorithms.py", "--algo", algo, "--tiny", "--out", str(out), cwd=tmp_path)
    assert f"{algo} on math_tir: held-out success" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["algo"] == algo and config["updates"] == (3 if algo == "sao" else 2)
    assert (out / "evals" / f"update-{config['updates']:05d}.jsonl").is_file()


def test_reproduce_table1_pairs_spo_pp_with_its_baselines_beside_a_control(tmp_path: Path) -> None:
    args = ("reproduce_table1.py", "--scale", "tiny", "--envs", "math_tir", "--seeds", "0", "1")
    args += ("--algos", "spo++", "grpo")
    # Ctrl-C stops the whole script (the interrupted run checkpoints; no later run starts), and the same command
    # resumes it: it used to move on to the next run and build the table from half a run.
    first = tmp_path / "runs/table1/math_tir/spo++-lr0-seed0/metrics.jsonl"  # the control runs first
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / args[0]), *args[1:]],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not first.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the first run's update-0 evaluation is written: its signal handlers are in place
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "interrupted in" in stdout and "run the same command to resume" in stdout
    assert not (tmp_path / "runs/table1/table1.json").exists()
    assert not (tmp_path / "runs/table1/math_tir/spo++-seed0").exists()
    # Runs split into processes by seed, one seed each (--train-only), as the docstring says; the command without
    # --train-only then resumes the finished runs and builds the table. A single seed used to be refused.
    run_example(*args[:6], *args[7:], "--no-control", "--train-only", cwd=tmp_path)
    assert (tmp_path / "runs/table1/math_tir/grpo-seed1/evals/update-00002.jsonl").is_file()
    printed = run_example(*args, cwd=tmp_path)
    result = json.loads((tmp_path / "runs/table1/table1.json").read_text())
    row = result["table"]["math_tir"]
    assert row["area_metric"] == "auc_mean"
    diff = row["differences"]["spo++ - grpo"]
    assert diff["area"]["n"] == 2 and len(diff["last_evaluation_by_seed"]) == 2
    # the paired difference is the mean of the per-seed differences of the two algorithms' areas
    areas = {a: row["algorithms"][a]["area"]["values"] for a in ("spo++", "grpo")}
    diffs = [a - b for a, b in zip(areas["spo++"], areas["grpo"], strict=True)]
    assert diff["area"]["mean"] == pytest.approx(sum(diffs) / 2)
    interval = t_interval(diffs)  # over seeds: the seed is the unit of a comparison of algorithms
    assert (diff["area"]["ci_low"], diff["area"]["ci_high"]) == pytest.approx((interval.low, interval.high))
    # the control (lr 0) replays its start's held-out episodes exactly
    control = row["control"]["held_out_gain"]
    assert control["mean"] == control["ci_low"] == control["ci_high"] == 0.0 and control["tasks"] >= 2
    assert "| math_tir | spo++ - grpo |" in printed and "spo++-lr0 (seed 0)" in printed
    assert (tmp_path / "runs/table1/math_tir/report-grpo/report.md").is_file()
    config = {
        a: json.loads((tmp_path / f"runs/table1/math_tir/{a}-seed0/config.json").read_text())
        for a in ("spo++", "spo++-lr0")
    }
    assert {k for k in config["spo++"] if config["spo++"][k] != config["spo++-lr0"][k]} == {"learner", "out"}
    assert config["spo++-lr0"]["learner"]["lr"] == 0.0


def test_reproduce_table1_paper_scale_dry_run_builds_table_3(tmp_path: Path) -> None:
    printed = run_example(
        "reproduce_table1.py",
        "--scale",
        "paper",
        "--model",
        "/models/Qwen3.5-0.8B",
        "--seeds",
        "0",
        "1",
        "2",
        "--dry-run",
        cwd=tmp_path,
    )
    configs = json.loads(printed)
    assert len(configs) == 2 * (3 * 3 + 1)  # envs x (seeds x algorithms + the lr-0 control)
    by_env = {c["env"]: c for c in configs if c["algo"] == "spo++"}
    assert by_env["alfworld"]["batch"] == by_env["math_tir"]["batch"] == 128
    assert by_env["alfworld"]["updates"] * 128 == 6400 and by_env["math_tir"]["updates"] * 128 == 25600
    assert by_env["alfworld"]["init"] == "base" and by_env["math_tir"]["init"] == "sft"
    assert {c["learner"]["lr"] for c in configs} == {1e-6, 0.0}
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_reproduce_table1_cpu_scale_runs_alfworld_s_preset(tmp_path: Path) -> None:
    """ALFWorld's CPU table trains exactly the preset (``streamrl train --env alfworld``), every arm the same but
    for its algorithm, its curve on ``eval_seen`` rather than the validation games the preset was chosen on."""
    from streamrl.algorithms.train_config import TrainConfig

    printed = run_example(
        "reproduce_table1.py",
        "--scale",
        "cpu",
        "--envs",
        "alfworld",
        "--seeds",
        "0",
        "1",
        "2",
        "--dry-run",
        cwd=tmp_path,
    )
    configs = {c["out"].split("/")[-1]: c for c in json.loads(printed)}
    assert len(configs) == 3 * 3 + 1
    preset = TrainConfig.for_env("alfworld").to_dict()
    spo_pp = configs["spo++-seed1"]
    changed = {k for k in preset if preset[k] != spo_pp[k]}
    assert changed == {"out", "seed", "eval_split", "eval_episodes", "eval_every"}
    assert (spo_pp["eval_split"], spo_pp["eval_episodes"], spo_pp["updates"]) == ("eval_seen", 140, 60)
    for name in ("spo-seed1", "grpo-seed1"):
        assert {k for k in spo_pp if spo_pp[k] != configs[name][k]} == {"algo", "out"}
    assert configs["spo++-lr0-seed0"]["learner"]["lr"] == 0.0


def test_reproduce_table2_ablates_the_normalization_only(tmp_path: Path) -> None:
    # one run trained on its own first (how the runs split into processes); the table resumes it
    args = ("reproduce_table2.py", "--scale", "tiny", "--env", "math_tir")
    run_example(*args, "--seeds", "1", "--norms", "trajectory", "--train-only", cwd=tmp_path)
    assert not (tmp_path / "runs/table2/table2.json").exists()
    assert not (tmp_path / "runs/table2/token").exists()
    printed = run_example(*args, "--seeds", "0", "1", cwd=tmp_path)
    result = json.loads((tmp_path / "runs/table2/table2.json").read_text())
    assert result["delta_c10"]["n"] == 2 and "paired difference" in printed
    assert result["area_metric"] == "auc_mean"  # Table 1's area on Math-TIR
    for name in ("c10", "area"):  # paired per seed, with the t interval over the 2 seeds
        d = result[f"delta_{name}"]
        pairs = zip(result[f"{name}_token"]["values"], result[f"{name}_trajectory"]["values"], strict=True)
        assert d["values"] == pytest.approx([x - y for x, y in pairs])
        half = 12.7062 * d["sd"] / 2**0.5  # t_{0.975, 1}
        assert (d["ci_low"], d["ci_high"]) == pytest.approx((d["mean"] - half, d["mean"] + half), rel=1e-4)
    token, trajectory = (
        json.loads((tmp_path / f"runs/table2/{n}/math_tir/spo++-seed0/config.json").read_text())
        for n in ("token", "trajectory")
    )
    assert token["algorithm"] == {"normalization": "token"} and trajectory["algorithm"] == {
        "normalization": "trajectory"
    }
    assert {k for k in token if token[k] != trajectory[k]} == {"algorithm", "out"}
    assert (token["updates"], token["schedule_updates"]) == (10, 10)  # tiny's run is shorter than C10
