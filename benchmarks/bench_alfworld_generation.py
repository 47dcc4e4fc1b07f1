"""ALFWorld rollouts' generation: each episode's window head kept in the prefix cache against whole prompts,
side by side.

ALFWorld's policy sees a window (``env_spec("alfworld").context``: the system message and first observation,
then the last turn and the current observation), so no prompt continues the previous one whole and the
whole-sequence prefix cache hits only at turn 1. ``LLMAgent`` now has ``HFBackend`` keep the episode's first
prompt (the head every later prompt starts with: ``generate(..., keep=...)``). The previous path is the same
backend behind a wrapper whose ``generate`` takes no ``keep`` (what the agent did before: it passes ``keep``
only to a backend that takes it), so both paths run today's decoder in one process.

Setting: the preset's play (``TRAIN_PRESETS["alfworld"]``: constrained actions, no command twice from one
state, temperature 1, 24 new tokens, 16 envs), ALFWorld's shipped SFT checkpoint of ``tiny``, the first
``--episodes`` training games, 1 torch thread. Each repeat plays the same episodes (same seeds) with both
paths, alternating which goes first. Reported: the seconds inside ``generate`` and the whole play's wall
seconds (env steps included), their medians and the median per-repeat ratio; the prompt tokens each path ran
through the model; and whether both paths played the same episodes (every turn's tokens equal).

Writes ``benchmarks/results/generation/alfworld_window_heads.json``:

    python benchmarks/bench_alfworld_generation.py [--episodes 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamrl.agents.base import Generation, SamplingParams
from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
from streamrl.algorithms.train_config import TrainConfig, initial_model_dir

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_learner import play_batch  # noqa: E402


class _Timed:
    """``backend`` with the seconds spent in ``generate`` and the prompt tokens it ran (those not found kept)."""

    def __init__(self, backend: HFBackend) -> None:
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.seconds = 0.0
        self.prompt_tokens = 0

    def _call(self, prompts: Sequence[Sequence[int]], **kwargs: Any) -> list[Generation]:
        reused = self.backend.prefix_cache.reused_tokens
        started = time.perf_counter()
        out = self.backend.generate(prompts, **kwargs)
        self.seconds += time.perf_counter() - started
        self.prompt_tokens += sum(map(len, prompts)) - (self.backend.prefix_cache.reused_tokens - reused)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


class WholePrompts(_Timed):
    """The previous path: a ``generate`` without ``keep``, so the agent keeps each turn's whole sequence."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> list[Generation]:
        return self._call(prompts, params=params, seeds=seeds, choices=choices)


class KeptHeads(_Timed):
    """Today's path: the agent passes ``keep`` (each windowed episode's head)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        choices: Sequence[Sequence[Sequence[int]] | None] | None = None,
        keep: Sequence[int | None] | None = None,
    ) -> list[Generation]:
        return self._call(prompts, params=params, seeds=seeds, choices=choices, keep=keep)


def play(path: type[_Timed], model_dir: Path, episodes: int, seed: int) -> dict[str, Any]:
    backend = HFBackend(model_dir, config=HFBackendConfig(device="cpu", seed=seed))
    timed = path(backend)
    started = time.perf_counter()
    played = play_batch(timed, episodes, env="alfworld", seed=seed, constrained=True)  # type: ignore[arg-type]
    wall = time.perf_counter() - started
    backend.close()
    return {
        "generate_s": timed.seconds,
        "wall_s": wall,
        "prompt_tokens_run": timed.prompt_tokens,
        "turns": sum(len(e.trajectory.turns) for e in played),
        "success": sum(e.trajectory.won for e in played) / len(played),
        "sequences": [[s.token_ids for s in e.trajectory.sequences] for e in played],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=HERE / "results" / "generation" / "alfworld_window_heads.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = TrainConfig.for_env("alfworld")
    assert preset.constrain_actions and preset.avoid_repeats
    model_dir = initial_model_dir("tiny", "sft", "alfworld")
    load_before = os.getloadavg()[0]
    paths: dict[str, type[_Timed]] = {"whole_prompts": WholePrompts, "kept_heads": KeptHeads}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
    for repeat in range(args.repeats):
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for name in order:
            runs[name].append(play(paths[name], model_dir, args.episodes, args.seed))
            last = runs[name][-1]
            print(f"repeat {repeat} {name}: generate {last['generate_s']:.2f} s, wall {last['wall_s']:.2f} s")
    same = all(
        run["sequences"] == runs["whole_prompts"][0]["sequences"] for name in paths for run in runs[name]
    )
    summary: dict[str, Any] = {}
    for name in paths:
        summary[name] = {
            "generate_s": [round(r["generate_s"], 3) for r in runs[name]],
            "wall_s": [round(r["wall_s"], 3) for r in runs[name]],
            "generate_s_median": statistics.median(r["generate_s"] for r in runs[name]),
            "wall_s_median": statistics.median(r["wall_s"] for r in runs[name]),
            "prompt_tokens_run": runs[name][0]["prompt_tokens_run"],
        }
    ratio = [
        w["generate_s"] / k["generate_s"]
        for w, k in zip(runs["whole_prompts"], runs["kept_heads"], strict=True)
    ]
    wall_ratio = [
        w["wall_s"] / k["wall_s"] for w, k in zip(runs["whole_prompts"], runs["kept_heads"], strict=True)
    ]
    first = runs["kept_heads"][0]
    result = {
        "benchmark": "ALFWorld rollouts' generation: window heads kept vs whole prompts, side by side",
        "command": "python benchmarks/bench_alfworld_generation.py "
        + f"--episodes {args.episodes} --repeats {args.repeats} --seed {args.seed}",
        "model": "tiny, ALFWorld's shipped SFT checkpoint",
        "setting": "TRAIN_PRESETS['alfworld'] play (constrained, avoid_repeats, temperature 1, 16 envs), 1 thread",
        "episodes": args.episodes,
        "turns": first["turns"],
        "success": first["success"],
        "same_episodes": same,
        "generate_speedup_median": statistics.median(ratio),
        "generate_speedup_by_repeat": [round(r, 3) for r in ratio],
        "wall_speedup_median": statistics.median(wall_ratio),
        "paths": summary,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} at the end",
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "paths"}, indent=1))


if __name__ == "__main__":
    main()
