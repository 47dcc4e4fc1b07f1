"""The statistics of the evaluation harness and the learning-curve metrics, against hand-computed oracles
(``docs/evaluation.md`` has the formulas): Wilson intervals, unbiased pass@k, Student-t quantiles and
intervals, intervals clustered by task (CR2 with Bell-McCaffrey degrees of freedom, against hand-computed cases
and the matrix form of the estimator), paired differences of episode records, SPO++ Eq. 7 / Eq. 8, and matched runs compared as SPO++
Table 1 does (truncated to the common budget, mean ± sample s.d. of the paired differences)."""

from __future__ import annotations

import json
import math
import random
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
from streamrl.evaluation.harness import AgentSpec
from streamrl.evaluation.summary import (
    EpisodeRecord,
    paired_difference,
    paired_difference_by_task,
    summarize,
)
from streamrl.utils.stats import (
    clustered_t_interval,
    clustered_wilson_interval,
    pass_at_k,
    student_t_quantile,
    t_interval,
    wilson_interval,
)

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
# Intervals clustered by task


def grouped(per_task: dict[str, list[float]]) -> tuple[list[float], list[str]]:
    """(values, their tasks) of ``{task: [values]}``."""
    return [v for vs in per_task.values() for v in vs], [t for t, vs in per_task.items() for _ in vs]


def test_clustered_interval_of_a_balanced_design_is_the_t_interval_over_task_means() -> None:
    # 4 tasks x 3 episodes; task means 2/3, -1/3, 1, 1/3 -> mean 5/12 (= the pooled mean of the 12 values);
    # deviations 1/4, -3/4, 7/12, -1/12: Σ² = 35/36, s² = 35/108, s = .569275, se = s/√4 = .284638;
    # half-width t(.975, 3) · se = 3.182446 · .284638 = .905844.
    # CR2 the long way: e_g = 3 (mean_g − 5/12) = 3/4, −9/4, 7/4, −1/4, Σ e_g² = 35/4, each weighed 1/(1 − 3/12)
    # = 4/3, over N² = 144: se² = (4/3)(35/4)/144 = 35/432 = .081019 = .284638².
    values, tasks = grouped({"t1": [1, 1, 0], "t2": [-1, 0, 0], "t3": [1, 1, 1], "t4": [1, 0, 0]})
    interval = clustered_t_interval(values, tasks)
    assert (interval.mean, interval.n, interval.tasks) == (pytest.approx(5 / 12), 12, 4)
    assert interval.se == pytest.approx(math.sqrt(35 / 432), abs=1e-12)
    assert interval.df == pytest.approx(3.0)
    assert (interval.low, interval.high) == pytest.approx((5 / 12 - 0.905844, 5 / 12 + 0.905844), abs=1e-6)
    over_means = t_interval([2 / 3, -1 / 3, 1.0, 1 / 3])
    assert (interval.low, interval.high) == pytest.approx((over_means.low, over_means.high), abs=1e-12)
    # the same 12 values taken as independent: s = .668558, half-width t(.975, 11) · s/√12 = .424781
    episodes = t_interval(values)
    assert episodes.half_width == pytest.approx(0.424781, abs=1e-6)
    assert episodes.half_width < interval.half_width


def test_clustered_interval_of_an_unbalanced_design() -> None:
    # tasks of 3, 1, 2 and 2 episodes, N = 8; pooled mean ȳ = 4/8 (each episode counts once; the unweighted mean
    # of the task means 1, 0, 1/2, 0 would be 3/8, another quantity). Residual totals e_g = 3/2, −1/2, 0, −1;
    # CR2 weights 1/(1 − m_g/8) = 8/5, 8/7, 4/3, 4/3:
    #   se² = (8/5 · 9/4 + 8/7 · 1/4 + 0 + 4/3 · 1) / 64 = 137/1680 = .081548, se = .285565.
    # Bell-McCaffrey: Σ m_g² = 18; a_g = m_g² / (1 − m_g/8) = 72/5, 8/7, 16/3, 16/3; ((Σa)² − Σa²)/64 = 1027/198;
    #   df = 64 / (18 + 1027/198) = 315/121 = 2.603, below the tasks − 1 = 3 of a balanced design;
    # the quantile takes ⌊df⌋ = 2: half-width t(.975, 2) · se = 4.302653 · .285565 = 1.228689.
    values, tasks = grouped({"A": [1, 1, 1], "B": [0], "C": [1, 0], "D": [0, 0]})
    interval = clustered_t_interval(values, tasks)
    assert (interval.mean, interval.tasks) == (0.5, 4)
    assert interval.se == pytest.approx(math.sqrt(137 / 1680), abs=1e-12)
    assert interval.df == pytest.approx(315 / 121, abs=1e-12)
    assert interval.half_width == pytest.approx(1.228689, abs=1e-6)


