"""What a training run reports as it goes: ``metrics.jsonl``, TensorBoard and the progress bar, in one place.

``TrainingLog.write(row)`` appends the row to the run's ``metrics.jsonl`` (strict JSON), its finite numbers to
TensorBoard at step ``row["update"]``, and moves the progress bar (with the batch's success and the latest
held-out success).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from streamrl.algorithms.run_dir import RunDir


class TrainingLog:
    """The run's metrics, TensorBoard events and progress bar (module doc); ``close()`` when done."""

    def __init__(self, run: RunDir, *, total: int, initial: int, desc: str, progress: bool) -> None:
        """``total`` updates, ``initial`` of them done (a resumed run); ``progress``: show a progress bar."""
        self.run = run
        self.held_out = "-"
        """The latest held-out success, as the bar shows it."""
        self.writer = self._tensorboard()
        self.bar: Any = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="update")

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboard is a core dependency
            return None
        return SummaryWriter(str(self.run.tensorboard))

    def write(self, row: Mapping[str, Any]) -> None:
        """Record one row (an update's, or update 0's evaluation of the start)."""
        self.run.append_metrics(row)
        step = int(row.get("update", 0))
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if "eval/success" in row:
            self.held_out = f"{row['eval/success']:.3f} (update {step})"
        if self.bar is not None and "batch/success" in row:
            self.bar.update(1)
            self.bar.set_postfix(batch_success=f"{row['batch/success']:.2f}", held_out=self.held_out)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
