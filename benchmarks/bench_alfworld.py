"""ALFWorld env throughput: our patched engine vs stock TextWorld 1.7 on the same games and commands,
memory per env, and scripted-agent success rates.

    python benchmarks/bench_alfworld.py [--games 12] [--steps 30] [--out benchmarks/results/envs/alfworld.json]

Per game, a seeded random agent's admissible commands are recorded once and replayed on both engines
(their transcripts are identical; ``tests/envs/test_alfworld_env.py`` checks that). Times are wall-clock on
whatever else the machine is running; the load average is recorded next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from streamrl.envs import alfworld_gen as gen
from streamrl.envs import textworld_patches
from streamrl.envs.alfworld import AlfredEngine, ALFWorldEnv

HERE = Path(__file__).resolve().parent


def _record_commands(engine: AlfredEngine, game: dict[str, Any], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    engine.load(game)
    _, admissible, won = engine.reset()
    commands = []
    for _ in range(n):
        command = rng.choice(admissible)
        commands.append(command)
        _, admissible, won = engine.step(command)
        if won:
            break
    return commands


def _clear_memory_caches() -> None:
    textworld_patches._translate_cached.cache_clear()
    textworld_patches._parse_game_logic_cached.cache_clear()
    textworld_patches._INITIAL_FACTS.clear()


def _time_engine(
    engine: AlfredEngine, games: list[dict[str, Any]], scripts: list[list[str]], resets: int
) -> dict[str, Any]:
    loads, switch_resets, same_resets, steps = [], [], [], []
    for game, script in zip(games, scripts, strict=True):
        t0 = time.perf_counter()
        engine.load(game)
        t1 = time.perf_counter()
        engine.reset()
        t2 = time.perf_counter()
        loads.append(t1 - t0)
        switch_resets.append(t2 - t0)
        for _ in range(resets):
            t = time.perf_counter()
            engine.reset()
            same_resets.append(time.perf_counter() - t)
        for command in script:
            t = time.perf_counter()
            engine.step(command)
            steps.append(time.perf_counter() - t)
    return {
        "load_s_mean": statistics.mean(loads),
        "reset_same_game_ms_mean": 1000 * statistics.mean(same_resets),
        "reset_same_game_ms_p50": 1000 * statistics.median(same_resets),
        "load_plus_reset_ms_mean": 1000 * statistics.mean(switch_resets),
        "step_ms_mean": 1000 * statistics.mean(steps),
        "step_ms_p50": 1000 * statistics.median(steps),
        "step_ms_p95": 1000 * statistics.quantiles(steps, n=20)[-1],
        "steps_per_s": len(steps) / sum(steps),
        "resets_per_s": len(same_resets) / sum(same_resets),
        "n_steps": len(steps),
        "n_resets": len(same_resets),
    }


_MEMORY_SCRIPT = """
import json, sys, psutil
from streamrl.envs.alfworld import ALFWorldEnv
proc = psutil.Process()
base = proc.memory_info().rss
envs, rss = [], []
for k in range(int(sys.argv[1])):
    env = ALFWorldEnv(split="eval_unseen")
    env.reset(options={"task_id": env.task_ids[k]})
    envs.append(env)
    rss.append(proc.memory_info().rss)
# One env cycling through the whole training split fills the per-process game caches.
train = ALFWorldEnv(split="train")
for task_id in train.task_ids:
    train.reset(options={"task_id": task_id})
print(json.dumps({"rss_after_imports_mb": base / 2**20, "rss_mb": [r / 2**20 for r in rss],
                  "rss_after_cycling_train_split_mb": proc.memory_info().rss / 2**20}))
