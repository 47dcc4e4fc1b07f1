"""Learner ranks as Ray actors: a ``DistributedLearner`` whose ranks 1..R-1 run on any node of a Ray cluster.

``RayRanks`` is a ``RankStarter`` (``streamrl.algorithms.distributed``); the trainer uses it for
``TrainConfig(cluster="ray", learner_ranks=R)``::

    ranks = RayRanks(num_cpus=8, num_gpus=1)
    learner = DistributedLearner(policy, spec, 2, init_method=ranks.init_method(), start_rank=ranks)

- **Placement.** The first rank started reserves every rank's resources at once, in one placement group of
  R-1 bundles (``num_cpus`` CPUs and ``num_gpus`` GPUs each) with the ``PACK`` strategy: Ray puts the bundles on
  as few nodes as hold them, so NCCL traffic stays inside a node where it can, and spreads them when no node
  has room. A run starts with all its ranks placed or not at all: if the cluster cannot hold the group within
  ``start_timeout_s``, the start fails with what was asked. Rank 0 is the trainer's process, which Ray does not
  place; the group is removed when the last rank is closed.
- **Rendezvous.** torch.distributed's ``tcp://IP:PORT`` on rank 0's node, at the address Ray knows the node by
  (``init_method``; ``127.0.0.1`` would not reach it from another node). Gloo finds the interface it talks on
  from the host name, which often resolves to a loopback address (``127.0.1.1``): unless
  ``GLOO_SOCKET_IFNAME`` is set, each rank (and rank 0, in ``init_method``) sets it to the interface that holds
  its node's Ray address.
- **Devices.** A rank with ``num_gpus=1`` computes on the GPU Ray gives it (``cuda:0`` in its process, which
  sees that GPU alone) and the group is NCCL; without GPUs it computes on the CPU and the group is gloo. Rank 0
  must match: NCCL needs every rank on a GPU, so a CUDA rank 0 needs ``num_gpus=1`` and a CPU rank 0
  ``num_gpus=0`` (a ``ValueError`` says which).
- **Failures.** An actor that dies (killed, crashed, its node lost) fails the call rank 0 waits on with
  ``RuntimeError("learner rank r ... died: ...")``. Rank 0's collectives with a dead process fail at once
  (its connections close), with a node that dropped off the network at the group's timeout: the update raises. A rank is never restarted or dropped behind the run's back: its replica and the process
  group die with it, so the run stops and ``--resume`` continues from the last checkpoint with a fresh group.

A rank's process runs ``LearnerSpec.threads`` torch threads. It reads the model at ``LearnerSpec.model_dir``
(and an algorithm given as ``file.py:Class``) on its own node: on a cluster, put models (and
``$STREAMRL_CACHE``) on storage every node mounts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import psutil
from streamrl.algorithms.distributed import Backend, LearnerRank, LearnerSpec, free_port
from streamrl.utils.ray import node_address, require_ray

__all__ = ["RankActor", "RayRank", "RayRanks"]


def _pin_gloo_interface(ip: str) -> None:
    """Make gloo talk on the interface that holds ``ip`` (unless ``GLOO_SOCKET_IFNAME`` says otherwise)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


