"""``format_report``: an evaluation report (``streamrl.evaluation.harness.run_evaluation``) as readable tables,
what ``streamrl eval`` prints: per agent one row per sampling mode and per breakdown group, then the paired
differences with their intervals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["format_report"]


def _mode(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def _interval(bounds: Sequence[float] | None, sign: str = "") -> str:
    return "–" if bounds is None else f"[{bounds[0]:{sign}.3f}, {bounds[1]:{sign}.3f}]"


def _row(name: str, s: Mapping[str, Any], ks: Sequence[str]) -> list[str]:
    return [
        name,
        str(s["episodes"]),
        str(s["tasks"]),
        f"{s['success_rate']:.3f}",
        _interval(s.get("success_ci95_task")),
        _interval(s["success_ci95"]),
        f"{s['mean_reward']:.3f}",
        *[f"{s['pass_at_k'][k]:.3f}" if k in s["pass_at_k"] else "–" for k in ks],
        f"{s['mean_steps']:.2f}",
        f"{s['mean_action_tokens']:.1f}",
        f"{s['mean_tool_calls']:.2f}",
        f"{s['invalid_action_rate']:.3f}",
    ]


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def format_report(report: Mapping[str, Any]) -> str:
    """``run_evaluation``'s report as readable tables: per agent one row per mode and per breakdown group,
    then the paired differences."""
    lines = [
        f"env {report['env']}, splits {report['splits']} (tasks: {report['tasks']}), "
        f"seeds {report['config']['seeds']}, episodes per task and seed when sampling: {report['config']['samples']}"
    ]
    for agent in report["agents"]:
        ks = sorted({k for res in agent["results"] for k in res["summary"]["pass_at_k"]}, key=int)
        header = [
            "",
            "episodes",
            "tasks",
            "success",
            "95% CI (tasks)",
            "95% CI (episodes)",
            "reward",
            *[f"pass@{k}" for k in ks],
            "steps",
            "tokens",
            "tools",
            "invalid",
        ]
        lines += ["", f"{agent['label']}: {agent['agent']} -- {agent['description']}"]
        rows = [header]
        for res in agent["results"]:
            mode = _mode(res["temperature"])
            rows.append(_row(mode, res["summary"], ks))
            for key, groups in res["breakdown"].items():
                if len(groups) < 2:
                    continue
                rows += [_row(f"  {key}={value}", s, ks) for value, s in groups.items()]
        lines += _table(rows)
    if report["paired"]:
        lines += [
            "",
            "paired differences A − B on the same episodes, 95 % intervals clustered by task (the unit) and, "
            "beside them, over episodes as if independent:",
        ]
        for p in report["paired"]:
            clustered = None if p["ci_low"] is None else (p["ci_low"], p["ci_high"])
            episode = p["episode"]
            lines.append(
                f"  {_mode(p['temperature'])} {p['metric']}: {p['mean']:+.3f} {_interval(clustered, '+')} "
                f"over {p['tasks']} tasks; episodes {_interval((episode['ci_low'], episode['ci_high']), '+')} "
                f"over {p['n']}"
            )
    return "\n".join(lines)
