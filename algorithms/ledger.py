"""The ledger: every dispatched trajectory and every generated action token of a run is accounted for.

``Ledger`` closes in trajectories -- dispatched = trained + dropped_stale + dropped_group + failed + buffered +
in flight -- and in action tokens; each metrics row carries it (``ledger/*``), and the tests check that it
closes at every update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from streamrl.algorithms.base import Episode


@dataclass
class Ledger:
    """Closes in trajectories and in action tokens: dispatched = trained + dropped_stale + dropped_group + failed +
    buffered + in flight, and generated_tokens = trained + dropped + failed + buffered + in-flight tokens."""

    dispatched: int = 0
    finished: int = 0
    trained: int = 0
    dropped_stale: int = 0
    """Finished after their version was superseded (``current-version`` rule): filed in the tracker, not trained."""
    dropped_group: int = 0
    """Whole groups without reward variance (DAPO) or with too few members left."""
    failed: int = 0
    """Ended by an env worker failure (``info["error"]``): neither filed nor trained."""
    generated_tokens: int = 0
    """Counted as the backend generates them (``Rollouts.generated_tokens``), independently of the rest; the
    tokens of episodes in flight at a checkpoint are not carried over (a resumed run plays them again)."""
    trained_tokens: int = 0
    dropped_tokens: int = 0
    failed_tokens: int = 0

    def drop(self, episodes: Sequence[Episode], why: Literal["stale", "group"]) -> None:
        """``episodes`` leave without being trained."""
        if why == "stale":
            self.dropped_stale += len(episodes)
        else:
            self.dropped_group += len(episodes)
        self.dropped_tokens += sum(e.num_action_tokens for e in episodes)

    def row(
        self, buffered: int, buffered_tokens: int, in_flight: int, in_flight_tokens: int
    ) -> dict[str, int]:
        return {
            **{f"ledger/{k}": v for k, v in asdict(self).items()},
            "ledger/buffered": buffered,
            "ledger/in_flight": in_flight,
            "ledger/buffered_tokens": buffered_tokens,
            "ledger/in_flight_tokens": in_flight_tokens,
        }
