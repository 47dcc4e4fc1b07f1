"""The ``streamrl`` command line: one program, one subcommand for each thing a user runs.

streamrl demo                  the main job: SFT cold start -> offline values -> SPO++ -> paired held-out eval -> report
streamrl train                 train a policy with SPO, SPO++, GRPO, SAO or your own algorithm
streamrl eval                  evaluate an agent (a run's policy, a model, an SFT checkpoint, the expert); paired
streamrl compare               compare training runs: SPO++ Table 1 metrics, learning curves, diagnostics, report
streamrl sft                   behaviour-clone a model on expert trajectories (SFT cold start), then evaluate it
streamrl value-pretrain        fit SAO's critic on rollouts of the initial policy (``--critic-init`` of a run)
streamrl alfworld-generate     generate the offline ALFWorld game splits into the cache
streamrl average               the mean of a run's published policies' weights, as a policy of its own

Every subcommand's flags are derived from documented config dataclasses (``streamrl.cli.args``):
the options below, and for ``sft`` the training recipe ``SFTConfig`` itself, so a flag's type, choices, help and
default are written once, next to the field. ``streamrl <subcommand> --help`` lists them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from streamrl.algorithms.run_dir import RunDir
from streamrl.cli.args import (
    add_dataclass_arguments,
    dataclass_from_args,
    dataclass_from_dict,
    field_docs,
    given_arguments,
)

if TYPE_CHECKING:  # imported when the subcommand runs: it needs torch
    from streamrl.sft import SFTConfig

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------------
# streamrl demo


def _demo(argv: Sequence[str]) -> int:
    from streamrl.cli.demo import DemoConfig, run_demo

    parser = _parser("demo", DemoConfig.__doc__)
    add_dataclass_arguments(parser, DemoConfig)
    run_demo(_build(parser, DemoConfig, parser.parse_args(argv)))
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl sft


@dataclass(frozen=True)
class SFTRunOptions:
    """``streamrl sft``: which SFT checkpoints to build (each cached, ``sft_checkpoint``) and how to evaluate
    them; prints a JSON report (checkpoint, its training report, greedy and sampled success rates per split)."""

    envs: tuple[str, ...] = ()
    """Envs to train: one checkpoint each, with the env's preset (``SFT_PRESETS``: alfworld, math_tir) and the
    recipe flags below laid over it, unless ``joint``. Empty: every env with a preset."""
    joint: bool = False
    """One checkpoint trained on all ``envs`` together, from the ``SFTConfig`` defaults and the recipe flags
    (no preset)."""
    eval_episodes: int = 64
    """Episodes per split in the evaluation after training (the train split and each eval split); 0 skips it."""
    baseline: bool = False
    """Also evaluate the untrained model."""
    temperature: tuple[float, ...] = (0.0, 1.0)
    """Evaluation sampling temperature(s); 0 is greedy."""
    eval_batch: int = 32
    """Episodes played concurrently in evaluation (one batched generation per turn)."""
    out: Path | None = None
    """Also write the JSON report to this file."""
    shipped: bool = True
    """Use a checkpoint shipped with streamrl (``checkpoints/``, package data) when one has the recipe's key,
    after checking its sha256; ``--no-shipped`` builds it (into an empty ``STREAMRL_CACHE``: the bit-for-bit rebuild)."""
    native_kernels: bool = False
    """Build with this CPU's own kernels (AVX-512 where it has them) in this process instead of the reproducible
    build's fresh interpreter on the AVX2 kernel path every x86-64 CPU shares: the weights then differ from a
    build on another CPU model (``sft_checkpoint(reproducible=False)``)."""

    def __post_init__(self) -> None:
        if self.eval_episodes < 0 or self.eval_batch < 1:
            raise ValueError(
                f"eval_episodes must be >= 0 and eval_batch >= 1; got {self.eval_episodes}, {self.eval_batch}"
            )


_SFT_NO_FLAG = ("envs", "lora", "downsample")
"""``SFTConfig`` fields without a ``streamrl sft`` flag: ``envs`` is ``SFTRunOptions.envs``; a LoRA config
and downsampling rules are structured values, set in Python (or a preset)."""


def parse_sft_args(argv: Sequence[str]) -> tuple[SFTRunOptions, list[SFTConfig]]:
    """``streamrl sft``'s options and the ``SFTConfig`` of each checkpoint to build: the env's preset with
    the recipe flags laid over it (or, with ``--joint``, one config from the defaults and the flags)."""
    from streamrl.sft import SFT_PRESETS, SFTConfig

    parser = _parser("sft", SFTRunOptions.__doc__)
    add_dataclass_arguments(parser.add_argument_group("run"), SFTRunOptions)
    add_dataclass_arguments(
        parser.add_argument_group("recipe (SFTConfig fields; default: the env's preset)"),
        SFTConfig,
        exclude=_SFT_NO_FLAG,
        default_help="default: {default}, unless the env's preset sets it",
    )
    args = parser.parse_args(list(argv))
    options = _build(parser, SFTRunOptions, args)
    overrides = given_arguments(SFTConfig, args)
    envs = options.envs or tuple(sorted(SFT_PRESETS))
    try:
        if options.joint:
            return options, [SFTConfig(envs=envs, **overrides)]
        return options, [SFTConfig.for_env(name, **overrides) for name in envs]
    except (TypeError, ValueError) as error:
        parser.error(str(error))


def _sft(argv: Sequence[str]) -> int:
    import torch
    from streamrl.agents.base import SamplingParams
    from streamrl.agents.env_specs import env_spec
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.models import resolve_model
    from streamrl.evaluation.harness import evaluate
    from streamrl.sft import sft_checkpoint

    options, configs = parse_sft_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report: dict[str, Any] = {"checkpoints": []}
    for config in configs:
        started = time.perf_counter()
        path = sft_checkpoint(config, log, shipped=options.shipped, reproducible=not options.native_kernels)
        entry: dict[str, Any] = {
            "checkpoint": str(path),
            "sft": json.loads((path / "streamrl_sft.json").read_text()),
            "checkpoint_s": round(time.perf_counter() - started, 1),
            "eval": [],
        }
        report["checkpoints"].append(entry)
        if not options.eval_episodes:
            continue
        torch.set_num_threads(config.threads)  # the recipe's --threads (its build pins them itself)
        models = [("sft", str(path))] + (
            [("untrained", str(resolve_model(config.model)))] if options.baseline else []
        )
        for label, model_dir in models:
            backend = HFBackend(model_dir, config=HFBackendConfig(device="cpu"))
            for name in config.envs:
                spec = env_spec(name)
                for temperature in options.temperature:
                    for split in (spec.train_split, *spec.eval_splits):
                        sampling = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=temperature)
                        result = evaluate(
                            backend, name, split, options.eval_episodes, sampling, options.eval_batch
                        )
                        result["model"] = label
                        result["temperature"] = temperature
                        log(json.dumps(result))
                        entry["eval"].append(result)
    text = json.dumps(report, indent=2)
    print(text)
    if options.out is not None:
        options.out.write_text(text)
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl alfworld-generate


@dataclass(frozen=True)
class ALFWorldGenerateOptions:
    """``streamrl alfworld-generate``: generate the offline ALFWorld game splits into the streamrl cache (on
    the real TextWorld engine, each game with a walkthrough verified to win)."""

    split: tuple[str, ...] = ()
    """Splits to generate (train, eval_seen, eval_unseen, validation); empty: all four."""


def _alfworld_generate(argv: Sequence[str]) -> int:
    from streamrl.envs.alfworld_gen import SPLITS, GenerationConfig, ensure_split

    parser = _parser("alfworld-generate", ALFWorldGenerateOptions.__doc__)
    add_dataclass_arguments(parser, ALFWorldGenerateOptions)
    add_dataclass_arguments(
        parser.add_argument_group("split sizes and cache (GenerationConfig)"), GenerationConfig
    )
    args = parser.parse_args(argv)
    options = _build(parser, ALFWorldGenerateOptions, args)
    config = _build(parser, GenerationConfig, args)
    unknown = [s for s in options.split if s not in SPLITS]
    if unknown:
        parser.error(f"unknown split(s) {unknown}; valid: {list(SPLITS)}")
    for split in options.split or SPLITS:
        paths = ensure_split(split, config, progress=True)
        print(f"{split}: {len(paths)} games in {paths[0].parent.parent if paths else config.root() / split}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl train


@dataclass(frozen=True)
class TrainRunOptions:
    """``streamrl train``: train a policy with SPO, SPO++, GRPO, SAO or your own algorithm on the
    single-stream runtime; writes the run directory (config, metrics.jsonl, TensorBoard, policies, checkpoints)."""

    config: Path | None = None
    """A YAML file of TrainConfig fields (with ``learner:`` and ``algorithm:`` sections); flags override it."""
    resume: Path | None = None
    """Continue the run in this directory from its last checkpoint (its saved config; flags must agree)."""
    progress: bool = True
    """Show a progress bar (``--no-progress`` for logs)."""


_TRAIN_NO_FLAG = ("learner", "algorithm", "env_kwargs", "sft")


def parse_train_args(argv: Sequence[str]) -> tuple[TrainRunOptions, Any]:
    """``streamrl train``'s options and the ``TrainConfig``: defaults < the env's preset (``TRAIN_PRESETS``) <
    ``--config`` YAML < flags; a resumed run: its saved config < flags. The algorithm's own fields (those of
    ``--algo``'s config class) are flags too."""
    from streamrl.algorithms.base import algorithm_class
    from streamrl.algorithms.learner import LearnerConfig
    from streamrl.algorithms.train import TrainConfig
    from streamrl.algorithms.train_config import preset_values
    from streamrl.cli.args import load_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--algo", default=None)
    pre.add_argument("--config", type=Path, default=None)
    pre.add_argument("--resume", type=Path, default=None)
    known, _ = pre.parse_known_args(list(argv))
    base: dict[str, Any] = {}
    if known.resume is not None:
        saved = RunDir(known.resume)
        if not saved.is_run():
            raise SystemExit(f"streamrl train: --resume {known.resume}: no run there (no config.json)")
        base = saved.read_config()
    elif known.config is not None:
        base = load_config_file(known.config)
    algo = known.algo or base.get("algo") or TrainConfig.algo
    try:
        algo_cls = algorithm_class(algo)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"streamrl train: {error}") from None

    parser = _parser("train", TrainRunOptions.__doc__)
    add_dataclass_arguments(parser.add_argument_group("run"), TrainRunOptions)
    preset_help = "default: {default}, unless the env's preset (TRAIN_PRESETS) sets it"
    add_dataclass_arguments(
        parser.add_argument_group("training (TrainConfig)"),
        TrainConfig,
        exclude=_TRAIN_NO_FLAG,
        default_help=preset_help,
    )
    add_dataclass_arguments(
        parser.add_argument_group("learner (LearnerConfig)"),
        LearnerConfig,
        exclude=("lora_target_modules",),
        default_help=preset_help,
    )
    add_dataclass_arguments(
        parser.add_argument_group(f"algorithm ({algo_cls.config_class.__name__} of --algo {algo})"),
        algo_cls.config_class,
        default_help="default: {default}, unless the env's preset sets it",
    )
    args = parser.parse_args(list(argv))
    options = _build(parser, TrainRunOptions, args)
    try:
        values = dict(base)
        values.update(given_arguments(TrainConfig, args))
        # a new run starts from its env's preset; a resumed run's saved config is whole
        if known.resume is None:
            values = preset_values(values.get("env", TrainConfig.env), values)
        learner = dict(values.get("learner") or {})
        learner.update(given_arguments(LearnerConfig, args))
        values["learner"] = dataclass_from_dict(LearnerConfig, learner, "learner")
        algorithm = dict(values.get("algorithm") or {})
        algorithm.update(given_arguments(algo_cls.config_class, args))
        values["algorithm"] = algorithm
        if options.resume is not None:
            values["out"] = str(options.resume)
        config = TrainConfig.from_dict(values)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    return options, config


