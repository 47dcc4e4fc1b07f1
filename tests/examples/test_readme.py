"""The README's three examples (make an env, train, evaluate) run as written: its ``python`` blocks, in order, as
one script in an empty folder (the evaluation reads the run the training wrote), the way a newcomer pastes them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_python_blocks() -> list[str]:
    """The README's fenced ``python`` code blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_the_readme_examples_run_as_written(tmp_path: Path) -> None:
    blocks = readme_python_blocks()
    assert len(blocks) == 3, (
        f"the README should hold 3 python examples (env, train, evaluate), found {len(blocks)}"
    )
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join(blocks))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Right. 1.0 True" in done.stdout  # the env example prints what its comment says
    run = tmp_path / "runs" / "smoke"
    config = json.loads((run / "config.json").read_text())
    assert (config["algo"], config["init"], config["updates"]) == ("spo++", "base", 2)
    updates = {json.loads(line).get("update") for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert 2 in updates
    assert (
        "paired differences A − B" in done.stdout
    )  # the evaluation compared the trained policy with its start
