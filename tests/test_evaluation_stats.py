"""The statistics of the evaluation harness and the learning-curve metrics, against hand-computed oracles
(``docs/evaluation.md`` has the formulas): Wilson intervals, unbiased pass@k, Student-t quantiles and
intervals, paired differences of episode records, SPO++ Eq. 7 / Eq. 8, and matched runs compared as SPO++
Table 1 does (truncated to the common budget, mean ± sample s.d. of the paired differences)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from streamrl.evaluation.curves import (
    auc_mean,
    auc_trapz,
    c10,
    compare_curves,
    curve_metrics,
    final_mean,
    load_curve,
    pair_curves,
    read_metrics,
)
from streamrl.evaluation.harness import AgentSpec, EpisodeRecord, paired_difference, summarize
from streamrl.evaluation.stats import pass_at_k, student_t_quantile, t_interval, wilson_interval

# ---------------------------------------------------------------------------------------------------------
# Wilson, pass@k, Student t


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [
        # z = 1.959964: 5/10 -> center .5, half z/(1+z²/10)·√(.025 + z²/400) = .263407
        (5, 10, 0.236593, 0.763407),
        # 0 successes: [0, z²/(n+z²)] = [0, 3.841459/13.841459]
        (0, 10, 0.0, 0.277533),
        (10, 10, 0.722467, 1.0),
        # 1/4: center (.25 + .480209)/1.960365 = .372483, half 1.959964/1.960365·√(.046875 + .060021) = .326823
        (1, 4, 0.045587, 0.699358),
    ],
)
def test_wilson_interval(successes: int, n: int, low: float, high: float) -> None:
    lo, hi = wilson_interval(successes, n)
    assert lo == pytest.approx(low, abs=1e-6)
    assert hi == pytest.approx(high, abs=1e-6)


def test_wilson_interval_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="successes=11, n=10"):
        wilson_interval(11, 10)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (4, 3, 2, 1.0),  # n - c < k: every draw of 2 holds a success
        (5, 0, 3, 0.0),
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_needs_k_at_most_n() -> None:
    with pytest.raises(ValueError, match="1 <= k <= n, got n=4, c=1, k=5"):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize(
    ("df", "t"),  # the 97.5 % quantiles of a t table
    [
        (1, 12.7062),
        (2, 4.3027),
        (3, 3.1824),
        (4, 2.7764),
        (5, 2.5706),
        (10, 2.2281),
        (30, 2.0423),
        (1000, 1.9623),
    ],
)
def test_student_t_quantile_matches_the_table(df: int, t: float) -> None:
    assert student_t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)


def test_t_interval() -> None:
    # mean 3, s = √2.5 = 1.581139, half-width t(.975, 4) · s / √5 = 2.776445 · .707107 = 1.963243
    interval = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (interval.mean, interval.n) == (3.0, 5)
    assert interval.sd == pytest.approx(1.581139, abs=1e-6)
    assert (interval.low, interval.high) == pytest.approx((3 - 1.963243, 3 + 1.963243), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Episode records: summaries and paired differences


def record(
    task: str, sample: int, success: bool, *, seed: int = 0, steps: int = 2, invalid: int = 0
) -> EpisodeRecord:
    return EpisodeRecord(
        split="test",
        task_id=task,
        seed=seed,
        sample=sample,
        temperature=1.0,
        success=success,
        reward=float(success),
        steps=steps,
        action_tokens=10 * steps,
        tool_calls=1,
        invalid_actions=invalid,
        groups={"split": "test"},
    )


def test_summarize_averages_pass_at_k_over_tasks() -> None:
    # task a: 1 of 4 succeeded, task b: 4 of 4
    records = [record("a", i, i == 0, invalid=1) for i in range(4)] + [record("b", i, True) for i in range(4)]
    s = summarize(records, pass_k=(1, 2, 8))
    assert (s["episodes"], s["successes"], s["tasks"]) == (8, 5, 2)
    assert s["success_rate"] == 5 / 8
    assert s["pass_at_k"]["1"] == pytest.approx((1 / 4 + 1) / 2)
    assert s["pass_at_k"]["2"] == pytest.approx(((1 - 3 / 6) + 1) / 2)
    assert "8" not in s["pass_at_k"]  # more than the 4 episodes a task has
    assert s["success_ci95"] == pytest.approx(list(wilson_interval(5, 8)))
    assert s["invalid_action_rate"] == 4 / 16
    assert (s["mean_steps"], s["mean_action_tokens"], s["mean_tool_calls"]) == (2, 20, 1)


def test_paired_difference_is_a_paired_t_interval() -> None:
    a = [record("a", 0, True), record("b", 0, True), record("c", 0, False), record("d", 0, True)]
    b = [record("d", 0, False), record("c", 0, False), record("b", 0, True), record("a", 0, False)]
    diff = paired_difference(a, b)  # differences 1, 0, 0, 1 (matched by episode, not by position)
    assert (diff.mean, diff.n) == (0.5, 4)
    half = 3.182446 * math.sqrt(1 / 3) / 2  # t(.975, 3) · s / √4
    assert (diff.low, diff.high) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-6)
    again = paired_difference(
        [r.to_dict() for r in a], [r.to_dict() for r in b]
    )  # records from a report's JSON
    assert again == diff


def test_paired_difference_refuses_different_episode_sets() -> None:
    a = [record("a", 0, True), record("b", 0, True)]
    b = [record("a", 0, True), record("b", 0, True, seed=1)]
    with pytest.raises(ValueError, match=r"1 only in a .*'b', 0, 0.*1 only in b .*'b', 1, 0"):
        paired_difference(a, b)
    with pytest.raises(ValueError, match="twice"):
        paired_difference(a + a[:1], b)


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("expert", AgentSpec("expert")),
        ("sft", AgentSpec("sft", "tiny")),
        ("sft:smollm2-135m", AgentSpec("sft", "smollm2-135m")),
        ("model:tiny@runs/x/policy/v3", AgentSpec("model", "tiny", policy="runs/x/policy/v3")),
        ("run:runs/x", AgentSpec("run", "runs/x")),
        ("run:runs/x@latest", AgentSpec("run", "runs/x")),
        ("run:runs/x@4", AgentSpec("run", "runs/x", version=4)),
    ],
)
def test_agent_specs(text: str, spec: AgentSpec) -> None:
    assert AgentSpec.parse(text) == spec
    assert AgentSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [("gpt:4", "unknown agent 'gpt:4'; valid forms: run:DIR"), ("run:x@v2", "version 'v2' must be a number")],
)
def test_bad_agent_specs_name_the_valid_forms(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentSpec.parse(text)


# ---------------------------------------------------------------------------------------------------------
# Learning-curve metrics


def test_auc_and_final() -> None:
    assert auc_trapz([0.2]) == 0.2  # T = 1: r_1
    assert auc_trapz([0.0, 1.0]) == 0.5
    # ((.1 + .3)/2 + (.3 + .2)/2) / 2
    assert auc_trapz([0.1, 0.3, 0.2]) == pytest.approx(0.225)
    assert auc_mean([0.1, 0.3, 0.2]) == pytest.approx(0.2)
    assert final_mean([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) == pytest.approx(0.5)  # the last five
    assert final_mean([0.1, 0.3]) == pytest.approx(0.2)  # fewer than five: all


def test_c10() -> None:
    r = [t / 10 for t in range(1, 11)]
    # AUC_trapz(r_1..10) = (.15 + .25 + ... + .95) / 9 = .55; mean of r_6..10 = .8
    assert c10(r) == pytest.approx(0.5 * (0.55 + 0.8))
    assert c10([*r, 0.0, 0.0]) == c10(r)  # only the first ten points count
    with pytest.raises(ValueError, match="at least 10 points, the curve has 9"):
        c10(r[:9])
    assert curve_metrics(r[:9])["c10"] is None


def write_run(root: Path, name: str, seed: int, rows: Sequence[dict[str, Any]], algo: str = "spo++") -> Path:
    run = root / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"seed": seed, "algo": algo, "env": "math_tir"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def evals(values: Sequence[float]) -> list[dict[str, Any]]:
    return [{"update": u, "eval/success": v} for u, v in enumerate(values)]


def test_matched_runs_are_truncated_to_the_common_budget_and_paired(tmp_path: Path) -> None:
    a = [
        load_curve(write_run(tmp_path, "a0", 0, evals([0.1, 0.2, 0.3, 0.4]))),
        load_curve(write_run(tmp_path, "a1", 1, evals([0.4] * 4))),
    ]
    b = [
        load_curve(write_run(tmp_path, "b1", 1, evals([0.1] * 4), algo="spo")),
        load_curve(write_run(tmp_path, "b0", 0, evals([0.1] * 3), algo="spo")),
    ]
    pairs = pair_curves(a, b)
    assert [(x.seed, y.seed, x.updates) for x, y in pairs] == [(0, 0, (0, 1, 2)), (1, 1, (0, 1, 2, 3))]
    table = compare_curves(a, b)
    # seed 0: a truncated to .1 .2 .3 -> AUC_trapz (.15 + .25)/2 = .2, b .1: difference .1; seed 1: .4 - .1 = .3
    assert table.difference["auc_trapz"].values == pytest.approx((0.1, 0.3))
    assert table.difference["auc_trapz"].mean == pytest.approx(0.2)
    assert table.difference["auc_trapz"].sd == pytest.approx(math.sqrt(0.02))  # sample s.d. of .1, .3
    assert table.a["auc_trapz"].mean == pytest.approx((0.2 + 0.4) / 2)
    assert table.difference["c10"].mean is None  # curves of 3-4 points have no C10


def test_unmatched_runs_are_refused(tmp_path: Path) -> None:
    a = [load_curve(write_run(tmp_path, "a0", 0, evals([0.1, 0.2])))]
    b = [load_curve(write_run(tmp_path, "b1", 1, evals([0.1, 0.2])))]
    with pytest.raises(ValueError, match=r"the same seeds on both sides: \[0\] vs \[1\]"):
        pair_curves(a, b)
    assert len(pair_curves(a, b, pairing="order")) == 1
    sparse = [
        load_curve(
            write_run(
                tmp_path,
                "c0",
                0,
                [
                    {"update": 0, "eval/success": 0.1},
                    {"update": 1, "x": 1},
                    {"update": 2, "eval/success": 0.2},
                ],
            )
        )
    ]
    dense = [load_curve(write_run(tmp_path, "d0", 0, evals([0.1, 0.2, 0.3])))]
    with pytest.raises(ValueError, match=r"at different updates \(\[0, 2\] vs \[0, 1, 2\]\)"):
        pair_curves(sparse, dense)


def test_reading_a_missing_run_or_column_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"run '.*nowhere': no such directory"):
        read_metrics(tmp_path / "nowhere")
    run = write_run(tmp_path, "r", 0, [{"update": 1, "batch/success": 0.5}])
    with pytest.raises(ValueError, match=r"no 'eval/success' values .*eval_every=0.*\['batch/success'\]"):
        load_curve(run)
