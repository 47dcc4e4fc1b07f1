"""examples/custom_env.py runs as it stands and trains: a user's text env on ``TextEnv``, registered with plain
``gym.register`` and an ``EnvSpec`` of just a gym id and a prompt format, passes gymnasium's ``check_env``, is
played by an ``LLMAgent`` on the tiny model, and trains two SPO++ updates from Python (the example's own
``train(TrainConfig(...))``) and through ``streamrl train --env examples/custom_env.py:guess_number``."""

from __future__ import annotations

import json
import re
import string
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium import spaces
from streamrl.algorithms.run_dir import RunDir
from streamrl.envs.base import TextEnv
from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_env.py"
CLI_FLAGS = ["--init", "base", "--updates", "2", "--batch", "4", "--num-envs", "2", "--offline-rollouts", "1"]
CLI_FLAGS += ["--eval-episodes", "4", "--no-progress"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=cwd)


def _assert_trained(out: Path, updates: int) -> dict[str, Any]:
    """The run in ``out`` trained ``updates`` updates: one metrics row each, in order, every one of them
    trained on a full batch of the env's tasks; a checkpoint at the last; the published policies on disk."""
    run = RunDir(out)
    rows = [r for r in run.read_metrics() if "ledger/dispatched" in r]
    assert [r["update"] for r in rows] == list(range(1, updates + 1))
    for row in rows:
        assert row["ledger/trained"] >= 4 * row["update"]  # batch 4, nothing lost
    state = json.loads((run.checkpoint / "state.json").read_text())
    assert state["updates"] == updates
    assert run.policy_versions()[-1] >= 1
    config = run.read_config()
    assert config["init"] == "base" and config["updates"] == updates
    return config


def test_the_example_plays_then_trains_from_python(tmp_path: Path) -> None:
    out = _run(
        [sys.executable, str(EXAMPLE), "--episodes", "2", "--updates", "2", "--out", str(tmp_path / "py")],
        REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "check_env: ok; 16 tasks"
    assert lines[1].startswith("I am thinking of a whole number from 1 to 16.")
    assert any(line in lines for line in (f"LLMAgent(tiny): won {k} of 2" for k in range(3)))
    summary = json.loads(lines[-1])  # train()'s summary
    assert summary["updates"] == 2
    assert _assert_trained(tmp_path / "py", 2)["env"] == "guess_number"


def test_streamrl_train_imports_the_env_from_its_file_and_resumes(tmp_path: Path) -> None:
    env = "examples/custom_env.py:guess_number"  # relative to the working directory, as a user types it
    cli = [sys.executable, "-m", "streamrl.cli", "train"]
    out = _run([*cli, "--env", env, *CLI_FLAGS, "--out", str(tmp_path / "cli")], REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _assert_trained(tmp_path / "cli", 2)["env"] == env
    # the offline values are cached in one file, whatever the env name holds ('/', ':')
    (cache,) = re.findall(r"offline values: .*?(\S+\.json)", out.stdout + out.stderr)
    assert Path(cache).parent.name == "offline_values"
    # --resume reads the env from the run's config.json: a fresh process imports the file again
    out = _run([*cli, "--resume", str(tmp_path / "cli"), "--updates", "3", "--no-progress"], REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_trained(tmp_path / "cli", 3)


def test_streamrl_train_init_sft_on_an_env_without_an_expert_says_to_use_init_base(tmp_path: Path) -> None:
    out = _run(
        [
            sys.executable,
            "-m",
            "streamrl.cli",
            "train",
            "--env",
            f"{EXAMPLE}:guess_number",
            "--init",
            "sft",
            "--out",
            str(tmp_path / "sft"),
        ],
        REPO,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "no expert to clone" in out.stderr and "--init base" in out.stderr
    assert not (tmp_path / "sft" / "metrics.jsonl").exists()


def test_subprocess_workers_build_an_env_registered_only_in_this_process() -> None:
    # A class made here and an id registered here: a spawned worker imports neither, so it builds the env from
    # the registration the vector env sends it (cloudpickled by value).
    class Parrot(TextEnv):
        def __init__(self, word: str = "hi") -> None:
            super().__init__([f"say/{word}"])
            self.observation_space = self.action_space = spaces.Text(32, charset=string.printable)
            self.word = word

        def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
            return f"Say {self.word}.", {"task_id": task_id, "won": False, "action_valid": True}

        def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
            won = action == self.word
            return "", float(won), True, False, {"task_id": self._task_id, "won": won, "action_valid": True}

    gym.register(id="test_custom_env/Parrot-v0", entry_point=Parrot)
    try:
        venv = StreamingVectorEnv.from_env(
            "test_custom_env/Parrot-v0", 2, config=VectorEnvConfig(strict=True), word="hello"
        )
        try:
            venv.reset_async([0, 1])
            results = []
            while len(results) < 2:
                results += venv.recv(timeout=120)
            assert sorted(r.obs for r in results) == ["Say hello.", "Say hello."]
            venv.send([0, 1], ["hello", "bye"])
            done = []
            while len(done) < 2:
                done += venv.recv(timeout=120)
            assert sorted((r.env_id, r.reward) for r in done) == [(0, 1.0), (1, 0.0)]
        finally:
            venv.close()
    finally:
        gym.registry.pop("test_custom_env/Parrot-v0")


def test_an_env_module_that_cannot_be_imported_is_named(tmp_path: Path) -> None:
    out = _run(
        [
            sys.executable,
            "-m",
            "streamrl.cli",
            "train",
            "--env",
            "no_such_module_x:guess",
            "--init",
            "base",
            "--out",
            str(tmp_path / "x"),
        ],
        REPO,
    )
    assert out.returncode == 2
    assert "cannot import 'no_such_module_x'" in out.stderr
