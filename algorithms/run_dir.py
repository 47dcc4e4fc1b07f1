"""The run directory of ``streamrl train``: one object that knows where everything of a run lies.

Every reader and writer of a run goes through ``RunDir`` -- the trainer, its checkpoints and publisher, the
evaluation harness, ``streamrl curves`` / ``compare`` and the demo -- so the layout is spelled once::

    config.json           the run's TrainConfig (resume compares it)
    metrics.jsonl         one row per update (and update 0: the start's held-out evaluation)
    evals/update-N.jsonl  the per-episode records of the held-out evaluation after update N
    policy/v<k>           published policy versions (adapter or weights, and the probe file); the last few kept
    checkpoint/           the last complete checkpoint (``checkpoint.old/`` while a new one takes its place,
                          ``checkpoint.tmp/`` while it is written)
    tensorboard/          TensorBoard event files
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streamrl.utils.cache import atomic_write_text

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


class RunDir:
    """The files of one training run under ``path`` (module doc). Creating a ``RunDir`` touches nothing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    # -- the layout -------------------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def evals(self) -> Path:
        return self.path / "evals"

    @property
    def policies(self) -> Path:
        """The folder of the published versions ``policy/v<k>``."""
        return self.path / "policy"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint"

    @property
    def checkpoint_old(self) -> Path:
        """The previous checkpoint while a new one takes its place."""
        return self.path / "checkpoint.old"

    @property
    def checkpoint_tmp(self) -> Path:
        """A checkpoint being written."""
        return self.path / "checkpoint.tmp"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    def policy(self, version: int) -> Path:
        """Where published version ``version`` lies (``policy/v<version>``)."""
        return self.policies / f"v{version}"

    def policy_versions(self) -> list[int]:
        """The published versions on disk (``policy/v<k>`` folders, k >= 1), ascending."""
        if not self.policies.is_dir():
            return []
        found = [int(p.name[1:]) for p in self.policies.glob("v*") if p.is_dir() and p.name[1:].isdigit()]
        return sorted(v for v in found if v > 0)

    def eval_file(self, update: int) -> Path:
        """The per-episode records of the held-out evaluation after update ``update``."""
        return self.evals / f"update-{update:05d}.jsonl"

    # -- config.json ------------------------------------------------------------------------------------------
    def is_run(self) -> bool:
        """Whether a run was started here (it holds a ``config.json``)."""
        return self.config_file.is_file()

    def read_config(self) -> dict[str, Any]:
        """The saved ``config.json``; ``FileNotFoundError`` naming the path if this is not a run directory."""
        if not self.is_run():
            what = "no such directory" if not self.path.is_dir() else f"no {CONFIG_FILE} in it"
            raise FileNotFoundError(f"run {str(self.path)!r}: {what} (not a `streamrl train` run directory)")
        return dict(json.loads(self.config_file.read_text()))

    def write_config(self, config: Mapping[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(json.dumps(dict(config), indent=2, sort_keys=True))

    # -- metrics.jsonl ----------------------------------------------------------------------------------------
    def append_metrics(self, row: Mapping[str, Any]) -> None:
        """Append one row; a non-finite float (e.g. an undefined explained variance) is written as null, so
        the file stays strict JSON."""
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(clean, sort_keys=True, allow_nan=False) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl``, one per update in update order (when an update appears twice, as
        after a resume that replayed it, the last row wins). ``FileNotFoundError`` naming the path."""
        path = self.metrics_file
        if not path.is_file():
            what = "no such directory" if not self.path.is_dir() else f"no {METRICS_FILE} in it"
            raise FileNotFoundError(
                f"run {str(self.path)!r}: {what} (a run directory of `streamrl train` holds one)"
            )
        rows: dict[int, dict[str, Any]] = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON row ({error})") from None
            rows[int(row.get("update", 0))] = row
        return [rows[u] for u in sorted(rows)]

    def truncate_metrics(self, updates: int) -> None:
        """Drop the rows of updates after ``updates`` (and a row cut by a kill): a resume runs them again."""
        path = self.metrics_file
        if not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(row.get("update", 0)) <= updates:
                kept.append(line + "\n")
        atomic_write_text(path, "".join(kept))

    # -- evals/ -----------------------------------------------------------------------------------------------
    def write_eval(self, update: int, records: list[dict[str, Any]]) -> Path:
        """Store the per-episode records of the held-out evaluation after update ``update``."""
        self.evals.mkdir(parents=True, exist_ok=True)
        path = self.eval_file(update)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        return path

    def read_eval(self, update: int) -> list[dict[str, Any]] | None:
        """The records of the evaluation after update ``update``, or ``None`` if there is none."""
        path = self.eval_file(update)
        if not path.is_file():
            return None
        return [json.loads(line) for line in path.read_text().splitlines()]

    def evaluations(self) -> dict[int, list[dict[str, Any]]]:
        """Every held-out evaluation's per-episode records, by update; ``FileNotFoundError`` if none."""
        files = sorted(self.evals.glob("update-*.jsonl")) if self.evals.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{self.path} has no held-out evaluations (evals/update-*.jsonl)")
        return {
            int(f.stem.removeprefix("update-")): [json.loads(line) for line in f.read_text().splitlines()]
            for f in files
        }