"""


def _memory(n_envs: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(n_envs)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{proc.stderr}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = data["rss_mb"]
    data["per_additional_env_mb"] = (rss[-1] - rss[0]) / (len(rss) - 1)
    return data


def _agent_success(split: str, seed: int) -> dict[str, Any]:
    from streamrl.agents.alfworld_agents import ALFWorldExpertAgent, ALFWorldRandomAgent
    from streamrl.agents.rollout import play_episode

    env = ALFWorldEnv(split=split)
    result: dict[str, Any] = {"split": split, "games": len(env.task_ids), "max_steps": env.max_steps}
    for name, agent in (("expert", ALFWorldExpertAgent()), ("random", ALFWorldRandomAgent(seed=seed))):
        t = time.perf_counter()
        episodes = [play_episode(env, agent, options={"task_id": tid}) for tid in env.task_ids]
        wins = [e.won for e in episodes]
        by_type = {
            t_: sum(e.won for e in episodes if e.final_info["task_type"] == t_)
            / max(1, sum(e.final_info["task_type"] == t_ for e in episodes))
            for t_ in gen.TASK_TYPES
        }
        result[name] = {
            "success_rate": sum(wins) / len(wins),
            "by_task_type": by_type,
            "mean_steps": statistics.mean(e.steps for e in episodes),
            "env_steps_per_s": sum(e.steps for e in episodes) / (time.perf_counter() - t),
        }
    env.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=12, help="eval_unseen games timed on both engines")
    parser.add_argument("--steps", type=int, default=30, help="recorded random commands per game")
    parser.add_argument("--resets", type=int, default=3, help="extra resets of each loaded game")
    parser.add_argument("--memory-envs", type=int, default=8)
    parser.add_argument("--out", default=str(HERE / "results" / "envs" / "alfworld.json"))
    args = parser.parse_args(argv)

    load_start = os.getloadavg()
    paths = gen.ensure_split("eval_unseen")[: args.games]
    games = [json.loads(p.read_text()) for p in paths]
    engine = AlfredEngine()
    scripts = [_record_commands(engine, g, args.steps, seed=k) for k, g in enumerate(games)]

    # Patched, warm translation cache (the normal case after first use).
    patched = _time_engine(engine, games, scripts, args.resets)
    # Patched, game evicted from memory but in the disk translation cache.
    _clear_memory_caches()
    t = time.perf_counter()
    for g in games:
        engine.load(g)
        engine.reset()
    disk_load = (time.perf_counter() - t) / len(games)
    # Patched, cold: empty memory and disk translation caches (what a never-seen game costs).
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("STREAMRL_CACHE")
        os.environ["STREAMRL_CACHE"] = tmp
        _clear_memory_caches()
        t = time.perf_counter()
        for g in games:
            engine.load(g)
            engine.reset()
        cold_first_load = (time.perf_counter() - t) / len(games)
        if old is None:
            del os.environ["STREAMRL_CACHE"]
        else:
            os.environ["STREAMRL_CACHE"] = old
    with textworld_patches.unpatched():
        stock = _time_engine(engine, games, scripts, args.resets)

    results = {
        "what": "ALFWorld text env: streamrl-patched vs stock textworld 1.7 PDDL engine, same games and commands",
        "command": "python benchmarks/bench_alfworld.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "textworld": metadata.version("textworld"),
            "alfworld": metadata.version("alfworld"),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "games": [p.parent.name for p in paths],
        "patched": patched,
        "patched_load_plus_reset_from_disk_cache_s": disk_load,
        "patched_cold_load_plus_reset_s": cold_first_load,
        "stock": stock,
        "speedup": {
            "step": stock["step_ms_mean"] / patched["step_ms_mean"],
            "reset_same_game": stock["reset_same_game_ms_mean"] / patched["reset_same_game_ms_mean"],
            "load_plus_reset": stock["load_plus_reset_ms_mean"] / patched["load_plus_reset_ms_mean"],
        },
        "targets_met": {
            "step_le_10ms": patched["step_ms_mean"] <= 10,
            "reset_le_60ms": patched["reset_same_game_ms_mean"] <= 60,
        },
        "memory": _memory(args.memory_envs),
        "agents": _agent_success("train", seed=0),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("patched", "stock", "speedup", "memory")}, indent=1))
    print(json.dumps(results["agents"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
