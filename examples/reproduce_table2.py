"""Reproduce SPO++ Table 2: action-token against trajectory normalization of the advantages, all else fixed.

SPO++ standardizes the advantages under the action-token measure (Eq. 6: each trajectory weighs as many action
tokens as it has), which makes the token-mean loss zero-mean over the batch; the ablation standardizes them with
every trajectory weighing one (``normalization="trajectory"``), with the tracker, retention, Dual-Clip, IS and
optimizer unchanged. The paper reports the learning composite C10 (Eq. 8) over the first ten updates, paired over
three seeds (0.8B on ALFWorld: +10.70 ± 3.98 pp); the table gives it, and the area of the same ten points (Table
1's area for the env), as paired differences over seeds: mean ± s.d. and the 95 % t interval over seeds (the run
is the unit). Here the curve is the held-out evaluation after each of the first ten updates (``--curve batch``: the
training batches' success, the paper's curve). Each run is Table 1's run of its scale and env
(``reproduce_table1.run_config``) stopped after ten updates, its learning-rate schedule still spanning the whole
run's updates (``schedule_updates``), so the ten updates are that run's first ten::

    python examples/reproduce_table2.py                          # tiny on ALFWorld from its SFT checkpoint, 3 seeds
    python examples/reproduce_table2.py --env math_tir --seeds 0 1 2 3 4
    python examples/reproduce_table2.py --scale tiny --env math_tir --seeds 0 1   # a smoke run

``--seeds``, ``--norms`` and ``--train-only`` split the runs into processes (on ALFWorld at ``--scale cpu`` a run
is ten updates with an evaluation of the 140 ``eval_seen`` games after each); the command without
``--train-only`` then builds the table from them. Ctrl-C stops the script after the current run checkpoints; the
same command resumes it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from reproduce_table1 import AREA, pp, run_config, seed_interval  # Table 1's run settings, area and format
from streamrl.algorithms.train import train
from streamrl.evaluation.curves import BATCH, HELD_OUT, Curve, compare_curves, load_curve

NORMALIZATIONS = ("token", "trajectory")
UPDATES = 10  # C10: the first ten updates


def first_ten(curve: Curve) -> Curve:
    """The points after updates 1..10 (the evaluation before the first update is not a training step)."""
    keep = [i for i, u in enumerate(curve.updates) if 1 <= u <= 10]
    return replace(
        curve, updates=tuple(curve.updates[i] for i in keep), values=tuple(curve.values[i] for i in keep)
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=["cpu", "paper", "tiny"], default="cpu")
    parser.add_argument("--env", choices=["alfworld", "math_tir"], default="alfworld")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--model", default="tiny", help="registry name or local model directory (paper: 0.8B)"
    )
    parser.add_argument("--curve", choices=["held-out", "batch"], default="held-out")
    parser.add_argument(
        "--norms", choices=NORMALIZATIONS, nargs="+", default=list(NORMALIZATIONS), help="the runs to train"
    )
    parser.add_argument("--train-only", action="store_true", help="train (or resume) the runs; no table")
    parser.add_argument("--out", type=Path, default=Path("runs/table2"))
    a = parser.parse_args(argv)
    if len(a.seeds) < 2 and not a.train_only:
        parser.error("paired differences need at least two seeds (the paper: 3); --train-only trains one")
    if not a.train_only and sorted(a.norms) != sorted(NORMALIZATIONS):
        parser.error(f"the table pairs both normalizations; --norms {' '.join(a.norms)} needs --train-only")
    started = time.perf_counter()
    runs: dict[str, list[Path]] = {n: [] for n in NORMALIZATIONS}
    for seed in a.seeds:
        for norm in a.norms:
            base = run_config(a.scale, a.env, "spo++", seed, a.out / norm, a.model)
            config = replace(
                base,
                updates=UPDATES,
                schedule_updates=max(base.updates, UPDATES),
                eval_every=1,
                algorithm={**base.algorithm, "normalization": norm},
            )
            run = train(config, resume=(Path(config.out) / "config.json").is_file())
            if run["interrupted"]:  # Ctrl-C / SIGTERM: the run checkpointed; the same command resumes it
                print(
                    f"interrupted in {config.out} at update {run['updates']}; run the same command to resume"
                )
                return {"interrupted": config.out}
            runs[norm].append(Path(config.out))
    if a.train_only:
        print(f"trained {sum(map(len, runs.values()))} runs under {a.out}")
        return {"trained": {n: [str(r) for r in runs[n]] for n in a.norms}}
    column = HELD_OUT if a.curve == "held-out" else BATCH
    curves = {n: [first_ten(load_curve(r, column)) for r in runs[n]] for n in NORMALIZATIONS}
    cmp = compare_curves(curves["token"], curves["trajectory"])
    area = AREA[a.env]
    result = {
        "env": a.env,
        "scale": a.scale,
        "curve": column,
        "c10_token": cmp.a["c10"].to_dict(),
        "c10_trajectory": cmp.b["c10"].to_dict(),
        "delta_c10": seed_interval(list(cmp.difference["c10"].values)),
        "area_metric": area,
        "area_token": cmp.a[area].to_dict(),
        "area_trajectory": cmp.b[area].to_dict(),
        "delta_area": seed_interval(list(cmp.difference[area].values)),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (a.out / "table2.json").write_text(json.dumps(result, indent=2))
    print(
        f"{a.env}, {len(a.seeds)} seeds, C10 of {column}: token {cmp.a['c10'].mean:.3f}, "
        f"trajectory {cmp.b['c10'].mean:.3f}, paired difference {pp(result['delta_c10'])} pp; "
        f"area ({area}) of updates 1-10: token {cmp.a[area].mean:.3f}, trajectory {cmp.b[area].mean:.3f}, "
        f"paired difference {pp(result['delta_area'])} pp ({result['wall_s']:.0f} s)"
    )
    return result


if __name__ == "__main__":
    main()
