"""The SFT cold start per env and seed: build (or reuse) the committed recipe's checkpoint, evaluate it, record
its sha256 and times (issue 14's targets).

For each env (``math_tir`` first: ALFWorld's recipe starts from Math-TIR's seed-0 checkpoint) and each seed, the
checkpoint of ``SFTConfig.for_env(env, seed=seed)`` is built under ``$STREAMRL_CACHE/sft`` (or found there), then
played:

- Math-TIR: the ``test`` split (its 50 tasks of the SFT families), greedy and sampled at temperature 1;
- ALFWorld: ``eval_seen`` and ``eval_unseen`` (the env's 50-step limit), sampled at temperature 1 and greedy,
  and per episode whether it ended looping on one invalid command (its last ``--loop-min`` actions the same
  command, judged invalid by the env) or stuck (its last ``--loop-min`` actions two commands or fewer, valid or
  not). ``--constrain-actions`` plays every env that lists its actions with ``LLMAgent(constrain_actions=True)``
  (ALFWorld: every action one of the admissible commands, so no invalid loop is possible and the stuck count
  says what is left of greedy play's loops); Math-TIR, whose actions are free text with code, is played as
  always.

Sampled play is seeded (``--eval-seed``, one or several: each plays every sampled run, and a checkpoint's
sampled rate is their mean), so a checkpoint's rates are reproducible too; ``--modes`` plays only greedy or
only sampled. Evaluation runs on
``--eval-threads`` torch threads; each build pins its own (``SFTConfig.threads``). The JSON records, per
checkpoint, the sha256 of its weights (from ``streamrl_sft.json``, checked against the file), of the weights it
started from and of its training data, the build's wall time (``cached`` when it was found built) and the
platform facts that change the floats (docs/sft.md, Reproducibility). ``--compare`` an earlier result file to
check that the same recipes rebuilt the same weights.

    python benchmarks/bench_cold_start.py                       # 3 seeds x 2 envs -> results/cold_start/cold_start.json
    STREAMRL_CACHE=$(mktemp -d) python benchmarks/bench_cold_start.py --compare benchmarks/results/cold_start/cold_start.json

Seeds can be built in parallel processes, each with its own ``--seeds`` and ``--output``; ``--merge`` then
summarizes their checkpoints in one file, building and playing nothing::

    python benchmarks/bench_cold_start.py --envs alfworld --seeds 0 --output /tmp/s0.json &   # and so on
    python benchmarks/bench_cold_start.py --merge /tmp/s0.json /tmp/s1.json /tmp/s2.json --output ...

``--set KEY=VALUE`` overrides a recipe field for every env (JSON values; ``none`` for ``None``): for smoke runs of
this script, never for the reported numbers.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "cold_start"
TARGETS = {"math_tir": {"greedy": 0.30, "sampled": 0.20}, "alfworld": {"sampled": 0.20}}
"""Issue 14's bars, per seed: Math-TIR test success greedy / sampled; ALFWorld sampled success on each eval split
(and greedy play that does not loop on one invalid command)."""


class _Recorder:
    """An ``Agent`` that passes everything to ``agent`` and keeps the ``Trajectory`` of every ended episode."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.records: list[Any] = []

    def act(
        self, observations: Sequence[str], infos: Sequence[Mapping[str, Any]], episode_ids: Sequence[Any]
    ) -> list[str]:
        return list(self.agent.act(observations, infos, episode_ids))

    def end_episode(self, episode_id: Any) -> Any:
        record = self.agent.end_episode(episode_id)
        self.records.append(record)
        return record


def invalid_loop(actions: Sequence[str], valid: Sequence[bool | None], loop_min: int) -> str | None:
    """The command an episode ended looping on: its last ``loop_min`` actions are that one command and the env
    judged it invalid at least once among them (the last turn's verdict may be unknown); else ``None``."""
    if len(actions) < loop_min or len(set(actions[-loop_min:])) != 1:
        return None
    return actions[-1] if any(v is False for v in valid[-loop_min:]) else None


def cycle(actions: Sequence[str], won: bool, loop_min: int) -> tuple[str, ...] | None:
    """The commands a lost episode ended cycling through: its last ``loop_min`` actions take at most two
    distinct commands (one repeated, or two in turn: "go to A", "go to B", "go to A", ...), valid or not;
    else ``None``. Greedy play that cannot loop on an invalid command (constrained) can still get stuck so."""
    tail = actions[-loop_min:]
    if won or len(tail) < loop_min or len(set(tail)) > 2:
        return None
    return tuple(sorted(set(tail)))


