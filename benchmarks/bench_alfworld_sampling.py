"""The ALFWorld cold start's sampled success at several temperatures, on fresh training games: where to select
the sampled policy without touching the eval splits (issue 14: "select on freshly generated tasks or training
games").

For each seed, the checkpoint of ``SFTConfig.alfworld(seed=seed)`` is found in ``$STREAMRL_CACHE/sft`` (or
built) and plays the same ``--games`` generated ``train`` games at every ``--temperatures`` value. The games
start after the ones the recipe trained on (games ``128 + synthetic_episodes`` on; RL trains on the first 128),
so none was trained on and none is an eval game; they are generated on first use and cached with the split.
Sampled play is seeded (``--eval-seed``), the same seed at every temperature. ``--constrain-actions`` plays
with ``LLMAgent(constrain_actions=True)``.

    python benchmarks/bench_alfworld_sampling.py --seeds 0 1 2 --temperatures 0.6 0.8 1.0 1.25 \\
        --constrain-actions --output benchmarks/results/alfworld_selection/alfworld_sampling_fresh.json

Seeds can run in parallel processes (one ``--seeds`` and ``--output`` each), then ``--merge`` them. The
summary gives, per temperature, each seed's success and the mean over seeds; ``best`` is the temperature
with the highest mean (on a tie, the one nearest 1). Each run keeps the ids of the games it won, so two
policies played on the same games compare game by game (an exact sign test on the games only one won):

    python benchmarks/bench_alfworld_sampling.py --paired A_1152.json A_1280.json --vs B_1152.json B_1280.json \
        --output benchmarks/results/alfworld_selection/a_vs_b.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench_cold_start import RESULTS, _platform, parse_overrides, play


def fresh_games(synthetic_episodes: int, games: int, first: int | None) -> tuple[int, list[str]]:
    """The index of the first fresh ``train`` game and the paths of ``games`` of them, generated if missing:
    from ``first`` (default: just past the recipe's ``synthetic_episodes`` extra games), never one the recipe
    trained on."""
    from streamrl.envs.alfworld_gen import GenerationConfig, ensure_split

    trained = GenerationConfig().train + synthetic_episodes
    first = trained if first is None else first
    if first < trained:
        raise SystemExit(
            f"--first-game {first}: the recipe trained on train games 0..{trained - 1}; give {trained} or more"
        )
    if games < 1:
        raise SystemExit(f"--games must be >= 1, got {games}")
    paths = ensure_split("train", GenerationConfig(train=first + games))
    return first, [str(p) for p in paths[first:]]


def seed_entry(seed: int, overrides: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Find (or build) the checkpoint of the preset with ``overrides`` and ``seed``, and play the fresh games at
    every temperature."""
    import torch
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.sft import SFTConfig, sft_checkpoint

    config = SFTConfig.for_env("alfworld", seed=seed, **overrides)
    path = sft_checkpoint(config, log=lambda m: print(f"  [seed {seed}] {m}", file=sys.stderr, flush=True))
    first, files = fresh_games(config.synthetic_episodes, args.games, args.first_game)
    report = json.loads((path / "streamrl_sft.json").read_text())
    entry: dict[str, Any] = {
        "seed": seed,
        "key": config.key(),
        "checkpoint": str(path),
        "weights_sha256": report.get("weights_sha256"),
        "games": {"split": "train", "first": first, "count": len(files)},
        "runs": [],
    }
    torch.set_num_threads(args.eval_threads)
    backend = HFBackend(str(path), config=HFBackendConfig(device="cpu"))
    try:
        for temperature in args.temperatures:
            result = play(
                backend,
                "alfworld",
                "train",
                len(files),
                temperature,
                args,
                {"game_files": files},
                eval_seed=args.eval_seed,
            )
            print(f"  [seed {seed}] {json.dumps(result)}", file=sys.stderr, flush=True)
            entry["runs"].append(result)
    finally:
        backend.close()
    return entry


def summarize(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per temperature: success by seed, its mean and min; ``best``: the highest mean (a tie: nearest 1)."""
    by_temperature: dict[float, dict[int, float]] = {}
    for e in entries:
        for r in e["runs"]:
            by_temperature.setdefault(r["temperature"], {})[e["seed"]] = r["success_rate"]
    rates = {
        str(t): {"by_seed": s, "mean": sum(s.values()) / len(s), "min": min(s.values())}
        for t, s in sorted(by_temperature.items())
    }
    best = max(by_temperature, key=lambda t: (rates[str(t)]["mean"], -abs(t - 1.0)), default=None)
    return {"rates": rates, "best": best}


def sign_test(only_a: int, only_b: int) -> float:
    """Two-sided exact sign test (McNemar's exact form) on the discordant games: the probability, were both
    policies equally good, of a split at least this uneven."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired(a_files: Sequence[Path], b_files: Sequence[Path]) -> dict[str, Any]:
    """Policy A against policy B on the same games: per (games, seed, temperature) that both sides played, the
    games both won, only A won and only B won (from each run's ``won_tasks``), and over all of them the sign
    test on the discordant games. Playing the same games both ways cancels how hard each game is, which two
    independent success rates cannot."""

    def runs(files: Sequence[Path]) -> dict[tuple[str, int, float], tuple[Path, Mapping[str, Any]]]:
        out = {}
        for f in files:
            result = json.loads(f.read_text())
            for e in result["entries"]:
                for r in e["runs"]:
                    if "won_tasks" not in r:
                        raise SystemExit(
                            f"--paired: {f} keeps no won_tasks (written before they were recorded)"
                        )
                    key = (json.dumps(e["games"], sort_keys=True), e["seed"], r["temperature"])
                    if key in out:
                        raise SystemExit(f"--paired: {f} and {out[key][0]} played the same games, seed and T")
                    out[key] = (f, r)
        return out

    a, b = runs(a_files), runs(b_files)
    common = sorted(set(a) & set(b))
    if not common:
        raise SystemExit(f"--paired: no games, seed and temperature played by both {a_files} and {b_files}")
    pairs = []
    for key in common:
        won_a, won_b = set(a[key][1]["won_tasks"]), set(b[key][1]["won_tasks"])
        games, seed, temperature = key
        pairs.append(
            {
                "games": json.loads(games),
                "seed": seed,
                "temperature": temperature,
                "files": [str(a[key][0]), str(b[key][0])],
                "episodes": a[key][1]["episodes"],
                "wins": [len(won_a), len(won_b)],
                "both": len(won_a & won_b),
                "only_a": len(won_a - won_b),
                "only_b": len(won_b - won_a),
            }
        )
    only_a, only_b = sum(p["only_a"] for p in pairs), sum(p["only_b"] for p in pairs)
    episodes = sum(p["episodes"] for p in pairs)
    return {
        "pairs": pairs,
        "episodes": episodes,
        "success": [sum(p["wins"][0] for p in pairs) / episodes, sum(p["wins"][1] for p in pairs) / episodes],
        "only_a": only_a,
        "only_b": only_b,
        "sign_test_p": sign_test(only_a, only_b),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.8, 1.0, 1.25])
    parser.add_argument("--games", type=int, default=128, help="fresh training games played per temperature")
    parser.add_argument(
        "--first-game", type=int, help="index of the first (default: past the recipe's games)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe field override (as bench_cold_start)",
    )
    parser.add_argument("--eval-seed", type=int, default=0, help="run seed of the sampled play")
    parser.add_argument("--eval-batch", type=int, default=32, help="episodes played at once")
    parser.add_argument("--eval-threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--loop-min", type=int, default=10, help="the last actions that make a loop or a cycle"
    )
    parser.add_argument("--constrain-actions", action="store_true", help="LLMAgent(constrain_actions=True)")
    parser.add_argument(
        "--avoid-repeats", action="store_true", help="with --constrain-actions: LLMAgent(avoid_repeats=True)"
    )
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="result files (one per process): summarize them"
    )
    parser.add_argument(
        "--paired",
        type=Path,
        nargs="+",
        metavar="A",
        help="result files of policy A: compare them game by game with those of --vs",
    )
    parser.add_argument("--vs", type=Path, nargs="+", metavar="B", help="result files of policy B")
    parser.add_argument(
        "--output", type=Path, default=RESULTS.parent / "alfworld_selection" / "alfworld_sampling_fresh.json"
    )
    args = parser.parse_args()
    if any(t <= 0 for t in args.temperatures):
        parser.error(f"--temperatures must be > 0 (this measures sampled play), got {args.temperatures}")
    if bool(args.paired) != bool(args.vs):
        parser.error("--paired A... and --vs B... go together")
    if args.paired:
        result = paired(args.paired, args.vs)
        result["command"] = " ".join(["python", "benchmarks/bench_alfworld_sampling.py", *sys.argv[1:]])
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k != "pairs"}, indent=2))
        return
    if args.merge:
        runs = [json.loads(f.read_text()) for f in args.merge]
        played = {
            (
                r["constrain_actions"],
                bool(r.get("avoid_repeats")),
                json.dumps(r["games"]),
                json.dumps(r.get("overrides", {}), sort_keys=True),
            )
            for r in runs
        }
        if len(played) > 1:
            raise SystemExit(f"--merge: the files played other games, constraints or recipes: {args.merge}")
        entries = [e for r in runs for e in r["entries"]]
        seeds = [e["seed"] for e in entries]
        if len(set(seeds)) != len(seeds):
            raise SystemExit(f"--merge: a seed appears twice in {[str(f) for f in args.merge]}: {seeds}")
        result = {**runs[0], "command": [r["command"] for r in runs], "wall_s": [r["wall_s"] for r in runs]}
        result.update(summary=summarize(entries), entries=entries)
    else:
        started = time.perf_counter()
        overrides = parse_overrides(parser, args.set)
        entries = [seed_entry(seed, overrides, args) for seed in args.seeds]
        result = {
            "command": " ".join(["python", "benchmarks/bench_alfworld_sampling.py", *sys.argv[1:]]),
            "overrides": overrides,
            "constrain_actions": args.constrain_actions,
            "avoid_repeats": args.avoid_repeats,
            "games": entries[0]["games"],
            "eval_seed": args.eval_seed,
            "platform": _platform(),
            "wall_s": round(time.perf_counter() - started, 1),
            "summary": summarize(entries),
            "entries": entries,
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
