"""What ALFWorld training changed, by task type: the held-out change of each type beside the share of the type in
what the run trained.

Reads what ``bench_alfworld_recipe.py`` leaves in its ``--out`` directory: the start's evaluation of the eval
splits (``start_eval_splits.json``, a ``streamrl eval`` report with its episodes) and, per run directory, the end's
(``eval_splits_end.json``, the same episodes) and ``metrics.jsonl`` (each update's ``batch/task_ids``). For every
run and task type (the six of ALFWorld, from each episode's ``groups.task_type``) it writes:

- the paired change of success on the eval splits pooled, end − start on the same episodes, with its 95 %
  interval clustered by task (``streamrl.evaluation.compare.paired_gain``), and the start's rate;
- the share of the type among the episodes the run trained (all updates);

and, over the runs' (run, type) cells, the correlation of the share trained with the change, raw and within type
(each type's mean over the runs removed: does a run that trained a type more than the other runs did gain more on
it?). An association over a few runs, not a controlled test::

    python benchmarks/alfworld_by_task_type.py --dir /work/jobs/k4 --runs lr0.003-seed0 lr0.003-seed1 \\
        lr0.003-seed2 --out benchmarks/results/learning/alfworld_preset_by_task_type.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench_alfworld_recipe import Episodes, episodes_of, paired_on

TYPE = re.compile(r"^\d+-(\w+?)-")
"""An ALFWorld task id's type, after its split (``alfworld/train/0109-look_at_obj_in_light-FloorPlan328``)."""


def task_type(task_id: str) -> str:
    name = task_id.rsplit("/", 1)[-1]
    match = TYPE.match(name)
    if match is None:
        raise ValueError(f"{task_id!r} is not an ALFWorld task id (<split>/<index>-<type>-<scene>)")
    return match.group(1)


def episodes(report: Path) -> Episodes:
    """A ``streamrl eval`` report's episodes, by (split, task, seed, sample)."""
    return episodes_of(json.loads(report.read_text()))


def trained(run: Path) -> Counter[str]:
    """The task types of the episodes ``run`` trained, counted (each update's ``batch/task_ids`` in
    ``metrics.jsonl``)."""
    counts: Counter[str] = Counter()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            counts.update(task_type(t) for t in json.loads(line).get("batch/task_ids") or [])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, required=True, help="bench_alfworld_recipe.py's --out directory")
    parser.add_argument("--runs", nargs="+", required=True, help="run directories under --dir")
    parser.add_argument("--out", type=Path, required=True, help="JSON to write")
    args = parser.parse_args()

    start = episodes(args.dir / "start_eval_splits.json")
    types = sorted({e["groups"]["task_type"] for e in start.values()})
    result: dict[str, Any] = {"dir": str(args.dir), "runs": {}, "types": types}
    cells: list[tuple[str, str, float, float]] = []  # (run, type, share trained, change)
    for name in args.runs:
        end = episodes(args.dir / name / "eval_splits_end.json")
        if set(end) != set(start):
            raise ValueError(f"{name}'s end evaluation played other episodes than the start's")
        counts = trained(args.dir / name)
        total = sum(counts.values())
        per_type = {}
        for kind in types:
            keys = [k for k, e in start.items() if e["groups"]["task_type"] == kind]
            gain = paired_on(end, start, keys)
            share = counts[kind] / total
            per_type[kind] = {
                "episodes": len(keys),
                "tasks": len({k[1] for k in keys}),
                "start_success": gain["start"],
                "paired_change": {k: gain[k] for k in ("mean", "ci_low", "ci_high")},
                "trained_share": share,
                "trained_episodes": counts[kind],
            }
            cells.append((name, kind, share, gain["mean"]))
        result["runs"][name] = per_type
        print(name)
        for kind, row in per_type.items():
            c = row["paired_change"]
            print(
                f"  {kind:32s} start {row['start_success']:.3f}  change {c['mean']:+.3f} "
                f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]  trained {row['trained_share']:.2f}"
            )
    shares, changes = [c[2] for c in cells], [c[3] for c in cells]
    centred: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for _, kind, share, change in cells:
        centred[kind].append((share, change))
    dx, dy = [], []
    for pairs in centred.values():
        mx, my = statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)
        dx += [p[0] - mx for p in pairs]
        dy += [p[1] - my for p in pairs]
    result["correlation_share_vs_change"] = {
        "cells": len(cells),
        "raw": statistics.correlation(shares, changes),
        "within_type": statistics.correlation(dx, dy) if len(args.runs) > 1 else None,
    }
    print(json.dumps(result["correlation_share_vs_change"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