def play(
    backend: Any,
    env: str,
    split: str,
    episodes: int,
    temperature: float,
    args: argparse.Namespace,
    env_kwargs: Mapping[str, Any] | None = None,
    eval_seed: int | None = None,
) -> dict[str, Any]:
    """Success of ``backend``'s ``LLMAgent`` on the first ``episodes`` tasks of ``split`` (``env_kwargs``, e.g.
    ``game_files=``, go to every env), with loop counts (``--constrain-actions``: among the env's actions where
    it lists them). Sampled play is seeded with ``eval_seed``."""
    from streamrl.agents.base import SamplingParams
    from streamrl.agents.env_specs import env_spec, play_tasks

    spec = env_spec(env)
    seed = None if temperature == 0 else eval_seed
    sampling = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=temperature, seed=seed)
    constrain = args.constrain_actions and spec.lists_actions
    avoid = constrain and args.avoid_repeats
    agent = _Recorder(spec.llm_agent(backend, sampling, constrain_actions=constrain, avoid_repeats=avoid))
    played = play_tasks(agent, env, split, episodes, args.eval_batch, env_kwargs)
    loops = [
        invalid_loop([t.action for t in r.turns], [t.action_valid for t in r.turns], args.loop_min)
        for r in agent.records
    ]
    looped = [c for c in loops if c is not None]
    cycles = [cycle([t.action for t in r.turns], r.won, args.loop_min) for r in agent.records]
    stuck = [" | ".join(c) for c in cycles if c is not None]
    counts = dataclasses.asdict(played)  # episodes, wins, steps, valid_steps, seconds
    counts["seconds"] = round(counts["seconds"], 1)
    return {
        "split": split,
        "temperature": temperature,
        "eval_seed": seed,
        "constrain_actions": constrain,
        "avoid_repeats": avoid,
        "success_rate": played.success_rate,
        "valid_action_rate": played.valid_steps / max(1, played.steps),
        "invalid_loops": len(looped),
        "looped_commands": collections.Counter(looped).most_common(5),
        "stuck_cycles": len(stuck),
        "stuck_commands": collections.Counter(stuck).most_common(5),
        **counts,
        "won_tasks": sorted(r.task_id for r in agent.records if r.won),  # for paired comparisons
    }


def _value(text: str) -> Any:
    if text.lower() == "none":
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return text

    def tuples(v: Any) -> Any:  # SFTConfig's structured fields are tuples
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    return tuples(value)


