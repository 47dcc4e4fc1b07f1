"""``streamrl eval`` and ``streamrl compare`` end to end on real components: the real ``tiny`` model (from the
base weights: no SFT build), the real Math-TIR env and sandbox, real runs of the trainer at its smallest size.

An untrained ``tiny`` never solves a task, so the LLM evaluations check the report's structure, the episode
bookkeeping and that the seeds derive from the episode alone (an agent against itself differs by exactly 0);
the scripted expert checks that successes are counted. Envs run in-process, 8 tokens a turn.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import QUIET, run_config
from streamrl.algorithms.train import train
from streamrl.cli.main import main
from streamrl.evaluation.compare import CompareConfig, compare
from streamrl.evaluation.curves import read_metrics
from streamrl.evaluation.harness import EvalConfig, run_evaluation

SMALL: dict[str, Any] = dict(
    tasks=3, samples=2, max_new_tokens=8, num_envs=4, env_workers="inprocess", progress=False
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two matched runs (seed 0) of SPO++ and SPO from the base ``tiny``: 2 updates of 4 episodes, a held-out
    evaluation of 4 episodes at every update; SPO's (it publishes every update) also writes the mean of its two
    versions."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for algo in ("spo++", "spo"):
        average = {"average_last": 2} if algo == "spo" else {}
        train(
            run_config(root / algo, algo=algo, eval_every=1, eval_episodes=4, max_new_tokens=8, **average),
            progress=False,
        )
        out[algo] = root / algo
    return out


def test_eval_cli_reports_every_metric_and_breakdowns_that_sum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    argv = [
        "eval",
        "model:tiny",
        "--tasks",
        "3",
        "--samples",
        "2",
        "--seeds",
        "0",
        "1",
        "--max-new-tokens",
        "8",
    ]
    assert (
        main([*argv, "--num-envs", "4", "--env-workers", "inprocess", "--no-progress", "--out", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "greedy" in printed and "T=1" in printed and "pass@4" in printed
    report = json.loads(out.read_text())
    assert (report["env"], report["splits"], report["tasks"]) == ("math_tir", ["test"], {"test": 3})
    (agent,) = report["agents"]
    episodes = agent["episodes"]
    assert len(episodes) == 3 * 2 * 1 + 3 * 2 * 2  # greedy: a task once per seed; T=1: twice per seed
    assert len({(e["task_id"], e["seed"], e["sample"], e["temperature"]) for e in episodes}) == len(episodes)
    for result in agent["results"]:
        s = result["summary"]
        mode = [e for e in episodes if e["temperature"] == result["temperature"]]
        assert s["episodes"] == len(mode)
        assert s["successes"] == sum(e["success"] for e in mode) == 0  # untrained tiny
        assert s["success_ci95"][0] == 0.0 < s["success_ci95"][1]
        # no success: no variance to estimate the clustering from, the clustered interval is Wilson's
        assert (s["tasks"], s["success_ci95_task"]) == (3, s["success_ci95"])
        assert s["mean_steps"] == sum(e["steps"] for e in mode) / len(mode) > 0
        assert 0 < s["mean_action_tokens"] <= 8 * s["mean_steps"]
        assert 0 <= s["invalid_action_rate"] <= 1
        assert set(s["pass_at_k"]) == ({"1"} if result["temperature"] == 0 else {"1", "4"})
        assert {"split", "source", "family"} <= set(result["breakdown"])
        for groups in result["breakdown"].values():  # every attribute's groups hold every episode once
            assert sum(g["episodes"] for g in groups.values()) == s["episodes"]
            assert sum(g["successes"] for g in groups.values()) == s["successes"]
        assert {e["groups"]["family"] for e in mode} == set(result["breakdown"]["family"])


def test_the_scripted_expert_solves_math_tir(tmp_path: Path) -> None:
    out = tmp_path / "reports" / "expert.json"  # a str, as Python callers write it; the CLI gives a Path
    report = run_evaluation(
        EvalConfig(agent="expert", **{**SMALL, "tasks": 8}, temperatures=(1.0,), out=str(out)),  # type: ignore[arg-type]
        log=QUIET,
    )
    assert (
        json.loads(out.read_text())["agents"][0]["results"][0]["summary"]
        == report["agents"][0]["results"][0]["summary"]
    )
    (result,) = report["agents"][0]["results"]
    s = result["summary"]
    assert s["episodes"] == 16 and s["success_rate"] >= 0.9
    assert s["mean_tool_calls"] >= 1 and s["mean_action_tokens"] == 0
    assert s["pass_at_k"]["2"] >= s["pass_at_k"]["1"] >= 0.9


@pytest.mark.alfworld
def test_alfworld_breaks_down_by_seen_unseen_and_task_type() -> None:
    pytest.importorskip("textworld", reason="needs the alfworld extra: pip install -e .[alfworld]")
    config = EvalConfig(agent="expert", env="alfworld", **{**SMALL, "samples": 1}, temperatures=(1.0,))
    (result,) = run_evaluation(config, log=QUIET)["agents"][0]["results"]
    s, groups = result["summary"], result["breakdown"]
    assert s["episodes"] == 6 and s["success_rate"] == 1.0  # the search expert wins these within 50 steps
    assert {k: g["episodes"] for k, g in groups["split"].items()} == {"eval_seen": 3, "eval_unseen": 3}
    assert sum(g["episodes"] for g in groups["task_type"].values()) == 6
    assert "unknown" not in groups["task_type"]


@pytest.mark.alfworld
def test_constrained_actions_make_every_action_admissible() -> None:
    pytest.importorskip("textworld", reason="needs the alfworld extra: pip install -e .[alfworld]")
    small = {
        **SMALL,
        "tasks": 2,
        "max_new_tokens": 24,
        "temperatures": (0.0,),
        "env_kwargs": {"max_steps": 3},
    }
    invalid, tokens = {}, {}
    for constrain, avoid in ((False, False), (True, False), (True, True)):
        config = EvalConfig(
            agent="model:tiny",
            env="alfworld",
            splits=("eval_seen",),
            constrain_actions=constrain,
            avoid_repeats=avoid,
            **small,
        )
        (agent,) = run_evaluation(config, log=QUIET)["agents"]
        assert (agent["constrain_actions"], agent["avoid_repeats"]) == (constrain, avoid)
        assert len(agent["episodes"]) == 2
        invalid[constrain, avoid] = sum(e["invalid_actions"] for e in agent["episodes"])
        tokens[constrain, avoid] = [e["action_tokens"] for e in agent["episodes"]]
    # the untrained tiny never writes a command by itself
    assert invalid == {(False, False): 6, (True, False): 0, (True, True): 0}
    # greedy, it takes one command again and again from the state it leaves unchanged (6 tokens: a one-token
    # command and the end of turn, 3 times); kept from repeating, it goes on to longer ones
    assert tokens[True, False] == [6, 6] and all(n > 6 for n in tokens[True, True])


def test_a_run_at_any_version_and_paired_comparison(runs: dict[str, Path]) -> None:
    run = runs["spo"]
    report = run_evaluation(
        EvalConfig(agent=f"run:{run}", vs="model:tiny", **{**SMALL, "tasks": 2}, temperatures=(1.0,)),
        log=QUIET,
    )
    a, b = report["agents"]
    assert "at version 2" in a["description"]  # SPO publishes every update: the latest of two
    assert [p["metric"] for p in report["paired"]] == ["success", "reward"]
    for p in report["paired"]:  # 2 tasks x 2 samples: the interval clustered by task, the episodes' beside it
        assert (p["n"], p["tasks"], p["df"]) == (4, 2, pytest.approx(1.0))
        assert (
            p["method"].startswith("clustered by task") and p["episode"]["method"] == "paired t over episodes"
        )
        assert p["episode"]["n"] == 4 and p["episode"]["mean"] == p["mean"]
    # Version 0 of a run from the base model is model:tiny: the same episodes, token for token.
    same = run_evaluation(
        EvalConfig(agent=f"run:{run}@0", vs="model:tiny", **{**SMALL, "tasks": 2}, temperatures=(1.0,)),
        log=QUIET,
    )
    first, second = same["agents"]
    assert first["episodes"] == second["episodes"] == b["episodes"]
    assert all(p["mean"] == p["se"] == p["episode"]["sd"] == 0 for p in same["paired"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run:{root}/nowhere"], "run '.*nowhere': no such directory"),
        (["run:{spo}@7"], r"has no policy version 7 on disk; available: \[0, 1, 2\]"),
        (["model:tiny", "--env", "chess"], r"unknown env 'chess'; valid: \['alfworld', 'math_tir'"),
        (
            ["model:tiny", "--splits", "valid"],
            r"unknown split\(s\) \['valid'\] of env 'math_tir'; valid: \['train', 'test'\]",
        ),
        (["run:{spo}", "--env", "alfworld"], "was trained on env 'math_tir', not 'alfworld'"),
        # no command twice from one state removes choices: only a constrained agent has them (a run: its own)
        (
            ["run:{spo}", "--avoid-repeats"],
            "avoid_repeats=True needs constrained actions, and run:.*spo plays",
        ),
        (["model:tiny@{root}/none"], "policy directory '.*none' does not exist"),
        (["run:{spo}++@average"], r"run '.*spo\+\+' has no averaged policy .*train it with average_last=K"),
    ],
)
def test_bad_eval_input_is_named_with_what_is_valid(
    argv: list[str], message: str, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    filled = [a.format(root=runs["spo"].parent, spo=runs["spo"]) for a in argv]
    assert main(["eval", *filled, "--no-progress", "--env-workers", "inprocess"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_avoid_repeats_without_constrained_actions_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "model:tiny", "--avoid-repeats", "--no-constrain-actions"])
    assert "avoid_repeats=True needs constrain_actions=True" in capsys.readouterr().err


def test_compare_writes_table_plots_and_report(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", str(runs["spo++"]), "--vs", str(runs["spo"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| eval/success | spo++ | spo | spo++ − spo (paired) |" in printed
    for name in ("learning_curves.png", "diagnostics.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "![learning curves](learning_curves.png)" in report and "![diagnostics](diagnostics.png)" in report
    data = json.loads((out / "compare.json").read_text())
    assert data["columns"] == ["eval/success", "batch/success"]
    held_out = data["tables"]["eval/success"]
    assert held_out["pairs"][0]["points"] == 3  # evaluations at updates 0, 1, 2
    for metric in ("auc_trapz", "auc_mean", "final", "c10"):
        assert set(held_out["metrics"][metric]) == {"a", "b", "difference"}
    # each run's own held-out gain, its last evaluation against the first, clustered by task as the trainer logs it
    assert "last − first (95 %, by task)" in report
    for info in data["runs"]:
        last = [r for r in read_metrics(Path(info["run"])) if "eval/delta" in r][-1]
        gain = info["held_out_gain"]
        assert (gain["n"], gain["tasks"]) == (4, 4) and gain["mean"] == pytest.approx(last["eval/delta"])
        assert (gain["ci_high"] - gain["ci_low"]) / 2 == pytest.approx(last["eval/delta_ci95"])
    # the Python API on one side only: a summary table
    alone = compare(CompareConfig(runs=(runs["spo"],), out=tmp_path / "alone"))
    assert alone["labels"] == ["spo"] and "| batch/success | spo |" in alone["markdown"]


def test_compare_names_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(tmp_path / "gone"), "--out", str(tmp_path / "cmp")]) == 2
    assert "gone': no such directory" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the `vllm` extra)"
)
def test_the_vllm_backend_plays_the_hf_backend_s_greedy_episodes(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """``--backend vllm`` on a model with a published adapter: greedy, the same episodes as the HF backend (both
    float32, log-probs within ~1e-6, so the same tokens). Full fine-tuned weights are refused by name."""
    from helpers import make_adapter

    make_adapter(tmp_path / "adapter", seed=3)
    config = EvalConfig(agent=f"model:tiny@{tmp_path / 'adapter'}", **SMALL, temperatures=(0.0,))
    hf = run_evaluation(config, log=QUIET)["agents"][0]
    vllm = run_evaluation(replace(config, backend="vllm"), log=QUIET)["agents"][0]
    assert vllm["episodes"] == hf["episodes"] and len(hf["episodes"]) == 3
    assert sum(e["action_tokens"] for e in hf["episodes"]) > 0
    with pytest.raises(ValueError, match=r"holds full fine-tuned weights; .* backend='hf'"):
        run_evaluation(replace(config, agent=f"run:{runs['spo']}", backend="vllm"), log=QUIET)
    with pytest.raises(ValueError, match="backend must be 'hf' or 'vllm', got 'sglang'"):
        replace(config, backend="sglang")


def test_averaged_policies_are_the_mean_of_the_versions_and_play_as_a_policy(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from streamrl.algorithms.averaging import AVERAGE_FILE

    run = runs["spo"]

    def weights(directory: Path) -> dict[str, Any]:
        return load_file(str(directory / "model.safetensors"))

    # Two versions that differ (this tiny run's updates barely move it): the run's v2, and v2 moved at random.
    pair = tmp_path / "pair"
    v1 = weights(run / "policy" / "v2")
    g = torch.Generator().manual_seed(0)
    v2 = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in v1.items()}
    for version, tensors in ((1, v1), (2, v2)):
        shutil.copytree(run / "policy" / "v2", pair / "policy" / f"v{version}")
        save_file(
            tensors, str(pair / "policy" / f"v{version}" / "model.safetensors"), metadata={"format": "pt"}
        )
    assert main(["average", "--run", str(pair), "--versions", "1-2", "--out", str(tmp_path / "mean")]) == 0
    mean = weights(tmp_path / "mean")
    assert set(mean) == set(v1)
    for name, value in mean.items():  # the float64 mean, stored in the weights' own dtype
        expected = ((v1[name].double() + v2[name].double()) / 2).to(v1[name].dtype)
        assert value.dtype == v1[name].dtype and (value == expected).all(), name
    assert json.loads((tmp_path / "mean" / AVERAGE_FILE).read_text())["versions"] == [1, 2]
    assert not (tmp_path / "mean" / "streamrl_probe.json").exists()  # a version's probe is not the mean's
    # The mean of one version is that version: it plays run:RUN@2's episodes token for token.
    shutil.copy2(run / "config.json", pair / "config.json")
    assert main(["average", "--run", str(pair), "--last", "1"]) == 0
    one = pair / "policy" / "avg2-2"
    assert all((weights(one)[k] == v2[k]).all() for k in v2)
    report = run_evaluation(
        EvalConfig(
            agent=f"model:tiny@{one}", vs=f"run:{pair}@2", **{**SMALL, "tasks": 2}, temperatures=(1.0,)
        ),
        log=QUIET,
    )
    a, b = report["agents"]
    assert a["episodes"] == b["episodes"]
    # Bad input names the value and what is valid.
    capsys.readouterr()
    for argv, message in [
        (["--last", "5"], r"last=5 needs 5 published versions on disk, the run has 2: \[1, 2\]"),
        (["--versions", "2-4"], r"versions \[3, 4\] are not on disk; the run has \[1, 2\]"),
        (["--versions", "x"], "versions must be 'A-B' or 'A,B,C' of version numbers, got 'x'"),
        (["--last", "1", "--versions", "1"], "give exactly one of last"),
    ]:
        assert main(["average", "--run", str(pair), *argv]) == 2
        assert re.search(message, capsys.readouterr().err), argv
    adapter = tmp_path / "lora" / "policy" / "v1"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert main(["average", "--run", str(tmp_path / "lora"), "--last", "1"]) == 2
    assert "is a LoRA adapter: adapters do not average" in capsys.readouterr().err


def test_a_run_s_averaged_policy_is_the_mean_of_its_last_versions(runs: dict[str, Path]) -> None:
    from safetensors.torch import load_file
    from streamrl.algorithms.averaging import AVERAGE_FILE

    run = runs["spo"]
    average = run / "policy" / "average"
    assert json.loads((average / AVERAGE_FILE).read_text())["versions"] == [1, 2]
    v1, v2, mean = (
        load_file(str(d / "model.safetensors"))
        for d in (run / "policy" / "v1", run / "policy" / "v2", average)
    )
    for name, value in mean.items():
        assert (value == ((v1[name].double() + v2[name].double()) / 2).to(value.dtype)).all(), name
    report = run_evaluation(
        EvalConfig(
            agent=f"run:{run}@average",
            vs=f"model:tiny@{average}",
            **{**SMALL, "tasks": 2},
            temperatures=(1.0,),
        ),
        log=QUIET,
    )
    a, b = report["agents"]
    assert "the mean of versions 1-2" in a["description"] and a["episodes"] == b["episodes"]
