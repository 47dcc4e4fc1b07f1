"""Does SPO++ with a LoRA adapter learn on Math-TIR? The demo's run (``streamrl demo``) with LoRA instead of full
fine-tuning, its settings chosen on training tasks and its result judged on the held-out test split.

1. **select**: each candidate adapter (learning rate, rank, alpha) trains one run of the demo's config (seed
   ``--select-seed``, ``--select-updates`` updates) whose held-out evaluation plays the *training* split's tasks
   (``eval_split="train"``, each of its tasks in the SFT families once); the candidate with the largest paired
   gain there (last evaluation against the first, on the same episodes) is chosen. The test split is not looked
   at.
2. **confirm**: the chosen candidate trains the demo's run (60 updates, the test split's 405 tasks of the SFT
   families once per evaluation) for each of ``--seeds``; each run's paired gain has its 95 % interval clustered
   by task. Beside it, the full-fine-tuning run of the same seed and config (``--full DIR``: ``DIR/spo++-seed<N>``,
   e.g. ``examples/reproduce_table1.py --scale cpu``'s Math-TIR runs) when it exists; ``--train-full`` trains
   those (the demo's own run, full fine-tuning, at each seed) in the same pool when they do not.

``--chosen LR RANK ALPHA`` skips step 1 and confirms that adapter (e.g. one chosen by an earlier selection; the
result records it as given, not chosen here)::

    python benchmarks/bench_lora.py --jobs 2 --full runs/table1/math_tir
    python benchmarks/bench_lora.py --jobs 2 --chosen 1e-3 16 32 --train-full --full runs/lora/full

writes ``benchmarks/results/learning/lora_math_tir.json``. Runs resume from their directories (``--out``), so
an interrupted benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from streamrl.algorithms.train import TrainConfig
from streamrl.cli.demo import DEMO_60_UPDATES, DemoConfig
from streamrl.evaluation.compare import held_out_gain

RESULTS = Path(__file__).resolve().parent / "results" / "learning"
CANDIDATES = [  # (lr, rank, alpha): LoRA usually wants a larger step than full fine-tuning's 1e-4
    (3e-4, 16, 32),
    (1e-3, 16, 32),
    (3e-3, 16, 32),
    (1e-3, 64, 128),
]
TRAIN_TASKS = 271  # Math-TIR training tasks in the SFT families: each played once per selection evaluation

_TRAIN = "import json, sys; from streamrl.algorithms.train import TrainConfig, train; " + (
    "c = TrainConfig.from_dict(json.load(open(sys.argv[1]))); train(c, resume=(sys.argv[2] == '1'))"
)


def lora_config(out: Path, seed: int, lr: float, rank: int, alpha: int, **demo: Any) -> TrainConfig:
    """The demo's run at ``seed`` with a LoRA adapter, one torch thread (two runs share a 2-core machine)."""
    return DemoConfig(
        out=out, seed=seed, threads=1, progress=False, finetune="lora", lr=lr, lora_rank=rank, lora_alpha=alpha,
        **{**DEMO_60_UPDATES, **demo},
    ).train_config()  # fmt: skip


