"""The ``streamrl`` command line and the dataclass -> flags / config-file helper behind it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from streamrl.cli.args import (
    add_dataclass_arguments,
    dataclass_from_args,
    dataclass_from_dict,
    field_docs,
    load_config_file,
)
from streamrl.cli.main import main, parse_sft_args


@dataclass(frozen=True)
class Inner:
    """A nested config (set from a config file)."""

    rank: int = 8
    """Adapter rank."""


@dataclass(frozen=True)
class Demo:
    """A config with one field of every supported kind."""

    steps: int
    """Optimizer steps (required)."""
    lr: float = 1e-3
    """Peak learning rate; 100% of it after warm-up."""
    name: str = "run"
    """Run name."""
    out: Path | None = None
    """Output folder."""
    mode: Literal["fast", "exact"] = "fast"
    """How to compute."""
    shuffle: bool = True
    """Shuffle the data each epoch."""
    temperatures: tuple[float, ...] = (0.0, 1.0)
    """Sampling temperatures."""
    window: tuple[int, int] = (1, 2)
    """First and last turn."""
    workers: int | None = None
    """Processes (None: all CPUs)."""
    inner: Inner | None = None
    """A nested config."""
    tags: list[str] = field(default_factory=list)
    """Free-form tags."""


def _parser(**kwargs: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    add_dataclass_arguments(parser, Demo, exclude=("inner", "tags"), **kwargs)  # type: ignore[arg-type]
    return parser


def test_flags_take_their_types_choices_and_help_from_the_dataclass() -> None:
    parser = _parser()
    args = parser.parse_args(
        [
            "--steps", "5", "--lr", "0.5", "--out", "/tmp/x", "--mode", "exact", "--no-shuffle",
            "--temperatures", "0", "0.7", "1", "--window", "3", "4", "--workers", "none",
        ]
    )  # fmt: skip
    config = dataclass_from_args(Demo, args)
    assert config == Demo(
        steps=5,
        lr=0.5,
        out=Path("/tmp/x"),
        mode="exact",
        shuffle=False,
        temperatures=(0.0, 0.7, 1.0),
        window=(3, 4),
        workers=None,
    )
    assert dataclass_from_args(
        Demo, parser.parse_args(["--steps", "1", "--shuffle", "--workers", "2"])
    ) == Demo(steps=1, workers=2)
    text = parser.format_help()
    for expected in [
        "Optimizer steps (required). (required)",
        "Peak learning rate; 100% of it after warm-up. (default: 0.001)",
        "{fast,exact}",
        "--shuffle, --no-shuffle",
        "(default: 0.0 1.0)",
        "('none': None)",
    ]:
        assert expected in " ".join(text.split()), expected
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "slow"])  # not a choice
    with pytest.raises(SystemExit):
        parser.parse_args(["--window", "1"])  # needs two values
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "many"])


def test_a_config_file_is_the_base_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 100\nlr: 1\nmode: exact\ntemperatures: [0.5]\ninner: {rank: 4}\n")
    base = load_config_file(path)
    args = _parser().parse_args(["--lr", "0.25", "--name", "cli"])
    config = dataclass_from_args(Demo, args, base)
    # From the file (lists become tuples, a mapping the nested dataclass, 1 the float 1.0), the flags on top,
    # the dataclass defaults for the rest.
    assert config == Demo(
        steps=100, lr=0.25, name="cli", mode="exact", temperatures=(0.5,), inner=Inner(rank=4)
    )
    assert dataclass_from_dict(Demo, {"steps": 1, "lr": 1}).lr == 1.0 and isinstance(
        dataclass_from_dict(Demo, {"steps": 1, "lr": 1}).lr, float
    )
    (tmp_path / "empty.yaml").write_text("")
    assert load_config_file(tmp_path / "empty.yaml") == {}
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config_file(tmp_path / "list.yaml")


def test_unknown_keys_and_wrong_types_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['step'\] in Demo; valid keys: \[.*'steps'"):
        dataclass_from_dict(Demo, {"step": 3})
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['alpha'\] in Demo.inner; valid keys: \['rank'\]"
    ):
        dataclass_from_dict(Demo, {"steps": 3, "inner": {"alpha": 2}})
    with pytest.raises(TypeError, match=r"Demo.steps: expected int, got '3'"):
        dataclass_from_dict(Demo, {"steps": "3"})
    with pytest.raises(TypeError, match=r"Demo.steps: expected int, got True"):
        dataclass_from_dict(Demo, {"steps": True})
    with pytest.raises(TypeError, match=r"Demo.mode: expected one of \['fast', 'exact'\], got 'slow'"):
        dataclass_from_dict(Demo, {"steps": 3, "mode": "slow"})
    with pytest.raises(TypeError, match=r"Demo.window: expected 2 values"):
        dataclass_from_dict(Demo, {"steps": 3, "window": [1, 2, 3]})
    with pytest.raises(TypeError, match=r"Demo.temperatures\[1\]: expected float, got 'hot'"):
        dataclass_from_dict(Demo, {"steps": 3, "temperatures": [1, "hot"]})
    with pytest.raises(TypeError, match="steps"):
        dataclass_from_dict(Demo, {})  # a required field missing: the dataclass says which
    with pytest.raises(TypeError, match=r"Demo.inner: type .*Inner.* has no command-line form"):
        add_dataclass_arguments(argparse.ArgumentParser(), Demo, exclude=("tags",))
    with pytest.raises(ValueError, match=r"Demo has no field\(s\) \['stepz'\]"):
        add_dataclass_arguments(argparse.ArgumentParser(), Demo, include=("stepz",))


def test_field_docs_read_attribute_docstrings_and_attributes_sections() -> None:
    from streamrl.sft import SFTConfig

    assert field_docs(Demo)["lr"] == "Peak learning rate; 100% of it after warm-up."
    assert field_docs(SFTConfig)["batch_size"].startswith("Sequences per step")

    @dataclass
    class GoogleStyle:
        """Sizes.

        Attributes:
            train: number of training tasks (default 128, the
                SPO++ paper's training set).
            workers: processes.
        """

        train: int = 128
        workers: int | None = None

    assert field_docs(GoogleStyle) == {
        "train": "number of training tasks (default 128, the SPO++ paper's training set).",
        "workers": "processes.",
    }


def test_sft_flags_lay_over_the_env_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.sft import SFTConfig

    options, configs = parse_sft_args(
        ["--envs", "math_tir", "--epochs", "1", "--lr", "0.001", "--eval-episodes", "0"]
    )
    assert options.envs == ("math_tir",) and options.eval_episodes == 0
    assert configs == [SFTConfig.math_tir(epochs=1, lr=0.001)]
    _, configs = parse_sft_args(["--init-from", "none", "--seed", "2"])  # every preset, no curriculum
    assert configs == [SFTConfig.alfworld(init_from=None, seed=2), SFTConfig.math_tir(seed=2)]
    _, configs = parse_sft_args(["--joint", "--envs", "alfworld", "math_tir"])
    assert configs == [SFTConfig(envs=("alfworld", "math_tir"))]
    _, configs = parse_sft_args(["--envs", "math_tir", "--threads", "2"])  # the build's threads: the recipe's
    assert configs == [SFTConfig.math_tir(threads=2)] and configs[0].key() != SFTConfig.math_tir().key()
    with pytest.raises(SystemExit):
        parse_sft_args(["--envs", "minecraft"])
    assert "unknown env 'minecraft'; valid: ['alfworld', 'math_tir']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_sft_args(["--envs", "math_tir", "--select-best-of", "-1"])
    assert "select_best_of must be >= 0, got -1" in capsys.readouterr().err


def test_sft_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sft", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: streamrl sft")
    for expected in [
        "--context-weight CONTEXT_WEIGHT Weight of a language-modelling loss on the context tokens",
        "(default: 0.0, unless the env's preset sets it)",
        "--eval-episodes EVAL_EPISODES Episodes per split",
        "--joint, --no-joint",
        "--init-from INIT_FROM An env name",
    ]:
        assert expected in text, expected
    assert "--lora" not in text and "--downsample" not in text


DEMO_SMALL = (
    "--init base --updates 2 --batch 4 --num-envs 4 --tasks 4 --offline-rollouts 1 --eval-every 1 "
    "--eval-episodes 6 --max-new-tokens 16 --threads 1 --no-progress"
).split()


def test_demo_trains_evaluates_paired_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's whole pipeline at a smoke size (the untrained model instead of the SFT checkpoint): a run,
    a paired start-vs-end evaluation, the report; run again, it resumes the finished run and only re-reports."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *DEMO_SMALL]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "demo.json").read_text())
    assert summary["start"]["update"] == 0 and summary["end"]["update"] == 2
    # the ends play 4 x 6 episodes (the default final_eval_factor), the curve the first 6 at every update
    assert (
        summary["start"]["episodes"] == summary["paired_gain"]["n"] == 24 and summary["curve_episodes"] == 6
    )
    assert [u for u, _, _ in summary["held_out_curve"]] == [0, 1, 2]
    assert summary["paired_gain"]["mean"] == pytest.approx(
        summary["end"]["success"] - summary["start"]["success"]
    )
    # the 24 held-out episodes are 24 distinct tasks: clustered by task, the interval is the episodes' one
    gain, by_episode = summary["paired_gain"], summary["paired_gain_episode"]
    assert (gain["tasks"], summary["start"]["tasks"], by_episode["n"]) == (24, 24, 24)
    assert (gain["ci_low"], gain["ci_high"]) == pytest.approx((by_episode["ci_low"], by_episode["ci_high"]))
    assert "paired gain on the same 24 episodes of 24 tasks" in printed
    report = (out / "report.md").read_text()
    assert "![learning curves](demo.png)" in report and (out / "demo.png").stat().st_size > 10_000
    metrics = (out / "metrics.jsonl").read_text()
    assert main(["demo", "--out", str(out), *DEMO_SMALL]) == 0
    assert (out / "metrics.jsonl").read_text() == metrics  # finished: nothing trained again
    # `streamrl eval` and `streamrl compare` take the demo's run as it is
    small_eval = ["--tasks", "2", "--samples", "1", "--temperatures", "1", "--max-new-tokens", "8"]
    small_eval += ["--num-envs", "2", "--env-workers", "inprocess", "--no-progress"]
    assert (
        main(["eval", f"run:{out}", "--vs", f"run:{out}@0", "--out", str(tmp_path / "e.json"), *small_eval])
        == 0
    )
    paired = json.loads((tmp_path / "e.json").read_text())["paired"][0]
    assert (paired["n"], paired["tasks"], paired["episode"]["n"]) == (2, 2, 2)
    assert main(["compare", str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "report.md").is_file()
    with pytest.raises(SystemExit):
        main(["demo", "--updates", "0"])
    assert "updates must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fly"])
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_the_demo_starts_from_a_shipped_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both of the demo's starts (its own early-stopped recipe, default, and Math-TIR's preset) resolve to checkpoints
    shipped in the repository: a fresh machine copies them instead of training for minutes to an hour."""
    from streamrl.algorithms.train import initial_model_dir
    from streamrl.cli.demo import DemoConfig
    from streamrl.cli.main import parse_train_args
    from streamrl.sft import build as sft

    monkeypatch.setattr(sft, "cache_root", lambda: tmp_path)  # an empty SFT cache (the base model's is kept)

    starts = []
    for cold_start in ("demo", "preset"):
        config = DemoConfig(cold_start=cold_start).train_config()
        path = initial_model_dir(config.model, config.init, config.env, sft=config.sft)
        assert "the shipped copy" in capsys.readouterr().out
        assert (sft.SHIPPED / path.name).is_dir() and path.parent == tmp_path / "sft"
        starts.append(path.name)
    assert starts[0] != starts[1]
    assert DemoConfig(init="base").train_config().sft == {}
    # extra training tasks reach the env; none keeps the env_kwargs (and the offline values' cache key) as before
    assert DemoConfig(extra_tasks=500).train_config().env_kwargs == {"extra_train": 500}
    assert DemoConfig().train_config().env_kwargs == {}
    with pytest.raises(ValueError, match=r"extra_tasks must be >= 0.*got -3"):
        DemoConfig(extra_tasks=-3)
    # `streamrl train` reaches the demo's start with the config file docs/training.md shows
    yaml = tmp_path / "run.yaml"
    yaml.write_text("init: sft\nsft: {stop_above: 0.25, restart_below: 0.25}\n")
    _, config = parse_train_args(["--config", str(yaml), "--out", str(tmp_path / "run")])
    assert initial_model_dir(config.model, config.init, config.env, sft=config.sft).name == starts[0]


def test_train_starts_from_the_envs_preset_below_the_config_file_and_flags(tmp_path: Path) -> None:
    """`streamrl train --env alfworld` is ALFWorld's preset (TRAIN_PRESETS); a config file and flags override it
    field by field (learner fields too); Math-TIR, without a preset, keeps the field defaults; a resumed run
    keeps its saved config."""
    from streamrl.algorithms.train_config import TRAIN_PRESETS, TrainConfig
    from streamrl.cli.main import parse_train_args

    preset = TRAIN_PRESETS["alfworld"]
    out = str(tmp_path / "run")
    _, config = parse_train_args(["--env", "alfworld", "--out", out])
    assert config == TrainConfig.for_env("alfworld", out=out)
    assert config.constrain_actions and config.avoid_repeats and config.eval_split == "validation"
    assert (config.batch, config.learner.lr, config.learner.mini_batches) == (
        preset["batch"],
        preset["learner"]["lr"],
        preset["learner"]["mini_batches"],
    )
    yaml = tmp_path / "run.yaml"
    yaml.write_text("env: alfworld\nbatch: 32\nlearner: {lr: 0.002}\n")
    _, config = parse_train_args(
        ["--config", str(yaml), "--out", out, "--updates", "5", "--mini-batches", "4"]
    )
    assert (config.batch, config.updates, config.learner.lr, config.learner.mini_batches) == (32, 5, 0.002, 4)
    assert config.constrain_actions and config.num_envs == preset["num_envs"]
    _, config = parse_train_args(["--out", out])
    assert config == TrainConfig(out=out)  # math_tir: no preset
    saved = TrainConfig.for_env("alfworld", out=out, batch=8, constrain_actions=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved.to_dict()))
    _, config = parse_train_args(["--resume", out])
    assert config == saved