def _train(argv: Sequence[str]) -> int:
    from streamrl.algorithms.train import ConfigError, train

    options, config = parse_train_args(argv)
    try:
        summary = train(config, resume=options.resume is not None, progress=options.progress)
    except ConfigError as error:
        print(f"streamrl train: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl value-pretrain


SAO_CRITIC_FIELDS = (
    "gamma",
    "critic_lr",
    "critic_weight_decay",
    "critic_max_grad_norm",
    "critic_lora_rank",
    "critic_lora_alpha",
    "critic_lora_targets",
    "critic_init",
)
"""``SAOConfig`` fields that ``streamrl value-pretrain`` takes as flags: the critic's shape and optimizer,
the returns' discount, and a critic to continue from."""


def parse_value_pretrain_args(argv: Sequence[str]) -> tuple[Any, Any]:
    """``streamrl value-pretrain``'s ``ValuePretrainConfig`` and the ``SAOConfig`` whose ``critic_*`` fields
    (and ``gamma``) shape the critic: the env's SAO preset with the flags laid over it."""
    from streamrl.algorithms.sao import SAOConfig
    from streamrl.algorithms.value_pretrain import ValuePretrainConfig

    parser = _parser("value-pretrain", ValuePretrainConfig.__doc__)
    add_dataclass_arguments(parser.add_argument_group("run (ValuePretrainConfig)"), ValuePretrainConfig)
    add_dataclass_arguments(
        parser.add_argument_group("critic (SAOConfig fields; an SAO run loading it must agree)"),
        SAOConfig,
        include=SAO_CRITIC_FIELDS,
    )
    args = parser.parse_args(list(argv))
    config = _build(parser, ValuePretrainConfig, args)
    try:
        sao = getattr(SAOConfig, config.env)(**given_arguments(SAOConfig, args))
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    return config, sao


def _value_pretrain(argv: Sequence[str]) -> int:
    from streamrl.algorithms.value_pretrain import pretrain_critic

    config, sao = parse_value_pretrain_args(argv)
    try:
        report = pretrain_critic(config, sao, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as error:
        print(f"streamrl value-pretrain: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl eval


def parse_eval_args(argv: Sequence[str]) -> Any:
    """``streamrl eval AGENT [--vs AGENT] [flags]``: the ``EvalConfig`` (the agent is positional)."""
    from streamrl.evaluation.harness import EvalConfig

    parser = _parser("eval", EvalConfig.__doc__)
    parser.add_argument("agent", help=field_docs(EvalConfig)["agent"].replace("%", "%%"))
    add_dataclass_arguments(parser, EvalConfig, exclude=("agent", "env_kwargs"))
    args = parser.parse_args(list(argv))
    try:
        return dataclass_from_dict(EvalConfig, {"agent": args.agent, **given_arguments(EvalConfig, args)})
    except (TypeError, ValueError) as error:
        parser.error(str(error))


def _eval(argv: Sequence[str]) -> int:
    from streamrl.evaluation.harness import format_report, run_evaluation

    config = parse_eval_args(argv)
    try:
        report = run_evaluation(config)
    except (ValueError, FileNotFoundError) as error:
        print(f"streamrl eval: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    if config.out is not None:
        print(f"report (with every episode): {config.out}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl compare


def parse_compare_args(argv: Sequence[str]) -> Any:
    """``streamrl compare RUN... [--vs RUN...] --out DIR``: the ``CompareConfig`` (the runs are positional)."""
    from streamrl.evaluation.compare import CompareConfig

    parser = _parser("compare", CompareConfig.__doc__)
    parser.add_argument(
        "runs", nargs="+", type=Path, help=field_docs(CompareConfig)["runs"].replace("%", "%%")
    )
    add_dataclass_arguments(parser, CompareConfig, exclude=("runs",))
    args = parser.parse_args(list(argv))
    try:
        return dataclass_from_dict(
            CompareConfig, {"runs": tuple(args.runs), **given_arguments(CompareConfig, args)}
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))


def _compare(argv: Sequence[str]) -> int:
    from streamrl.evaluation.compare import compare

    config = parse_compare_args(argv)
    try:
        result = compare(config)
    except (ValueError, FileNotFoundError) as error:
        print(f"streamrl compare: {error}", file=sys.stderr)
        return 2
    print(result["markdown"])
    print(f"report: {result['report']}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# streamrl average


@dataclass(frozen=True)
class AverageOptions:
    """``streamrl average``: write the uniform mean of a run's published policies (full weights) as a policy
    directory, evaluated like any other (``streamrl eval sft@OUT``)."""

    run: Path | None = None
    """The run directory whose published versions (``policy/v<K>``) are averaged."""
    last: int = 0
    """Average the run's last K published versions on disk (the run keeps ``keep_versions`` of them)."""
    versions: str = ""
    """Or these versions: a range ``A-B`` (both included) or a list ``A,B,C``."""
    out: Path | None = None
    """Where to write the averaged policy; default ``RUN/policy/avg<first>-<last>``."""


def _average(argv: Sequence[str]) -> int:
    from streamrl.algorithms.averaging import average_policies, select_versions

    parser = _parser("average", AverageOptions.__doc__)
    add_dataclass_arguments(parser, AverageOptions)
    options = _build(parser, AverageOptions, parser.parse_args(argv))
    if options.run is None:
        parser.error("--run is required: the run directory whose policies to average")
    run = RunDir(options.run)
    try:
        chosen = select_versions(run.policy_versions(), last=options.last, versions=options.versions)
        out = options.out or run.policies / f"avg{chosen[0]}-{chosen[-1]}"
        average_policies(options.run, chosen, out)
    except (ValueError, FileNotFoundError) as error:
        print(f"streamrl average: {error}", file=sys.stderr)
        return 2
    print(f"the mean of versions {chosen} of {options.run}: {out}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# Dispatch


def _parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of one subcommand; its description is the options class's docstring after the colon."""
    description = " ".join((doc or "").split(":", 1)[-1].split())
    return argparse.ArgumentParser(
        prog=f"streamrl {command}", description=description[:1].upper() + description[1:]
    )


def _build(parser: argparse.ArgumentParser, cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` from the parsed flags; an invalid value exits with the usage and the dataclass's message."""
    try:
        return dataclass_from_args(cls, args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))


COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "demo": ("train SPO++ from the cold start, evaluate it paired with the start, write a report", _demo),
    "train": ("train a policy (SPO, SPO++, GRPO, SAO or your own) on the single-stream runtime", _train),
    "eval": (
        "evaluate an agent on an env's splits (success with intervals, pass@k, breakdowns, paired)",
        _eval,
    ),
    "compare": (
        "compare training runs: learning-curve metrics (SPO++ Table 1), plots and a report",
        _compare,
    ),
    "sft": ("behaviour-clone a model on expert trajectories (SFT cold start), then evaluate it", _sft),
    "value-pretrain": (
        "fit SAO's critic on rollouts of the initial policy (SAOConfig.critic_init)",
        _value_pretrain,
    ),
    "alfworld-generate": ("generate the offline ALFWorld game splits into the cache", _alfworld_generate),
    "average": ("average a run's published policies (weight averaging over its last versions)", _average),
}
"""Subcommand -> (one-line help, ``run(argv) -> exit status``). Each subcommand builds its own parser, so
its imports (torch, the ALFWorld engine) happen only when it runs."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``streamrl <subcommand> [flags]``; the flags are the subcommand's."""
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="subcommand")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=f"{help_text} (streamrl {name} --help)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``streamrl <subcommand> ...`` (``argv`` defaults to ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        _, run = COMMANDS[argv[0]]
        return run(argv[1:])
    build_parser().parse_args(argv)  # --help, or an error naming the valid subcommands
    return 2


if __name__ == "__main__":
    sys.exit(main())
