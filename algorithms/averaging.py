"""Weight averaging over a run's published policies (stochastic weight averaging, Izmailov et al. 2018).

A run publishes its policy after every update it serves (``policy/v<K>``, full weights for a fully fine-tuned
model). At a learning rate near where a run can break (ALFWorld's preset), the last version carries the noise of
its last few steps; the uniform mean of the last versions' weights is a policy of its own, one that averages that
noise out. ``average_policies`` writes that mean as a policy directory any loader of full weights takes
(``streamrl eval sft@DIR`` or ``model:NAME@DIR``, ``HFBackend(DIR)``); ``streamrl average`` is its command.

Only full weights average: a LoRA policy is ``W + s·B·A``, and the mean of the ``A``s and ``B``s is not the mean
of the products, so adapters are refused with what to do instead. The versions must be on disk: a run keeps its
last ``keep_versions`` (3 by default), so a run meant to be averaged over its last K versions is started with
``--keep-versions K`` or more.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from streamrl.agents.probe import PROBE_FILE
from streamrl.algorithms.run_dir import RunDir

__all__ = ["AVERAGE_DIR", "AVERAGE_FILE", "average_policies", "select_versions"]

AVERAGE_DIR = "average"
"""Where a run's own averaged policy lies, under ``policy/`` (``TrainConfig.average_last``; ``run:DIR@average``)."""
AVERAGE_FILE = "averaged_from.json"
"""Written beside the averaged weights: the run and the versions they are the mean of."""


def select_versions(available: Sequence[int], *, last: int = 0, versions: str = "") -> list[int]:
    """The versions to average: the ``last`` K of ``available`` (the run's published versions on disk), or
    the range ``versions`` = ``"A-B"`` (both ends included) or a comma list ``"A,B,C"``. Exactly one of the
    two is given; every version named must be on disk. ``ValueError`` naming the value otherwise."""
    on_disk = sorted(v for v in available if v > 0)
    if bool(last) == bool(versions):
        raise ValueError(
            f"give exactly one of last (a count >= 1) or versions ('A-B' or 'A,B'); got last={last}, "
            f"versions={versions!r}"
        )
    if last:
        if last < 1:
            raise ValueError(f"last must be a count >= 1, got {last}")
        if last > len(on_disk):
            raise ValueError(
                f"last={last} needs {last} published versions on disk, the run has {len(on_disk)}: {on_disk} "
                "(a run keeps its last keep_versions; start it with --keep-versions K to average K)"
            )
        return on_disk[-last:]
    try:
        if "-" in versions:
            low, high = (int(x) for x in versions.split("-", 1))
            chosen = list(range(low, high + 1))
        else:
            chosen = sorted({int(x) for x in versions.split(",")})
    except ValueError:
        raise ValueError(f"versions must be 'A-B' or 'A,B,C' of version numbers, got {versions!r}") from None
    if not chosen or chosen[0] < 1:
        raise ValueError(f"versions {versions!r} names no published version (those are >= 1)")
    missing = [v for v in chosen if v not in on_disk]
    if missing:
        raise ValueError(f"versions {missing} are not on disk; the run has {on_disk}")
    return chosen


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from streamrl.agents.hf_backend import read_weights

    if (directory / "adapter_config.json").is_file():
        raise ValueError(
            f"{directory} is a LoRA adapter: adapters do not average (the mean of the A and B matrices is not "
            "the mean of the policies); average the versions of a fully fine-tuned run (--finetune full)"
        )
    weights = read_weights(directory)
    if not weights:
        raise FileNotFoundError(f"{directory} holds no model weights (*.safetensors)")
    return weights


def average_policies(run: str | Path, versions: Sequence[int], out: str | Path) -> Path:
    """Write the uniform mean of run ``run``'s published ``versions`` (full weights) to ``out``: the weights
    (summed in float64, stored in each tensor's own dtype), the last version's model config files and
    ``AVERAGE_FILE``. One version copies its weights exactly. Returns ``out``."""
    from safetensors.torch import save_file

    if not versions:
        raise ValueError("versions is empty: name at least one published version")
    source = RunDir(run)
    dirs = [source.policy(v) for v in versions]
    absent = [str(d) for d in dirs if not d.is_dir()]
    if absent:
        raise FileNotFoundError(f"policy versions not on disk: {absent}")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for directory in dirs:
        weights = _weights(directory)
        if total and set(weights) != set(total):
            odd = sorted(set(weights) ^ set(total))[:3]
            raise ValueError(f"{directory} holds other tensors than {dirs[0]} (e.g. {odd}): not one model")
        for name, tensor in weights.items():
            if name in total and tensor.shape != total[name].shape:
                raise ValueError(
                    f"{directory}: {name} has shape {tuple(tensor.shape)}, {dirs[0]} {tuple(total[name].shape)}"
                )
            dtypes[name] = tensor.dtype
            value = tensor.to(torch.float64)
            total[name] = value if name not in total else total[name] + value
    mean = {name: (value / len(dirs)).to(dtypes[name]).contiguous() for name, value in total.items()}
    target = Path(out)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in dirs[-1].iterdir():  # the model's config files; not its weights, nor its version's probe
        if path.is_file() and ".safetensors" not in path.name and path.name != PROBE_FILE:
            shutil.copy2(path, tmp / path.name)
    save_file(mean, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    record = {"run": str(Path(run).resolve()), "versions": [int(v) for v in versions]}
    (tmp / AVERAGE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