def test_paired_gain_is_the_mean_of_per_episode_differences_clustered_by_task() -> None:
    from streamrl.evaluation.compare import paired_gain, paired_gain_by_episode

    start = [{"key": k, "task_id": f"t{k % 2}", "won": w} for k, w in enumerate([0, 0, 1, 1])]
    end = [{"key": k, "task_id": f"t{k % 2}", "won": w} for k, w in enumerate([1, 1, 1, 0])]
    gain = paired_gain(start, end)
    # differences 1, 1, 0, -1; task t0 (keys 0, 2): 1, 0, mean .5; t1 (keys 1, 3): 1, -1, mean 0.
    # By task: mean .25, s.d. of (.5, 0) = .353553, se = .25, t_{.975,1} = 12.706205: half-width 3.176551
    assert (gain.mean, gain.n, gain.tasks) == (pytest.approx(0.25), 4, 2)
    assert gain.half_width == pytest.approx(12.706205 * 0.25, rel=1e-6)
    # by episode: s.d. sqrt(((.75)^2*2 + .25^2 + 1.25^2)/3) = .9574; t_{.975,3} = 3.1824
    episodes = paired_gain_by_episode(start, end)
    assert episodes.mean == pytest.approx(0.25)
    assert episodes.half_width == pytest.approx(3.182446 * 0.957427 / 2, rel=1e-5)
    with pytest.raises(ValueError, match="same episodes"):
        paired_gain(start, [{**r, "task_id": "other"} for r in end])