def train_in_subprocess(config: TrainConfig) -> float:
    """Train ``config`` in a fresh interpreter (resuming a run its directory holds); its wall time in seconds."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = out.parent / f"{out.name}.config.json"
    spec.write_text(json.dumps(config.to_dict()))
    started = time.perf_counter()
    resume = "1" if (out / "config.json").is_file() else "0"
    done = subprocess.run([sys.executable, "-c", _TRAIN, str(spec), resume], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"run {out} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def run(config: TrainConfig) -> dict[str, Any]:
    """Train ``config`` in a subprocess (resuming a run its directory holds) and return its held-out gain."""
    wall = train_in_subprocess(config)
    return {"run": config.out, "wall_s": round(wall, 1), "held_out_gain": held_out_gain(config.out)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/lora"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--select-seed", type=int, default=100, help="a seed none of --seeds uses")
    parser.add_argument("--select-updates", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    parser.add_argument("--full", type=Path, help="directory of the full-fine-tuning runs spo++-seed<N>")
    parser.add_argument(
        "--chosen", nargs=3, metavar=("LR", "RANK", "ALPHA"), help="skip the selection; confirm this adapter"
    )
    parser.add_argument(
        "--train-full", action="store_true", help="train the full-fine-tuning runs into --full as well"
    )
    parser.add_argument("--result", type=Path, default=RESULTS / "lora_math_tir.json")
    a = parser.parse_args(argv)
    if a.select_seed in a.seeds:
        parser.error(f"--select-seed {a.select_seed} is one of --seeds {a.seeds}: choose on another run")
    if a.train_full and a.full is None:
        parser.error("--train-full needs --full DIR: where the full-fine-tuning runs spo++-seed<N> go")
    started = time.perf_counter()
    if a.chosen:
        try:
            lr, rank, alpha = float(a.chosen[0]), int(a.chosen[1]), int(a.chosen[2])
        except ValueError:
            parser.error(
                f"--chosen {' '.join(a.chosen)}: expected a learning rate and two integers, e.g. 1e-3 16 32"
            )
        return confirm(a, (lr, rank, alpha), None, argv, started)
    selection = [
        lora_config(
            a.out / f"select-lr{lr:g}-r{rank}-seed{a.select_seed}", a.select_seed, lr, rank, alpha,
            updates=a.select_updates, eval_episodes=TRAIN_TASKS,
        )
        for lr, rank, alpha in CANDIDATES
    ]  # fmt: skip
    selection = [replace(c, eval_split="train") for c in selection]
    with ThreadPoolExecutor(a.jobs) as pool:
        selected = list(pool.map(run, selection))
    for (lr, rank, alpha), r in zip(CANDIDATES, selected, strict=True):
        r |= {"lr": lr, "rank": rank, "alpha": alpha}
    best = max(selected, key=lambda r: r["held_out_gain"]["mean"] if r["held_out_gain"] else float("-inf"))
    selection = {"seed": a.select_seed, "updates": a.select_updates, "eval_split": "train", "runs": selected}
    return confirm(a, (best["lr"], best["rank"], best["alpha"]), selection, argv, started)


def confirm(
    a: argparse.Namespace,
    chosen: tuple[float, int, int],
    selection: dict[str, Any] | None,
    argv: list[str] | None,
    started: float,
) -> dict[str, Any]:
    """Step 2: the ``chosen`` adapter's run at each of ``a.seeds`` (and, with ``a.train_full``, the demo's own
    full-fine-tuning run of each seed), each judged beside the full run of its seed; writes and returns the
    result (``selection`` None: the adapter was given with ``--chosen``)."""
    lr, rank, alpha = chosen
    jobs = [lora_config(a.out / f"lora-seed{s}", s, lr, rank, alpha) for s in a.seeds]
    if a.train_full:
        jobs += [
            DemoConfig(
                out=a.full / f"spo++-seed{s}", seed=s, threads=1, progress=False, **DEMO_60_UPDATES
            ).train_config()
            for s in a.seeds
        ]
    with ThreadPoolExecutor(a.jobs) as pool:
        confirmed = list(pool.map(run, jobs))[: len(a.seeds)]
    for seed, r in zip(a.seeds, confirmed, strict=True):
        full = a.full / f"spo++-seed{seed}" if a.full else None
        r |= {"seed": seed, "full_finetune": held_out_gain(full) if full and full.is_dir() else None}
    result = {
        "what": "SPO++ on Math-TIR, the demo's run with a LoRA adapter "
        + ("(candidates chosen on training tasks)" if selection else "(the adapter given with --chosen)")
        + ", on the test split per seed beside full fine-tuning of the same seed",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "selection": selection or {"skipped": "the adapter was given with --chosen"},
        "chosen": {"lr": lr, "rank": rank, "alpha": alpha},
        "runs": confirmed,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    a.result.parent.mkdir(parents=True, exist_ok=True)
    a.result.write_text(json.dumps(result, indent=2) + "\n")
    for r in (selection or {}).get("runs", []):
        g = r["held_out_gain"]
        print(
            f"select lr {r['lr']:g} rank {r['rank']}: training-task gain {g['mean']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]"
        )
    for r in confirmed:
        g, f = r["held_out_gain"], r["full_finetune"]
        full_text = (
            ""
            if f is None
            else f"; full fine-tuning {f['mean']:+.3f} [{f['ci_low']:+.3f}, {f['ci_high']:+.3f}]"
        )
        print(f"seed {r['seed']}: LoRA {g['mean']:+.3f} [{g['ci_low']:+.3f}, {g['ci_high']:+.3f}]{full_text}")
    return result


if __name__ == "__main__":
    main()
