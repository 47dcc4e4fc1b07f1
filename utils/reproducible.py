"""Builds that write the same bytes on every x86-64 CPU: a function run in a fresh interpreter on torch's and
MKL's AVX2 kernels.

A CPU float result depends on the kernel that computed it: torch picks its vectorized kernels (random number
generation, reductions, elementwise maths) and MKL its BLAS code path by the CPU's instruction set, so the
same seeded initialisation or training run writes other bytes on an AVX-512 CPU than on an AVX2 one, and
AVX-512 paths differ between CPU models. ``ATEN_CPU_CAPABILITY=avx2`` and ``MKL_CBWR=AVX2`` pin both to the
AVX2 path that every x86-64 CPU since 2013 has; each library reads its variable once, at its first kernel,
so a build that must be reproducible runs in a new interpreter started with them
(``run_in_reproducible_interpreter``), whatever the caller's own variables.

Used by the ``tiny`` model's build (``streamrl.agents.models``) and by SFT checkpoint builds
(``streamrl.sft``). Where the path cannot be taken (no AVX2, not x86-64) the build says so by name
before any work: refused where the caller asked for bit-identity, else built on this CPU's own kernels with
a warning.
"""

from __future__ import annotations

import os
import pickle
import platform
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["REPRODUCIBLE_KERNELS", "on_reproducible_kernels", "run_in_reproducible_interpreter"]

REPRODUCIBLE_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
"""The variables a reproducible build's interpreter starts with: torch's CPU kernels and MKL's BLAS take their
AVX2 code paths."""


def on_reproducible_kernels() -> bool:
    """Whether this interpreter started with ``REPRODUCIBLE_KERNELS`` and torch took its AVX2 kernels."""
    import torch

    started_with = all(os.environ.get(k) == v for k, v in REPRODUCIBLE_KERNELS.items())
    return started_with and torch.backends.cpu.get_cpu_capability() == "AVX2"


def run_in_reproducible_interpreter(
    function: str,
    args: tuple[Any, ...],
    *,
    what: str,
    required: bool,
    log: Callable[[str], None] = print,
) -> None:
    """Call ``function`` (``"module:name"``) with ``args`` (picklable) and ``log=`` a line printer in a new
    interpreter started with ``REPRODUCIBLE_KERNELS``, forwarding its output line by line to ``log``.

    ``what`` names the build in messages. If torch does not take its AVX2 kernels there, the call is refused
    before any work when ``required`` (a ``RuntimeError`` naming the kernels torch runs), else logged and made
    on this CPU's own kernels. The cache root travels as ``STREAMRL_CACHE``, so the build reads and writes the
    caller's cache. A failed call raises ``RuntimeError`` with the end of its output.
    """
    from streamrl.utils.cache import cache_root

    with tempfile.TemporaryDirectory(prefix="streamrl-build-") as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(pickle.dumps((function, args, what, required)))
        env = {**os.environ, **REPRODUCIBLE_KERNELS, "STREAMRL_CACHE": str(cache_root())}
        code = "from streamrl.utils.reproducible import _child; _child()"
        tail: deque[str] = deque(maxlen=40)
        with subprocess.Popen(
            [sys.executable, "-c", code, str(job)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as child:
            assert child.stdout is not None
            for line in child.stdout:
                tail.append(line.rstrip("\n"))
                log(tail[-1])
            returncode = child.wait()
    if returncode != 0:
        details = "\n".join(tail)
        raise RuntimeError(f"the build of {what} failed in its interpreter (exit {returncode}):\n{details}")


def _child() -> None:
    """Entry point of ``run_in_reproducible_interpreter``'s interpreter: check the kernel path, then call."""
    import importlib

    import torch

    function, args, what, required = pickle.loads(Path(sys.argv[1]).read_bytes())
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        cause = (
            f"torch runs its {capability} kernels under ATEN_CPU_CAPABILITY=avx2 on this {platform.machine()} "
            "CPU, so it cannot take the AVX2 kernel path that reproducible builds (and the shipped checkpoints) "
            "use"
        )
        if required:
            print(
                f"reproducible build of {what} refused: {cause}, and its weights would differ from theirs. "
                "Build on an x86-64 CPU with AVX2, or on this CPU's own kernels: `streamrl sft --native-kernels` "
                "(sft_checkpoint(..., reproducible=False)).",
                flush=True,
            )
            raise SystemExit(2)
        print(f"warning: {cause}; building {what} on this CPU's own kernels (other bytes).", flush=True)
    module, _, name = function.partition(":")
    getattr(importlib.import_module(module), name)(*args, log=lambda line: print(line, flush=True))
