"""Batch rules: which finished episodes form an update batch, owned by the algorithm.

An algorithm names its rule with ``AlgorithmConfig.batch_rule`` (the field users, configs and saved runs set);
``Algorithm.batch_rule`` turns it into one of the strategies below, and the trainer asks the strategy every
question the rule decides -- it never compares the name:

- how many jobs one dispatch of a task wants (``group_size``), and whether a task may have two requests in
  flight at once (``one_per_task``);
- whether an episode that returns may still be trained (``admits``) and what leaves the buffer when a new
  version is published (``drain``);
- before a publication: which buffered episodes must be trained first (``due``) and whether in-flight work
  must be waited for (``must_wait``), so that no trained token is more than ``max_staleness`` versions old;
- the batch itself (``take``);
- with ``dispatch="trainable"``: how many more episodes the current version can still train
  (``trainable_room``), so that none is started only to be dropped.

The three rules (``docs/reference.md``): ``current-version`` (SPO++ §2.4: the first completed requests of the
current version; older work is filed in the tracker, never trained), ``any`` (first completed within the
staleness bound: SPO, SAO), ``groups`` (complete groups of ``group_size`` rollouts of one task: GRPO).

``EpisodeBuffer`` holds the finished episodes waiting for a batch, and the open groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ClassVar

from streamrl.agents.trajectory import Trajectory
from streamrl.algorithms.tracker import Ticket

if TYPE_CHECKING:
    from streamrl.algorithms.base import Episode
    from streamrl.algorithms.runtime import Job


class BatchStrategy:
    """A batch rule (module doc). Its answers here are those of the single-stream rule ``any``, which
    ``AnyVersion`` names; the other rules override what they decide differently."""

    name: ClassVar[str] = "any"

    def __init__(self, group_size: int = 1) -> None:
        self.group_size = group_size
        """Jobs dispatched together for one task (GRPO's G); 1 for single-stream rules."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group_size={self.group_size})"

    @property
    def one_per_task(self) -> bool:
        """At most one request per task in flight (single-stream): a batch needs ``batch`` distinct tasks."""
        return self.group_size == 1

    def check(self, *, batch: int, num_envs: int, algorithm: str) -> None:
        """``ValueError`` when a run with ``batch`` trajectories per update and ``num_envs`` slots cannot use
        this rule."""
        if self.group_size != 1:
            raise ValueError(f"group_size={self.group_size} needs batch_rule='groups'")

    def admits(self, episode: Episode, version: int) -> bool:
        """Whether an episode that returned at policy ``version`` may still be trained."""
        return True

    def drain(self, buffer: Sequence[Episode], version: int) -> list[Episode]:
        """The buffered episodes that may no longer be trained once ``version`` is published."""
        return []

    def must_wait(self, publishing: bool, in_flight: Iterable[Job], limit: int) -> bool:
        """Before a publication, in-flight work of version ``<= limit`` (it would exceed max_staleness once
        the version advances) must finish first."""
        return publishing and any(job.ticket.version <= limit for job in in_flight)

    def trainable_room(
        self, left: int, buffer: Sequence[Episode], in_flight: Iterable[Job], version: int
    ) -> int | None:
        """How many more episodes dispatched now at ``version`` can still be trained, when ``left`` more are
        trained before the next publication and ``buffer`` and ``in_flight`` hold the finished and running
        ones; ``None``: no bound beyond admission (the rule trains work of older versions within the staleness
        bound, so nothing it starts is thrown away for its version)."""
        return None

    def due(self, buffer: Sequence[Episode], limit: int) -> list[Episode]:
        """Before a publication: the buffered episodes that must be trained now (oldest first)."""
        due = [e for e in buffer if e.min_version <= limit]
        due.sort(key=lambda e: e.ticket.dispatch_index)
        return due

    def take(
        self, buffer: Sequence[Episode], size: int, *, publishing: bool, limit: int
    ) -> list[Episode] | None:
        """The next batch from ``buffer`` (at least ``size`` episodes; more when more are due before a
        publication), or ``None`` when there are not enough."""
        due = self.due(buffer, limit) if publishing else []
        rest = [e for e in buffer if e not in due]
        need = max(size, len(due))
        if len(due) + len(rest) < need:
            return None
        return due + rest[: need - len(due)]


class AnyVersion(BatchStrategy):
    """``any`` (SPO, SAO): the first finished episodes of any version within the staleness bound."""

    name = "any"


class CurrentVersion(BatchStrategy):
    """``current-version`` (SPO++ §2.4): the first completed requests of the current version; work of a
    superseded version is filed in the tracker when it returns and never trained."""

    name = "current-version"

    def admits(self, episode: Episode, version: int) -> bool:
        return episode.ticket.version >= version

    def drain(self, buffer: Sequence[Episode], version: int) -> list[Episode]:
        return [e for e in buffer if e.ticket.version < version]

    def must_wait(self, publishing: bool, in_flight: Iterable[Job], limit: int) -> bool:
        return False  # in-flight work of an old version is dropped when it returns, never trained

    def due(self, buffer: Sequence[Episode], limit: int) -> list[Episode]:
        return []

    def trainable_room(
        self, left: int, buffer: Sequence[Episode], in_flight: Iterable[Job], version: int
    ) -> int | None:
        """The version's remaining batches minus the current-version episodes already buffered or running:
        an episode started beyond that is still in flight at the publication, and drained."""
        current = sum(e.ticket.version >= version for e in buffer)
        current += sum(job.ticket.version >= version for job in in_flight)
        return max(0, left - current)


class Groups(BatchStrategy):
    """``groups`` (GRPO): complete groups of ``group_size`` rollouts of one task, trained together."""

    name = "groups"

    @property
    def one_per_task(self) -> bool:
        return False

    def check(self, *, batch: int, num_envs: int, algorithm: str) -> None:
        g = self.group_size
        if batch % g:
            raise ValueError(f"batch={batch} must be a multiple of {algorithm}'s group_size={g}")
        if num_envs < g:
            raise ValueError(f"num_envs={num_envs} cannot hold one group of group_size={g}")

    def due(self, buffer: Sequence[Episode], limit: int) -> list[Episode]:
        due = super().due(buffer, limit)
        if not due:
            return due
        groups = {e.group for e in due}  # a due member takes its whole group along
        return [e for e in buffer if e.group in groups]


RULES: dict[str, type[BatchStrategy]] = {rule.name: rule for rule in (CurrentVersion, AnyVersion, Groups)}
"""The rules by the name ``AlgorithmConfig.batch_rule`` gives."""


def batch_rule(name: str, group_size: int = 1) -> BatchStrategy:
    """The strategy of the rule called ``name``."""
    if name not in RULES:
        raise ValueError(f"batch_rule must be one of {tuple(RULES)}, got {name!r}")
    return RULES[name](group_size)


class EpisodeBuffer:
    """Finished episodes waiting for a batch, and the open groups (``groups`` rule) still missing members.

    ``add`` / ``fail`` / ``drain`` return the episodes they drop, for the caller's ledger."""

    def __init__(self, rule: BatchStrategy, keep_group: Callable[[Sequence[float]], bool]) -> None:
        self.rule = rule
        self.keep_group = keep_group
        """Whether a complete group enters the batch (``Algorithm.keep_group``)."""
        self.episodes: list[Episode] = []
        self.groups: dict[int, list[Episode]] = {}
        self.group_sizes: dict[int, int] = {}
        self.next_group = 0

    def new_group(self) -> int:
        """Open a group of ``rule.group_size`` jobs; returns its id."""
        group = self.next_group
        self.next_group += 1
        self.group_sizes[group] = self.rule.group_size
        return group

    def add(self, episode: Episode) -> list[Episode]:
        """A finished episode waits for a batch (as a member of its group, if it has one)."""
        if episode.group is None:
            self.episodes.append(episode)
            return []
        self.groups.setdefault(episode.group, []).append(episode)
        return self._close(episode.group)

    def fail(self, episode: Episode) -> list[Episode]:
        """A failed episode will not come: its group waits for one member fewer."""
        if episode.group is None:
            return []
        self.group_sizes[episode.group] -= 1
        return self._close(episode.group)

    def _close(self, group: int) -> list[Episode]:
        members = self.groups.get(group, [])
        if len(members) < self.group_sizes[group]:
            return []
        self.groups.pop(group, None)
        if len(members) < 2 or not self.keep_group([m.reward for m in members]):
            return members
        self.episodes.extend(members)
        return []

    def drain(self, version: int) -> list[Episode]:
        """After ``version`` was published: the episodes the rule may no longer train leave the buffer."""
        stale = self.rule.drain(self.episodes, version)
        if stale:
            gone = {id(e) for e in stale}
            self.episodes = [e for e in self.episodes if id(e) not in gone]
        return stale

    def take(self, size: int, *, publishing: bool, limit: int) -> list[Episode] | None:
        """The next batch (``BatchStrategy.take``), removed from the buffer; ``None`` when it cannot fill yet."""
        batch = self.rule.take(self.episodes, size, publishing=publishing, limit=limit)
        if batch is None:
            return None
        taken = {id(e) for e in batch}
        self.episodes = [e for e in self.episodes if id(e) not in taken]
        return batch

    def waiting(self) -> list[Episode]:
        """Every finished episode not yet trained nor dropped (buffered, or in an open group)."""
        return self.episodes + [m for members in self.groups.values() for m in members]

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "buffer": [episode_json(e) for e in self.episodes],
            "groups": {str(g): [episode_json(e) for e in members] for g, members in self.groups.items()},
            "group_sizes": {str(g): n for g, n in self.group_sizes.items()},
            "next_group": self.next_group,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.episodes = [episode_from_json(item) for item in state["buffer"]]
        self.groups = {
            int(g): [episode_from_json(i) for i in members] for g, members in state["groups"].items()
        }
        self.group_sizes = {int(g): n for g, n in state["group_sizes"].items()}
        self.next_group = int(state["next_group"])


def episode_json(episode: Episode) -> dict[str, Any]:
    return {
        "trajectory": episode.trajectory.to_dict(),
        "ticket": asdict(episode.ticket),
        "group": episode.group,
    }


def episode_from_json(item: Mapping[str, Any]) -> Episode:
    from streamrl.algorithms.base import Episode

    ticket = Ticket(**item["ticket"])
    trajectory = Trajectory.from_dict(item["trajectory"])
    trajectory.ticket = ticket
    return Episode(trajectory, ticket, item["group"])
