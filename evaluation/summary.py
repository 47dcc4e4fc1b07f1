"""What an evaluation's episodes add up to: ``EpisodeRecord`` (one played episode, named so that two reports
pair up), its summaries (``summarize``, ``breakdown``) and the paired differences of two agents on the same
episodes (``paired_difference``, clustered by task: ``paired_difference_by_task``; ``paired_entry``, a report's
entry holding both). Plain functions of records: the harness (``streamrl.evaluation.harness``) plays the
episodes, ``streamrl.evaluation.report`` prints what these return. Formulas: ``docs/evaluation.md``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from streamrl.utils.stats import (
    ClusteredMeanInterval,
    MeanInterval,
    clustered_t_interval,
    clustered_wilson_interval,
    pass_at_k,
    t_interval,
    wilson_interval,
)

__all__ = [
    "EpisodeRecord",
    "Metric",
    "breakdown",
    "paired_difference",
    "paired_difference_by_task",
    "paired_differences",
    "paired_entry",
    "summarize",
]


@dataclass(frozen=True)
class EpisodeRecord:
    """One played episode: its name (split, task, seed, sample), mode and outcome, kept in the report so that
    agents can be compared episode by episode later (``paired_difference``). Not the episode's ``Trajectory``:
    a report keeps this small JSON summary of every episode (no tokens), named so that two reports pair up."""

    split: str
    task_id: str
    seed: int
    sample: int
    temperature: float
    """The mode it was played in (a scripted agent ignores the temperature but plays the mode's episodes)."""
    success: bool
    reward: float
    steps: int
    action_tokens: int
    tool_calls: int
    invalid_actions: int
    groups: dict[str, str] = field(default_factory=dict)
    """Breakdown attributes: ``split`` and whichever of ``task_type``, ``source``, ``family`` the env has."""
    error: str | None = None
    """Why an env worker failure ended the episode (it counts as a failure)."""

    @property
    def episode(self) -> tuple[str, str, int, int]:
        """The episode's name: (split, task id, seed, sample)."""
        return (self.split, self.task_id, self.seed, self.sample)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeRecord:
        return cls(**{**data, "groups": dict(data.get("groups") or {})})


def summarize(records: Sequence[EpisodeRecord], pass_k: Iterable[int] = (1,)) -> dict[str, Any]:
    """The metrics of ``records`` (one mode's): ``episodes``, ``successes``, ``success_rate`` with its 95 %
    interval clustered by task (``success_ci95_task``: ``clustered_wilson_interval`` over (split, task); ``None``
    with a single task) and the episode-level Wilson interval (``success_ci95``), ``mean_reward``, ``pass_at_k`` (unbiased, per task averaged over tasks;
    each k up to the fewest episodes a task has), ``tasks``, ``mean_steps``, ``mean_action_tokens``,
    ``mean_tool_calls``, ``invalid_action_rate`` (invalid actions per step) and ``errors``."""
    n = len(records)
    if n == 0:
        raise ValueError("no episodes to summarize")
    wins = sum(r.success for r in records)
    per_task: dict[tuple[str, str], list[bool]] = defaultdict(list)
    for r in records:
        per_task[_task(r)].append(r.success)
    fewest = min(len(v) for v in per_task.values())
    steps = sum(r.steps for r in records)
    return {
        "episodes": n,
        "successes": wins,
        "success_rate": wins / n,
        "success_ci95": list(wilson_interval(wins, n)),
        "success_ci95_task": (
            list(clustered_wilson_interval([r.success for r in records], [_task(r) for r in records]))
            if len(per_task) > 1
            else None
        ),
        "mean_reward": sum(r.reward for r in records) / n,
        "tasks": len(per_task),
        "pass_at_k": {
            str(k): sum(pass_at_k(len(v), sum(v), k) for v in per_task.values()) / len(per_task)
            for k in sorted(set(pass_k))
            if k <= fewest
        },
        "mean_steps": steps / n,
        "mean_action_tokens": sum(r.action_tokens for r in records) / n,
        "mean_tool_calls": sum(r.tool_calls for r in records) / n,
        "invalid_action_rate": sum(r.invalid_actions for r in records) / max(1, steps),
        "errors": sum(r.error is not None for r in records),
    }


def _task(record: EpisodeRecord) -> tuple[str, str]:
    """The task an episode samples, the unit of the clustered intervals: (split, task id)."""
    return (record.split, record.task_id)


def breakdown(records: Sequence[EpisodeRecord], pass_k: Iterable[int] = (1,)) -> dict[str, dict[str, Any]]:
    """``summarize`` per value of each breakdown attribute (``EpisodeRecord.groups``); an episode without an
    attribute others have counts under ``"unknown"``, so each attribute's groups hold every episode."""
    keys = sorted({k for r in records for k in r.groups})
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        groups: dict[str, list[EpisodeRecord]] = defaultdict(list)
        for r in records:
            groups[r.groups.get(key, "unknown")].append(r)
        out[key] = {value: summarize(members, pass_k) for value, members in sorted(groups.items())}
    return out


Metric = Literal["success", "reward", "steps", "action_tokens"]


def paired_differences(
    a_records: Sequence[EpisodeRecord | Mapping[str, Any]],
    b_records: Sequence[EpisodeRecord | Mapping[str, Any]],
    metric: Metric = "success",
) -> tuple[list[float], list[tuple[str, str]]]:
    """The per-episode differences a − b of ``metric`` over the same episodes (in episode order), and each
    episode's task (split, task id).

    Each side holds one mode's records (records from a report's JSON work as they are). The two sides must
    name the same episodes (split, task, seed, sample), each once: otherwise ``ValueError`` saying which
    differ."""
    sides = []
    for label, records in (("a", a_records), ("b", b_records)):
        by_episode: dict[tuple[str, str, int, int], EpisodeRecord] = {}
        for item in records:
            record = item if isinstance(item, EpisodeRecord) else EpisodeRecord.from_dict(item)
            if record.episode in by_episode:
                raise ValueError(
                    f"side {label} has episode {record.episode} twice (split, task, seed, sample): pass one "
                    "temperature's records per side"
                )
            by_episode[record.episode] = record
        sides.append(by_episode)
    a, b = sides
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise ValueError(
            f"paired comparison needs the same episodes on both sides: {len(only_a)} only in a (e.g. "
            f"{only_a[:3]}), {len(only_b)} only in b (e.g. {only_b[:3]}); evaluate both with the same splits, "
            "tasks, seeds and samples"
        )
    if metric not in ("success", "reward", "steps", "action_tokens"):
        raise ValueError(f"unknown metric {metric!r}; valid: success, reward, steps, action_tokens")
    episodes = sorted(a)
    diffs = [float(getattr(a[e], metric)) - float(getattr(b[e], metric)) for e in episodes]
    return diffs, [_task(a[e]) for e in episodes]


def paired_difference(
    a_records: Sequence[EpisodeRecord | Mapping[str, Any]],
    b_records: Sequence[EpisodeRecord | Mapping[str, Any]],
    metric: Metric = "success",
    confidence: float = 0.95,
) -> MeanInterval:
    """The mean paired difference a − b of ``metric`` over the same episodes and its episode-level interval: a
    paired t interval on the per-episode differences (mean ± t_{0.975, n−1} s/√n), which treats episodes as
    independent. ``paired_difference_by_task`` is the honest one when tasks repeat (``paired_differences``
    says what the sides must hold)."""
    diffs, _ = paired_differences(a_records, b_records, metric)
    return t_interval(diffs, confidence)


def paired_difference_by_task(
    a_records: Sequence[EpisodeRecord | Mapping[str, Any]],
    b_records: Sequence[EpisodeRecord | Mapping[str, Any]],
    metric: Metric = "success",
    confidence: float = 0.95,
) -> ClusteredMeanInterval:
    """The mean paired difference a − b of ``metric`` over the same episodes with its interval clustered by task
    (``clustered_t_interval``: with every task played equally often, the t interval over the per-task mean
    differences on tasks − 1 degrees of freedom). Needs episodes of at least two tasks."""
    diffs, tasks = paired_differences(a_records, b_records, metric)
    return clustered_t_interval(diffs, tasks, confidence)


def paired_entry(a: Sequence[EpisodeRecord], b: Sequence[EpisodeRecord], metric: Metric) -> dict[str, Any]:
    """A report's paired difference A − B of ``metric``: the interval clustered by task (``ci_low``,
    ``ci_high``, ``tasks``, ``se``, ``df``; all ``None`` with a single task) and the episode-level paired t
    interval beside it (``episode``)."""
    episode = paired_difference(a, b, metric)
    tasks = {_task(r) for r in a}
    clustered: dict[str, Any] = (
        paired_difference_by_task(a, b, metric).to_dict()
        if len(tasks) > 1
        else {"ci_low": None, "ci_high": None, "se": None, "df": None, "method": "one task: no interval"}
    )
    return {
        **clustered,
        "mean": episode.mean,
        "n": episode.n,
        "tasks": len(tasks),
        "confidence": episode.confidence,
        "episode": {**episode.to_dict(), "method": "paired t over episodes"},
    }