def parse_overrides(parser: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` items as recipe overrides (JSON values, ``none`` for ``None``)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        overrides[key] = _value(value)
    return overrides


def _platform() -> dict[str, Any]:
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        # the kernel level torch uses, and what the CPU has (they differ under ATEN_CPU_CAPABILITY)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_vector_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}),
        "env": {
            k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "STREAMRL_CACHE") if k in os.environ
        },
    }


def checkpoint_entry(
    env: str, seed: int, overrides: Mapping[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Build (or find) and evaluate the checkpoint of ``env``'s recipe with ``seed``."""
    import torch
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.sft import SFTConfig, sft_checkpoint, weights_sha256

    config = SFTConfig.for_env(env, seed=seed, **overrides)
    started = time.perf_counter()
    cached = any(p.name.endswith(f"-sft-{config.key()}") for p in _sft_dirs())
    path = sft_checkpoint(
        config, log=lambda m: print(f"  [{env} seed {seed}] {m}", file=sys.stderr, flush=True)
    )
    build_s = round(time.perf_counter() - started, 1)
    report = json.loads((path / "streamrl_sft.json").read_text())
    entry: dict[str, Any] = {
        "env": env,
        "seed": seed,
        "key": config.key(),
        "checkpoint": str(path),
        "cached": cached,
        "build_s": build_s,
        "collect_s": sum(d["collect_s"] for d in report["data"].values()),
        "train_s": report["train_s"],
        # a recipe with restarts: every training run tried (the kept one's times are collect_s and train_s)
        "restarts": report.get("restarts"),
        "data": report["data"],
        "weights_sha256": report.get("weights_sha256"),
        "sha256_verified": report.get("weights_sha256") == weights_sha256(path),
        "start_weights_sha256": report.get("start_weights_sha256"),
        "base_weights_sha256": report.get("base_weights_sha256"),
        "data_sha256": report.get("data_sha256"),
        "build_platform": report.get("platform"),
        "eval": [],
    }
    torch.set_num_threads(args.eval_threads)
    backend = HFBackend(str(path), config=HFBackendConfig(device="cpu"))
    try:
        if env == "math_tir":
            runs = [("test", args.math_episodes, t) for t in (0.0, 1.0)]
        else:
            runs = [(s, args.alfworld_episodes, t) for t in (1.0, 0.0) for s in ("eval_seen", "eval_unseen")]
        wanted = {{"greedy": 0.0, "sampled": 1.0}[m] for m in args.modes}
        runs = [
            (split, episodes, temperature, eval_seed)
            for split, episodes, temperature in runs
            if temperature in wanted
            for eval_seed in (args.eval_seed if temperature > 0 else [None])
        ]
        for split, episodes, temperature, eval_seed in runs:
            result = play(backend, env, split, episodes, temperature, args, eval_seed=eval_seed)
            print(f"  [{env} seed {seed}] {json.dumps(result)}", file=sys.stderr, flush=True)
            entry["eval"].append(result)
    finally:
        backend.close()
    return entry


def _sft_dirs() -> list[Path]:
    from streamrl.utils.cache import cache_root

    root = cache_root() / "sft"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def summarize(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per env: each seed's rates (sampled with several ``--eval-seed``: their mean), their min / mean / max over
    seeds, and whether every seed meets the bars."""
    out: dict[str, Any] = {}
    for env in dict.fromkeys(e["env"] for e in entries):
        played: dict[str, dict[int, list[float]]] = collections.defaultdict(
            lambda: collections.defaultdict(list)
        )
        loops: dict[int, int] = {}
        stuck: dict[int, int] = {}
        for e in (e for e in entries if e["env"] == env):
            for r in e["eval"]:
                mode = "greedy" if r["temperature"] == 0 else "sampled"
                played[f"{r['split']}/{mode}"][e["seed"]].append(r["success_rate"])
                if mode == "greedy" and env == "alfworld":
                    loops[e["seed"]] = loops.get(e["seed"], 0) + r["invalid_loops"]
                    if "stuck_cycles" in r:  # measured since 2026-12-02
                        stuck[e["seed"]] = stuck.get(e["seed"], 0) + r["stuck_cycles"]
        rates = {name: {seed: sum(v) / len(v) for seed, v in by.items()} for name, by in played.items()}
        bars = TARGETS.get(env, {})
        meets = all(
            min(by_seed.values()) >= bars[name.split("/")[1]]
            for name, by_seed in rates.items()
            if name.split("/")[1] in bars
        )
        if env == "alfworld":
            meets = meets and not any(loops.values())
        out[env] = {
            "rates": {
                name: {
                    "by_seed": by_seed,
                    "min": min(by_seed.values()),
                    "mean": sum(by_seed.values()) / len(by_seed),
                    "max": max(by_seed.values()),
                }
                for name, by_seed in rates.items()
            },
            **({"greedy_invalid_loops_by_seed": loops} if env == "alfworld" else {}),
            **({"greedy_stuck_cycles_by_seed": stuck} if env == "alfworld" and stuck else {}),
            "targets": bars,
            "meets_targets": meets,
        }
    return out


def compare(entries: Sequence[Mapping[str, Any]], earlier: Path) -> list[dict[str, Any]]:
    """Per checkpoint of both runs (same env, seed and key): are the weights the same bytes?"""
    before = {(e["env"], e["seed"], e["key"]): e for e in json.loads(earlier.read_text())["checkpoints"]}
    return [
        {
            "env": e["env"],
            "seed": e["seed"],
            "same_weights": e["weights_sha256"] == old["weights_sha256"],
            "same_data": e["data_sha256"] == old["data_sha256"],
            "same_start": e["start_weights_sha256"] == old["start_weights_sha256"],
        }
        for e in entries
        if (old := before.get((e["env"], e["seed"], e["key"]))) is not None
    ]


def merge(files: Sequence[Path], output: Path) -> None:
    """One result file from several (the seeds of one recipe built in parallel processes): their checkpoints,
    summarized together; the runs must agree on the overrides and must not hold the same (env, seed) twice."""
    runs = [json.loads(f.read_text()) for f in files]
    if len({json.dumps(r["overrides"], sort_keys=True) for r in runs}) > 1:
        raise SystemExit(
            f"--merge: the files were run with different --set overrides: {[str(f) for f in files]}"
        )
    if len({bool(r.get("constrain_actions")) for r in runs}) > 1:
        raise SystemExit(f"--merge: some files were played with --constrain-actions, some not: {files}")
    if len({bool(r.get("avoid_repeats")) for r in runs}) > 1:
        raise SystemExit(f"--merge: some files were played with --avoid-repeats, some not: {files}")
    entries = [e for r in runs for e in r["checkpoints"]]
    pairs = [(e["env"], e["seed"]) for e in entries]
    if len(set(pairs)) != len(pairs):
        raise SystemExit(f"--merge: an (env, seed) appears twice in {[str(f) for f in files]}: {pairs}")
    result = {
        "command": [r["command"] for r in runs],
        "overrides": runs[0]["overrides"],
        "constrain_actions": bool(runs[0].get("constrain_actions")),
        "avoid_repeats": bool(runs[0].get("avoid_repeats")),
        "platform": runs[0]["platform"],
        "wall_s": [r["wall_s"] for r in runs],
        "summary": summarize(entries),
        "checkpoints": entries,
    }
    compares = [r["compare"] for r in runs if r.get("compare")]
    if compares:
        result["compare"] = compares
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(json.dumps({"summary": result["summary"], "compare": compares}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--envs", nargs="+", default=["math_tir", "alfworld"], choices=["math_tir", "alfworld"]
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--math-episodes", type=int, default=50, help="Math-TIR test tasks (50 = all of them)"
    )
    parser.add_argument("--alfworld-episodes", type=int, default=64, help="games per ALFWorld eval split")
    parser.add_argument(
        "--eval-seed",
        type=int,
        nargs="+",
        default=[0],
        help="run seeds of the sampled evaluation: each plays every sampled run; a seed's rate is their mean",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["greedy", "sampled"],
        default=["greedy", "sampled"],
        help="play greedy, sampled at temperature 1, or both",
    )
    parser.add_argument("--eval-batch", type=int, default=32, help="episodes played at once")
    parser.add_argument("--eval-threads", type=int, default=1, help="torch threads of the evaluation")
    parser.add_argument(
        "--loop-min", type=int, default=10, help="repeats of one invalid command that make a loop"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="recipe field override"
    )
    parser.add_argument(
        "--constrain-actions",
        action="store_true",
        help="play envs that list their actions (ALFWorld) with LLMAgent(constrain_actions=True)",
    )
    parser.add_argument(
        "--avoid-repeats",
        action="store_true",
        help="with --constrain-actions: LLMAgent(avoid_repeats=True), no command taken twice from one state",
    )
    parser.add_argument(
        "--compare", type=Path, help="an earlier result file: did the same recipes rebuild the same weights?"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="result files (one per process): summarize them together, build nothing",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "cold_start.json")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.output)
        return
    overrides = parse_overrides(parser, args.set)
    envs = sorted(args.envs, key=lambda e: e != "math_tir")  # ALFWorld's recipe starts from Math-TIR's

    started = time.perf_counter()
    entries = []
    for env in envs:
        for seed in args.seeds:
            print(f"{env} seed {seed}", file=sys.stderr, flush=True)
            entries.append(checkpoint_entry(env, seed, overrides, args))
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_cold_start.py", *sys.argv[1:]]),
        "overrides": {k: v for k, v in overrides.items()},
        "constrain_actions": args.constrain_actions,
        "avoid_repeats": args.avoid_repeats,
        "platform": _platform(),
        "wall_s": round(time.perf_counter() - started, 1),
        "summary": summarize(entries),
        "checkpoints": entries,
    }
    if args.compare is not None:
        result["compare"] = {"with": str(args.compare), "checkpoints": compare(entries, args.compare)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps({"summary": result["summary"], "compare": result.get("compare")}, indent=2))


if __name__ == "__main__":
    main()