def cr2_by_matrices(values: Sequence[float], tasks: Sequence[str]) -> tuple[float, float]:
    """(se, df) of the mean by the general CR2 formula (Bell & McCaffrey 2002; Imbens & Kolesár 2016) on the
    intercept-only design: V = (X'X)⁻¹ Σ_g X_g' A_g e_g e_g' A_g X_g (X'X)⁻¹ with A_g = (I − H_gg)^-½, and
    df = (Σλ)² / Σλ² over the eigenvalues λ of G'G, G's column g = (I − H)_{·g} A_g X_g (X'X)⁻¹."""
    np = pytest.importorskip("numpy")
    y = np.asarray(values, dtype=float)
    n = len(y)
    x = np.ones((n, 1))
    h = x @ np.linalg.inv(x.T @ x) @ x.T
    residual = y - h @ y
    bread = np.linalg.inv(x.T @ x)
    meat, columns = np.zeros((1, 1)), []
    for task in dict.fromkeys(tasks):
        idx = np.array([i for i, t in enumerate(tasks) if t == task])
        w, v = np.linalg.eigh(np.eye(len(idx)) - h[np.ix_(idx, idx)])
        a = v @ np.diag(w**-0.5) @ v.T
        score = x[idx].T @ a @ residual[idx]
        meat += np.outer(score, score)
        columns.append((np.eye(n) - h)[:, idx] @ a @ x[idx] @ bread)
    g = np.hstack(columns)
    eig = np.linalg.eigvalsh(g.T @ g)
    return float(np.sqrt((bread @ meat @ bread)[0, 0])), float(eig.sum() ** 2 / (eig**2).sum())


