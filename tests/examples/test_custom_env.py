"""examples/custom_env.py runs as it stands: a user's text env on ``TextEnv``, registered with plain
``gym.register``, passes gymnasium's ``check_env`` and is played by an ``LLMAgent`` on the tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_custom_env_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "custom_env.py"), "--episodes", "2"],
        capture_output=True,
        text=True,
        timeout=600,  # ~15 s once the tiny model is in the cache
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "check_env: ok; 16 tasks" in lines
    assert lines[-1] in (
        "LLMAgent(tiny): won 0 of 2",
        "LLMAgent(tiny): won 1 of 2",
        "LLMAgent(tiny): won 2 of 2",
    )
    assert lines[1].startswith("I am thinking of a whole number from 1 to 16.")