@pytest.mark.alfworld
def test_alfworld_generate_into_the_given_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("textworld", reason="needs the alfworld extra: pip install -e .[alfworld]")
    from streamrl.envs import alfworld_gen as gen

    argv = ["alfworld-generate", "--split", "eval_unseen", "--eval-unseen", "2", "--cache-dir", str(tmp_path)]
    assert main([*argv, "--workers", "1"]) == 0
    games = sorted((tmp_path / f"gen-v{gen.GENERATOR_VERSION}" / "eval_unseen").glob("*/game.tw-pddl"))
    assert len(games) == 2 and "eval_unseen: 2 games" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["alfworld-generate", "--split", "valid"])
    assert (
        "unknown split(s) ['valid']; valid: ['train', 'eval_seen', 'eval_unseen', 'validation']"
        in capsys.readouterr().err
    )


@pytest.mark.slow
def test_sft_command_builds_evaluates_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The checkpoint of tests/sft/test_algo_sft.py::test_sft_improves_over_untrained_model (same config, so the
    # same cache key: built once per cache), then 2 greedy episodes per split.
    import json

    from streamrl.sft import SFTConfig

    out = tmp_path / "report.json"
    recipe = ["--max-expert-episodes", "16", "--synthetic-episodes", "0", "--epochs", "30", "--lr", "0.005"]
    argv = ["sft", "--joint", "--envs", "math_tir", *recipe, "--eval-episodes", "2", "--temperature", "0"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    (entry,) = report["checkpoints"]
    config = SFTConfig(envs=("math_tir",), max_expert_episodes=16, synthetic_episodes=0, epochs=30, lr=5e-3)
    assert entry["checkpoint"].endswith(config.key()) and entry["sft"]["data"]["math_tir"]["episodes"] == 16
    assert [(e["split"], e["temperature"], e["episodes"]) for e in entry["eval"]] == [
        ("train", 0.0, 2),
        ("test", 0.0, 2),
    ]