@pytest.mark.parametrize("seed", range(6))
def test_clustered_interval_is_the_cr2_estimator(seed: int) -> None:
    """The closed form against the matrix form, on random unbalanced designs of 0/1 and real outcomes."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 7) for _ in range(rng.randint(2, 9))]
    tasks = [f"t{g}" for g, m in enumerate(sizes) for _ in range(m)]
    values = [float(rng.random() < 0.4) if seed % 2 else rng.gauss(0, 1) for _ in tasks]
    interval = clustered_t_interval(values, tasks)
    se, df = cr2_by_matrices(values, tasks)
    assert interval.se == pytest.approx(se, rel=1e-9, abs=1e-12)
    assert interval.df == pytest.approx(df, rel=1e-9)
    assert 1 <= interval.df <= len(sizes) - 1 + 1e-9  # never more than a balanced design's G − 1


@pytest.mark.parametrize("seed", range(5))
def test_one_episode_per_task_is_the_episode_level_paired_t_interval(seed: int) -> None:
    rng = random.Random(seed)
    a = [record(f"t{i}", 0, rng.random() < 0.5) for i in range(rng.randint(2, 40))]
    b = [record(f"t{i}", 0, rng.random() < 0.3) for i in range(len(a))]
    clustered, episodes = paired_difference_by_task(a, b), paired_difference(a, b)
    assert (clustered.mean, clustered.n, clustered.tasks) == (episodes.mean, episodes.n, episodes.n)
    assert clustered.df == pytest.approx(episodes.n - 1)
    assert (clustered.low, clustered.high) == pytest.approx((episodes.low, episodes.high), abs=1e-12)


def test_outcomes_shared_within_tasks_widen_the_clustered_interval() -> None:
    # 5 tasks x 4 samples, every sample of a task the same outcome: the 20 episodes hold 5 independent values.
    # Clustered se = s_means/√5; episode-level s_e² = 4 · 4 s_means² / 19, se_e = s_e/√20, so the ratio of the
    # standard errors is √((N − 1)/(G − 1)) = √(19/4), and t(.975, 4) > t(.975, 19) widens it further.
    per_task = {"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 0.0}
    a = [record(t, k, won == 1.0) for t, won in per_task.items() for k in range(4)]
    b = [record(t, k, False) for t in per_task for k in range(4)]
    clustered, episodes = paired_difference_by_task(a, b), paired_difference(a, b)
    assert clustered.mean == episodes.mean == 0.6
    assert clustered.se / (episodes.sd / math.sqrt(20)) == pytest.approx(math.sqrt(19 / 4))
    assert clustered.half_width / episodes.half_width == pytest.approx(
        math.sqrt(19 / 4) * student_t_quantile(0.975, 4) / student_t_quantile(0.975, 19)
    )
    assert clustered.low < episodes.low and clustered.high > episodes.high
    lo, hi = clustered_wilson_interval([r.success for r in a], [r.task_id for r in a])
    wlo, whi = wilson_interval(12, 20)
    assert lo < wlo and hi > whi


def test_clustered_wilson_interval() -> None:
    # 4 tasks x 3 episodes, 6 of 12 won: p = .5, clustered se² = 5/108 (t intervals above: task means 2/3, 0, 1,
    # 1/3, s² = 5/27, se² = s²/4), df 3. Effective episodes n* = p(1 − p)/se² · (z/t)² = 5.4 · (1.959964 /
    # 3.182446)² = 2.048170 (N = 12 over a design effect of 2.22, then the t correction). Wilson on n*: center .5,
    # half-width z/(1 + z²/n*) · √(.25/n* + z²/4n*²) = .403807.
    values, tasks = grouped({"t1": [1, 1, 0], "t2": [0, 0, 0], "t3": [1, 1, 1], "t4": [1, 0, 0]})
    z, t = 1.959964, 3.182446
    effective = 0.25 / (5 / 108) * (z / t) ** 2
    half = z / (1 + z * z / effective) * math.sqrt(0.25 / effective + z * z / (4 * effective**2))
    assert effective == pytest.approx(2.048170, abs=1e-5) and half == pytest.approx(0.403807, abs=1e-5)
    assert clustered_wilson_interval(values, tasks) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-6)
    # no success (or no failure): no variance to estimate the clustering from, Wilson's interval on N
    assert clustered_wilson_interval([0] * 6, ["a", "a", "b", "b", "c", "c"]) == wilson_interval(0, 6)
    assert clustered_wilson_interval([1] * 6, ["a", "a", "b", "b", "c", "c"]) == wilson_interval(6, 6)
    # never narrower than the episode-level interval (n* at most N), e.g. outcomes alternating within tasks
    lo, hi = clustered_wilson_interval([1, 0] * 5, ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"])
    wlo, whi = wilson_interval(5, 10)
    assert lo <= wlo and hi >= whi


def test_clustered_intervals_refuse_what_they_cannot_estimate() -> None:
    with pytest.raises(ValueError, match=r"at least 2 tasks, got 1 task\(s\) \(3 episodes\)"):
        clustered_t_interval([1.0, 0.0, 1.0], ["a", "a", "a"])
    with pytest.raises(ValueError, match="one task per value, got 2 values and 3 tasks"):
        clustered_t_interval([1.0, 0.0], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"outcomes must be 0/1 .*got \[0.5\]"):
        clustered_wilson_interval([0.5, 1.0], ["a", "b"])


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
    assert s["success_ci95_task"] == pytest.approx(
        list(clustered_wilson_interval([r.success for r in records], [r.task_id for r in records]))
    )
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
        ("sft@runs/x/policy/avg41-60", AgentSpec("sft", "tiny", policy="runs/x/policy/avg41-60")),
        ("model:tiny@runs/x/policy/v3", AgentSpec("model", "tiny", policy="runs/x/policy/v3")),
        ("run:runs/x", AgentSpec("run", "runs/x")),
        ("run:runs/x@latest", AgentSpec("run", "runs/x")),
        ("run:runs/x@4", AgentSpec("run", "runs/x", version=4)),
        ("run:runs/x@average", AgentSpec("run", "runs/x", policy="average")),
    ],
)
def test_agent_specs(text: str, spec: AgentSpec) -> None:
    assert AgentSpec.parse(text) == spec
    assert AgentSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpt:4", "unknown agent 'gpt:4'; valid forms: run:DIR"),
        ("run:x@v2", "version 'v2' must be a number"),
        ("sft@", "agent 'sft@' names no policy directory"),
    ],
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