class RankActor:
    """The actor behind a ``RayRank``: hosts one ``LearnerRank`` and answers as ``serve_rank`` does.

    ``start`` builds the rank on a thread of its own and answers once the model is loaded and the rank is
    joining the group (rank 0 joins only then); ``ready`` answers once the rank's learner is built. Each call
    answers ``(status, value)``; after an error the rank leaves the group at once, so the other ranks'
    collectives fail instead of waiting, and every later call answers that error.
    """

    def __init__(self) -> None:
        self._rank: LearnerRank | None = None
        self._error: str | None = None
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None

    def start(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        spec: LearnerSpec,
        device: str,
        backend: Backend,
    ) -> tuple[str, Any]:
        import torch

        node = node_address()
        if not os.path.isdir(spec.model_dir):
            self._error = (
                f"learner rank {rank} on node {node}: no model directory {spec.model_dir}; every node must see "
                "the model (and $STREAMRL_CACHE) at the same path, e.g. on shared storage"
            )
            return "error", self._error
        _pin_gloo_interface(node)
        torch.set_num_threads(spec.threads)  # the calls after ``start`` run on this thread, not on build's

        def build() -> None:
            try:
                self._rank = LearnerRank(
                    rank,
                    world_size,
                    init_method,
                    spec,
                    device=device,
                    backend=backend,
                    before_join=self._loaded.set,
                )
            except BaseException:
                self._error = traceback.format_exc()
            finally:
                self._loaded.set()

        self._thread = threading.Thread(target=build, name=f"streamrl-learner-rank-{rank}", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._error is not None:
            return "error", self._error
        return "loaded", {"node": node, "pid": os.getpid(), "niceness": os.nice(0)}

    def ready(self) -> tuple[str, Any]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            return "error", self._error
        return "ready", None

    def call(self, method: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        """``LearnerRank.<method>(*args)``."""
        if self._error is not None:
            return "error", self._error
        assert self._rank is not None, "call before ready"
        try:
            return "ok", getattr(self._rank, method)(*args)
        except BaseException:
            self._error = traceback.format_exc()
            self._rank.close()
            return "error", self._error

    def ping(self) -> None:
        return None


@functools.cache
def _remote_rank_class() -> Any:
    return require_ray().remote(RankActor)


class RayRank:
    """A learner rank in a Ray actor (``RankActor``), reached through Ray calls (a ``RankHandle``). Started
    by ``RayRanks``, which placed it."""

    def __init__(self, rank: int, actor: Any, calls: list[Any], on_close: Callable[[RayRank], None]) -> None:
        self._ray = require_ray()
        self.rank = rank
        self.actor = actor
        """The Ray actor handle (e.g. for ``ray.kill`` in a chaos test)."""
        self.info: dict[str, Any] = {}
        """The rank's node, pid and niceness, once it answered ``loaded``."""
        self._pending: deque[Any] = deque(calls)  # answers still to be received, in order
        self._on_close = on_close

    def __repr__(self) -> str:
        return f"RayRank({self.rank}, node={self.info.get('node')}, pid={self.info.get('pid')})"

    def _died(self, exc: BaseException) -> str:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = lines[-1] if lines else type(exc).__name__
        where = (
            f" (Ray actor, node {self.info['node']}, pid {self.info['pid']})" if self.info else " (Ray actor)"
        )
        return f"learner rank {self.rank}{where} died: {why}"

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        self._pending.append(self.actor.call.remote(method, args))

    def receive(self) -> tuple[str, Any]:
        ray = self._ray
        ref = self._pending.popleft()
        try:
            status, value = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(self._died(exc)) from None
        except ray.exceptions.RayError as exc:  # the call failed in Ray (e.g. its arguments did not arrive)
            return "error", str(exc)
        if status == "loaded":
            self.info = dict(value)
            if self.info["niceness"] > os.nice(0):
                warnings.warn(
                    f"learner rank {self.rank} runs at niceness {self.info['niceness']} on node "
                    f"{self.info['node']}: the trainer's other processes would starve it. Start Ray nodes with "
                    "RAY_worker_niceness=0 (docs/scaling.md)",
                    stacklevel=2,
                )
            return status, None
        return status, value

    def failure(self, timeout: float) -> str | None:
        ray = self._ray
        calls = list(self._pending) or [self.actor.ping.remote()]
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
        for ref in ready:
            try:
                status, value = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return self._died(exc)
            except ray.exceptions.RayError as exc:
                return str(exc)
            if status == "error":
                return str(value)
        return None

    def close(self) -> None:
        """Kill the actor (its process, and with it its place in the group, ends)."""
        with contextlib.suppress(Exception):  # already dead, or Ray already shut down
            self._ray.kill(self.actor, no_restart=True)
        self._pending.clear()
        self._on_close(self)


class RayRanks:
    """Starts learner ranks as Ray actors (a ``RankStarter``: module doc)."""

    def __init__(self, *, num_cpus: float = 1.0, num_gpus: int = 0, start_timeout_s: float = 600.0) -> None:
        """``num_cpus``, ``num_gpus``: what Ray reserves for each rank (``num_gpus`` 0: CPU ranks, gloo;
        1: a GPU each, NCCL). ``start_timeout_s``: how long to wait for the cluster to place every rank."""
        if not num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0 (a learner rank computes), got {num_cpus}")
        if num_gpus not in (0, 1):
            raise ValueError(f"num_gpus must be 0 (CPU ranks) or 1 (a GPU per rank), got {num_gpus}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self._ray = require_ray()
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.start_timeout_s = start_timeout_s
        self._group: Any = None
        self._open: set[int] = set()

    def __repr__(self) -> str:
        return f"RayRanks(num_cpus={self.num_cpus}, num_gpus={self.num_gpus})"

    @property
    def placement_group(self) -> Any:
        """The placement group that holds the ranks started (``None`` before the first and after the last)."""
        return self._group

    def init_method(self) -> str:
        """``tcp://IP:PORT`` on this node (rank 0's), at the address Ray knows it by, with a free port; pins
        this process's gloo interface to it (module doc)."""
        ip = node_address()
        _pin_gloo_interface(ip)
        return f"tcp://{ip}:{free_port(ip)}"

    def __call__(
        self, rank: int, world_size: int, init_method: str, spec: LearnerSpec, device: str | None
    ) -> RayRank:
        """Start rank ``rank`` of ``world_size`` in the group's bundle ``rank - 1`` (the first call reserves the
        group). ``device``: rank 0's choice for it, ``cuda:<r>`` when rank 0 runs on CUDA, else ``None``."""
        cuda = device is not None and device.startswith("cuda")
        if cuda and not self.num_gpus:
            raise ValueError(
                "rank 0 of the learner runs on CUDA, so the group is NCCL and every rank needs a GPU: give each "
                "rank one (learner_gpus=1, --learner-gpus 1), or run the learner on the CPU (learner.device='cpu')"
            )
        if not cuda and self.num_gpus:
            raise ValueError(
                f"num_gpus={self.num_gpus} (learner_gpus) gives each learner rank a GPU, but rank 0 (this "
                "process) runs on the CPU: NCCL needs every rank on a GPU. Run the trainer where it sees a GPU, "
                "or use learner_gpus=0 for CPU ranks (gloo)"
            )
        if not 1 <= rank < world_size:
            raise ValueError(f"Ray ranks are 1..world_size-1, got rank={rank}, world_size={world_size}")
        if self._group is None:
            self._group = self._reserve(world_size - 1)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._group, rank - 1),
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(spec.threads)}},
            "max_restarts": 0,  # a rank's replica and its place in the group die with it: never restarted
            "max_task_retries": 0,
        }
        actor = _remote_rank_class().options(**options).remote()
        backend: Backend = "nccl" if cuda else "gloo"
        start = actor.start.remote(rank, world_size, init_method, spec, "cuda:0" if cuda else "cpu", backend)
        self._open.add(rank)
        return RayRank(rank, actor, [start, actor.ready.remote()], self._closed)

    def _reserve(self, bundles: int) -> Any:
        """A placement group of ``bundles`` rank bundles, placed (or an error after ``start_timeout_s``)."""
        from ray.util import placement_group, remove_placement_group

        ray = self._ray
        bundle = {"CPU": float(self.num_cpus), **({"GPU": float(self.num_gpus)} if self.num_gpus else {})}
        group = placement_group([dict(bundle) for _ in range(bundles)], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"the Ray cluster could not place {bundles} learner rank(s) of {bundle} each within "
                f"start_timeout_s={self.start_timeout_s} s (placement group, strategy PACK): it lacks the "
                f"resources (see `ray status`); lower learner_cpus / learner_gpus or add nodes"
            ) from None
        return group

    def _closed(self, handle: RayRank) -> None:
        self._open.discard(handle.rank)
        if not self._open and self._group is not None:
            from ray.util import remove_placement_group

            with contextlib.suppress(Exception):  # Ray already shut down
                remove_placement_group(self._group)
            self._group = None
