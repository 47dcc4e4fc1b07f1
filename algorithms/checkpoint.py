"""Checkpoints of a training run: written so that a kill at any instant leaves a complete one to resume from.

A checkpoint is a folder holding ``learner.pt`` (``torch.save``: the learner's weights and optimizer, the
algorithm's state, torch's RNG) and ``state.json`` (the trainer's counters, tracker, ledger, buffered episodes
and the tickets in flight). ``Checkpoints.save`` writes it to ``checkpoint.tmp/``, flushes it to disk and renames
it to ``checkpoint/``. Two renames cannot be one, so the previous checkpoint waits in ``checkpoint.old/`` until
the new one is in place: whenever the process dies, ``checkpoint/`` or ``checkpoint.old/`` holds a complete
checkpoint, and ``last()`` finds it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from streamrl.algorithms.run_dir import RunDir


class Checkpoints:
    """The checkpoints of the run in ``run`` (module doc)."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def save(self, tensors: Mapping[str, Any], state: Mapping[str, Any]) -> Path:
        """Write a checkpoint of ``tensors`` (``learner.pt``) and ``state`` (``state.json``, JSON) and make it
        the last one; returns its folder."""
        final, tmp, old = self.run.checkpoint, self.run.checkpoint_tmp, self.run.checkpoint_old
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(dict(tensors), tmp / "learner.pt")
        (tmp / "state.json").write_text(json.dumps(dict(state)))
        fsync_folder(tmp)  # on disk before a rename publishes it, also across a power loss
        if final.exists():  # else a kill came between the renames and old/ is the last checkpoint: keep it
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_folder(self.run.path, files=False)
        shutil.rmtree(old, ignore_errors=True)
        return final

    def last(self) -> Path | None:
        """The run's last complete checkpoint: ``checkpoint/``, or ``checkpoint.old/`` when the run was killed
        between ``save``'s two renames; ``None`` when it was killed before its first checkpoint."""
        for path in (self.run.checkpoint, self.run.checkpoint_old):
            if (path / "state.json").is_file():
                return path
        return None

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        """The ``state.json`` of the checkpoint in ``path``."""
        return dict(json.loads((path / "state.json").read_text()))

    @staticmethod
    def read_tensors(path: Path) -> dict[str, Any]:
        """The ``learner.pt`` of the checkpoint in ``path``."""
        return dict(torch.load(path / "learner.pt", weights_only=False))


def fsync_folder(path: Path, *, files: bool = True) -> None:
    """Flush to disk the folder ``path`` (its entries: what was renamed into it) and, with ``files``, the files
    in it."""
    items = [p for p in path.iterdir() if p.is_file()] if files else []
    for item in [*items, path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
