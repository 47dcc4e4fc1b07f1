"""Data-parallel learner ranks on torch.distributed (gloo on CPU, NCCL on CUDA).

R ranks each hold a replica of the policy; an update batch is dealt to them (``learner.shard_batch``: the
same mini-batches as one rank, balanced by action tokens) and every rank runs ``Learner.update_shard`` on its
shard. What makes the R-rank update the single-rank update (up to float rounding):

- **Batch-global loss counts.** Every optimizer step's loss is divided by the counts of the *whole* step
  (token-mean: N_tok; sequence-mean modes: B; Dr. GRPO: T_max), never by a rank's. The ranks all-gather the
  step's row lengths (a few integers per row) and rebuild the step's full action mask, so
  ``Algorithm.aggregation`` sees exactly the mask one rank would see: N_tok and B are summed and T_max is the
  maximum over the ranks, and an algorithm's own aggregation gets the same. With its shard's own count a rank
  would weigh its tokens by 1 / N_shard: the gradient would change with the split, and SPO++'s advantages,
  which have zero mean under the token measure of the whole batch (Eq. 6), would not have it on a shard.
- **Summed gradients.** Each rank back-propagates its micro-batches into its own ``.grad`` (plain gradient
  accumulation), then one bucketed all-reduce per optimizer step *sums* the ranks' gradients (each rank's
  loss is already divided by the global counts, so the sum is the batch's gradient; DDP's average would be
  1/R of it). The norm is clipped on the summed gradient and every rank takes the same AdamW step.
  ``DistributedDataParallel`` is not used: it reduces during the backward of every micro-batch unless each is
  wrapped in ``no_sync``, it averages, it deadlocks a rank whose shard holds no row of a mini-batch, and it
  renames the module's parameters (``module.``) under the trainer's save, probe and checkpoint code. One
  reduction after accumulation does the same communication as DDP with ``no_sync`` (DDP would overlap it with
  the last micro-batch's backward, a small gain next to the update).
- **Equal replicas.** Rank 0's trainable weights are broadcast when the ranks build their learners;
  checkpoints are loaded on every rank. Rank 0 saves, publishes and checkpoints.

Launch (``DistributedLearner``): the trainer's process is rank 0; it starts ranks 1..R-1, each hosting a
``LearnerRank`` (a plain class, ``LearnerRank(rank, world_size, init_method, spec)``), and ships each its
shard per update through a ``RankHandle``: by default a spawned process (``ProcessRank`` running
``serve_rank``) reached over a pipe; another launcher (Ray actors) passes its own ``start_rank``. The
single-stream runtime stays in rank 0; with replicas only ``Learner.update`` and ``load_state_dict`` involve
the other ranks. SAO's critic trains on rank 0 alone.

**FSDP** (``LearnerConfig.sharding="fsdp"``): each rank holds 1/R of every weight, gradient and Adam moment
(FSDP2 ``fully_shard``, ``fully_shard_policy``: one unit per decoder layer, the embeddings, final norm and
head in the root unit), for full fine-tuning of a model that one device cannot hold with its optimizer. The
update is the replicated one (the same batch-global counts; the gradients are reduce-scattered as sums in
every backward instead of all-reduced once per step). What sharding changes:

- **Every forward and backward is a collective** (it gathers each unit's shards), so in each phase -- the
  old log-probs, each optimizer step -- all ranks run as many as the busiest: a rank with fewer micro-batches
  runs filler forwards on a two-token row, backpropagating 0 x its log-prob (no gradient, no metric).
- **Rank 0 cannot run the policy alone**, so the trainer's forwards outside the update run on all ranks: the
  publication probe (``token_logprobs``, the same sequence on every rank) and SPO's rescoring
  (``episode_logprobs``: the trajectories dealt to the ranks, the results gathered in order).
- **Saves use the full state, gathered to rank 0's CPU** (``torch.distributed.checkpoint.state_dict`` with
  ``full_state_dict=True, cpu_offload=True``), as verl and OpenRLHF gather full weights to publish to their
  inference engines: ``save_policy`` writes the full model the engines load; ``state_dict`` is exactly a
  single rank's checkpoint (the Adam moments keyed by parameter index), so a checkpoint resumes under either
  sharding and any number of ranks; ``load_state_dict`` broadcasts rank 0's state and each rank keeps its
  shard. Rank 0's CPU holds the full weights and moments while a checkpoint is written. Per-rank sharded
  checkpoints (DCP ``save``) would avoid that but tie a checkpoint to its layout.
- **LoRA is refused**: the point of FSDP is a fully fine-tuned model (an adapter's optimizer state is small;
  with LoRA, replicate the model), and a published LoRA policy is an adapter, not the full weights gathered
  here. ``finetune="auto"`` means full fine-tuning under FSDP.

The methods rank 0 calls on every rank for this (``state_dict``, ``save_policy``, ``episode_logprobs``,
``token_logprobs`` of ``LearnerRank``) travel through ``RankHandle.send`` like ``update``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from streamrl.algorithms.learner import Learner, LearnerConfig, Shard, shard_batch

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from streamrl.agents.trajectory import Trajectory
    from streamrl.algorithms.base import Algorithm, Episode

Backend = Literal["auto", "gloo", "nccl"]
T = TypeVar("T")

BUCKET_ELEMENTS = 1 << 24
"""Gradient elements per all-reduce (64 MiB of fp32): one flat copy of a bucket at a time, not of the model."""


def uses_cuda(device: str) -> bool:
    """Whether a learner on ``device`` (``LearnerConfig.device``: ``"auto"``, ``"cpu"``, ``"cuda[:N]"``) runs on
    CUDA. Its ranks' backend follows it (NCCL on CUDA, gloo on the CPU), not whether the machine has a GPU: a CPU
    learner on a GPU machine needs gloo, which NCCL's CUDA-only collectives cannot replace."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


class RankGroup:
    """This process's place among ``world_size`` learner ranks: torch.distributed's default process group."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        *,
        backend: Backend = "auto",
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        """Join the group (blocks until all ``world_size`` ranks have joined). ``init_method``: a
        torch.distributed URL every rank can reach, e.g. ``tcp://HOST:PORT`` (rank 0 listens there).
        ``backend``: ``"auto"`` = NCCL when CUDA is available, else gloo. ``timeout``: how long a collective
        may wait for the other ranks."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process: a process holds one learner rank"
            )
        self.rank = rank
        self.world_size = world_size
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        dist.init_process_group(
            self.backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` over the ranks, in place, in flat buckets of at most ``BUCKET_ELEMENTS``."""
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            _unflatten_into(flat, bucket)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with rank ``src``'s, in place."""
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, src)
            _unflatten_into(flat, bucket)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, at most ``BUCKET_ELEMENTS`` each (a larger one alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if (
            out
            and size + t.numel() <= BUCKET_ELEMENTS
            and (out[-1][0].dtype, out[-1][0].device) == (t.dtype, t.device)
        ):
            out[-1].append(t)
            size += t.numel()
        else:
            out.append([t])
            size = t.numel()
    return out


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def parameter_digest(learner: Learner) -> str:
    """SHA-256 of the learner's trainable weights (bytes, in parameter order): equal on equal replicas. With
    FSDP, of the full weights (a collective: every rank calls it at once)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for p in learner.params:
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class FSDPRoot(torch.nn.Module):
    """The root FSDP unit around a policy: ``root(fn, *args)`` runs ``fn(policy, *args)``.

    FSDP gathers a unit's shards in its module's forward hooks. The learner does not call the policy's own
    ``forward``: it runs the decoder and then the output head on the selected positions only
    (``selected_token_logprobs``), which would bypass the hooks of a root unit on the policy. Any function of
    the policy run through this module's forward has the root's shards (embeddings, final norm, head: tied
    weights stay in one unit) gathered, and their gradients reduced, as a plain forward would."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = fn(self.policy, *args, **kwargs)
        # FSDP hooks the outputs for the backward; an output that is a view would lose the hook to an in-place
        # op (FSDP warns): return copies (a few values per token, next to a forward)
        if isinstance(out, tuple):
            return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in out)
        return out.clone() if isinstance(out, torch.Tensor) else out


def fully_shard_policy(model: torch.nn.Module, group: RankGroup, device: torch.device) -> FSDPRoot:
    """Shard ``model`` over ``group`` with FSDP2 (``fully_shard``) and make every rank's weights rank 0's.

    Units: every module whose class is in the model's ``_no_split_modules`` (Hugging Face's decoder layers:
    one layer's full weights exist at a time in a forward or backward), then the root (``FSDPRoot``). The
    shards move to ``device``. Gradients are reduce-scattered as sums, not averages (each rank's loss is
    already divided by the batch's counts), with plain SUM reductions, which gloo has. Rank 0's state dict
    (taken before sharding, on its own device) is then broadcast and each rank keeps its shard: the replicas'
    starting point is rank 0's, as with replication."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    full = dict(model.state_dict()) if group.rank == 0 else {}
    mesh = init_device_mesh(device.type, (group.world_size,))
    units = set(getattr(model, "_no_split_modules", None) or ())
    for module in reversed(list(model.modules())):  # inner units first
        if type(module).__name__ in units:
            fully_shard(module, mesh=mesh)
    root = FSDPRoot(model)
    fully_shard(root, mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # 1.0 would be a PREMUL_SUM, which gloo lacks
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    return root


def _algorithm_fields(algorithm: Algorithm) -> dict[str, Any]:
    return {f.name: getattr(algorithm.config, f.name) for f in fields(algorithm.config)}


# ---------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner rank needs to build its replica; picklable, the same for every rank."""

    model_dir: str
    """The starting model (a resolved Hugging Face directory; rank 0's weights overwrite the others')."""
    config: LearnerConfig
    pad_token_id: int
    total_steps: int
    temperature: float = 1.0
    algorithm: str = "spo++"
    """The algorithm class (``TrainConfig.algo``: a registry name, ``module:Class`` or ``file.py:Class``); its
    config comes with each update. The ranks build it without ``setup``: its ``aggregation`` and
    ``policy_loss`` must not need what ``setup`` builds (true of SPO, SPO++, GRPO and SAO)."""
    threads: int = 1
    """torch threads of the rank's process."""


class LearnerRank:
    """One learner rank (rank >= 1) of a ``DistributedLearner``: joins the group, builds its replica and
    trains the shards rank 0 gives it. A plain class so any launcher can host it (``serve_rank`` here)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        spec: LearnerSpec,
        *,
        device: str | None = None,
        backend: Backend = "auto",
        timeout: timedelta = timedelta(minutes=30),
        before_join: Callable[[], None] | None = None,
    ) -> None:
        """``device``: this rank's device (e.g. ``"cuda:1"``); ``None``: ``spec.config.device``.
        ``before_join``: called with the model loaded, just before joining the group (what can fail has
        failed by then: ``serve_rank`` tells rank 0, which joins only after every rank has)."""
        from streamrl.agents.models import load_model
        from streamrl.algorithms.base import algorithm_class

        torch.set_num_threads(spec.threads)
        self.algorithm_class = algorithm_class(spec.algorithm)
        self._algorithm: Algorithm | None = None
        config = spec.config if device is None else replace(spec.config, device=device)
        if config.device.startswith("cuda:"):
            torch.cuda.set_device(torch.device(config.device))  # NCCL's object collectives use it
        model = load_model(spec.model_dir)
        if before_join is not None:
            before_join()
        if backend == "auto":
            backend = "nccl" if uses_cuda(config.device) else "gloo"
        self.group = RankGroup(rank, world_size, init_method, backend=backend, timeout=timeout)
        self.learner = Learner(
            model,
            config,
            pad_token_id=spec.pad_token_id,
            total_steps=spec.total_steps,
            temperature=spec.temperature,
            group=self.group,
        )

    def update(self, shard: Shard, algorithm_config: dict[str, Any]) -> dict[str, float]:
        """``Learner.update_shard`` with the algorithm built from ``algorithm_config`` (its config's fields)."""
        algorithm = self._algorithm
        if algorithm is None or _algorithm_fields(algorithm) != algorithm_config:
            cls = self.algorithm_class
            algorithm = self._algorithm = cls(cls.config_class(**algorithm_config))
        return self.learner.update_shard(shard, algorithm)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)

    def digest(self) -> str:
        return parameter_digest(self.learner)

    # With FSDP, rank 0's learner calls on all ranks at once (``DistributedLearner``):

    def state_dict(self) -> None:
        """Take part in gathering the full state to rank 0."""
        self.learner.state_dict()

    def save_policy(self, directory: str) -> None:
        """Take part in gathering the full weights to rank 0, which writes them to ``directory``."""
        self.learner.save_policy(directory)

    def episode_logprobs(self, trajectories: list[Trajectory]) -> list[torch.Tensor]:
        """``Learner.episode_logprobs`` of this rank's share of the trajectories."""
        return self.learner.episode_logprobs(trajectories)

    def token_logprobs(self, sequence: list[int]) -> list[float]:
        return self.learner.token_logprobs(sequence)

    def close(self) -> None:
        self.group.close()


def serve_rank(
    conn: Connection, rank: int, world_size: int, init_method: str, spec: LearnerSpec, device: str | None
) -> None:
    """A rank's process: host a ``LearnerRank`` and run the ``(method, args)`` calls rank 0 sends on ``conn``,
    answering ``("ok", result)`` or ``("error", traceback)``; ``None`` or a closed pipe ends it.

    After an error it leaves the group at once: the other ranks' collectives then fail instead of waiting.
    Ctrl-C is ignored: it is the trainer's to handle (it stops after the current update and checkpoints).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = LearnerRank(
            rank,
            world_size,
            init_method,
            spec,
            device=device,
            before_join=lambda: conn.send(("loaded", None)),
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.send(("ready", None))
        while True:
            try:
                message = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if message is None:
                return
            method, args = message
            try:
                result = getattr(worker, method)(*args)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                return
            conn.send(("ok", result))
    finally:
        worker.close()


def deal(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of ``sizes`` dealt to ``ranks`` parts: largest first, each to the part with the smallest total so
    far (ties: the lowest part); each part ascending. Deterministic."""
    parts: list[list[int]] = [[] for _ in range(ranks)]
    totals = [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (totals[r], r))
        parts[r].append(i)
        totals[r] += sizes[i]
    return [sorted(part) for part in parts]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this machine's address ``host`` now (for rank 0's ``tcp://HOST:PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RankHandle(Protocol):
    """Rank 0's line to another rank (a spawned process here; a Ray actor elsewhere).

    ``receive`` answers, in order: ``("loaded", None)`` when the rank is about to join the group (rank 0 joins
    only then, so a rank that cannot start fails fast instead of leaving rank 0 waiting in the rendezvous),
    ``("ready", None)`` once its learner is built, then one ``("ok", result)`` or ``("error", traceback)`` per
    ``send``; it raises ``RuntimeError`` when the rank is gone.
    """

    rank: int

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        """Call ``LearnerRank.<method>(*args)`` on the rank, without waiting."""

    def receive(self) -> tuple[str, Any]: ...

    def failure(self, timeout: float) -> str | None:
        """Why the rank stopped, if it stops within ``timeout`` seconds (its error, or its exit); else ``None``."""

    def close(self) -> None:
        """Stop the rank."""


RankStarter = Callable[[int, int, str, LearnerSpec, "str | None"], RankHandle]
"""``(rank, world_size, init_method, spec, device) -> RankHandle``: how ``DistributedLearner`` starts a rank."""


class ProcessRank:
    """A rank in a spawned process (``serve_rank``), reached over a pipe (``RankHandle``)."""

    def __init__(
        self, rank: int, world_size: int, init_method: str, spec: LearnerSpec, device: str | None
    ) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self.rank = rank
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=serve_rank,
            args=(child, rank, world_size, init_method, spec, device),
            name=f"streamrl-learner-rank-{rank}",
            daemon=True,
        )
        self.process.start()
        child.close()

    def _gone(self) -> RuntimeError:
        return RuntimeError(
            f"learner rank {self.rank} exited (code {self.process.exitcode}) without an answer"
        )

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        try:
            self.conn.send((method, args))
        except OSError:  # BrokenPipeError: the rank is gone
            raise self._gone() from None

    def receive(self) -> tuple[str, Any]:
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise self._gone()
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):  # closed or reset: the rank is gone
            raise self._gone() from None
        return status, value

    def failure(self, timeout: float) -> str | None:
        self.process.join(timeout)  # a rank that failed leaves at once (serve_rank)
        if self.process.is_alive():
            return None
        try:
            if self.conn.poll():
                status, value = self.conn.recv()
                if status == "error":
                    return str(value)
        except (EOFError, OSError):
            pass
        return f"exited (code {self.process.exitcode})"

    def close(self) -> None:
        """Ask the rank to stop; a rank still running after 30 s is terminated."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.conn.close()


# ---------------------------------------------------------------------------------------------------------
# Rank 0
# ---------------------------------------------------------------------------------------------------------


class DistributedLearner(Learner):
    """The ``Learner`` of rank 0 of ``ranks`` data-parallel ranks (module doc), in the trainer's process.

    It starts ranks 1..R-1 (``start_rank``; default: spawned processes on this machine), each a
    ``LearnerRank`` on its own device (``cuda:r`` when the learner runs on CUDA, else the CPU), and drives
    them: ``update`` deals the batch, ships each rank its shard and trains its own; ``load_state_dict`` loads a
    checkpoint on every rank. With replicas everything else (saving, publishing, scoring, ``state_dict``) is
    rank 0's alone: the replicas are equal. With FSDP those run on every rank too (module doc). ``close``
    stops the ranks.
    """

    def __init__(
        self,
        model: Any,
        spec: LearnerSpec,
        ranks: int,
        *,
        init_method: str | None = None,
        start_rank: RankStarter = ProcessRank,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        """``model``: rank 0's policy (its weights are broadcast to the ranks); ``spec``: what the other ranks
        build theirs from. ``init_method``: default ``tcp://127.0.0.1:<a free port>`` (ranks on this machine)."""
        from streamrl.algorithms.base import algorithm_class

        if ranks < 1:
            raise ValueError(f"learner ranks must be >= 1, got {ranks}")
        self._algorithm_class = algorithm_class(spec.algorithm)
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        cuda = uses_cuda(spec.config.device)
        if cuda and start_rank is ProcessRank and torch.cuda.device_count() < ranks:
            raise ValueError(f"{ranks} learner ranks need {ranks} GPUs, {torch.cuda.device_count()} visible")
        self._ranks: list[RankHandle] = []
        self.group = None
        try:
            for rank in range(1, ranks):
                self._ranks.append(
                    start_rank(rank, ranks, init_method, spec, f"cuda:{rank}" if cuda else None)
                )
            self._expect("loaded")
            config = replace(spec.config, device="cuda:0") if cuda else spec.config
            try:
                group = RankGroup(0, ranks, init_method, backend="nccl" if cuda else "gloo", timeout=timeout)
                super().__init__(
                    model,
                    config,
                    pad_token_id=spec.pad_token_id,
                    total_steps=spec.total_steps,
                    temperature=spec.temperature,
                    group=group,
                )
            except RuntimeError as exc:
                failure = self._rank_failure()
                if failure is None:
                    raise
                raise failure from exc
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    def update(
        self, episodes: Sequence[Episode], advantages: Sequence[float | torch.Tensor], algorithm: Algorithm
    ) -> dict[str, float]:
        """``Learner.update`` on all ranks: deal the batch (``shard_batch``), ship the shards, train rank 0's."""
        if type(algorithm) is not self._algorithm_class:
            raise ValueError(
                f"the learner ranks were started for {self._algorithm_class.__qualname__}, "
                f"not {type(algorithm).__qualname__}"
            )
        assert self.group is not None
        shards = shard_batch(episodes, advantages, self.group.world_size, self.config.mini_batches)
        config = _algorithm_fields(algorithm)
        metrics, _ = self._on_all(
            "update",
            [(shard, config) for shard in shards[1:]],
            partial(self.update_shard, shards[0], algorithm),
        )
        return metrics

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a checkpoint on every rank. With FSDP the weights and optimizer state travel by broadcast
        from rank 0 (only the small rest is sent to each rank), checked here before the ranks wait for it."""
        if not self.sharded:
            super().load_state_dict(state)
            for handle in self._ranks:
                handle.send("load_state_dict", (state,))
            self._results()
            return
        self.check_state_dict(state)
        rest = {**state, "weights": {}, "optimizer": {} if state["steps"] else state["optimizer"]}
        self._on_all("load_state_dict", self._same(rest), partial(super().load_state_dict, state))

    # With FSDP every forward and every gather of the full state is a collective: these run on all ranks.

    def state_dict(self) -> dict[str, Any]:
        """The full state (``Learner.state_dict``); with FSDP gathered from every rank's shards."""
        if not self.sharded:
            return super().state_dict()
        return self._on_all("state_dict", self._same(), super().state_dict)[0]

    def save_policy(self, directory: str | os.PathLike[str]) -> Path:
        """``Learner.save_policy``; with FSDP the full weights are gathered to rank 0, which writes them."""
        if not self.sharded:
            return super().save_policy(directory)
        return self._on_all(
            "save_policy", self._same(str(directory)), partial(super().save_policy, directory)
        )[0]

    def episode_logprobs(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
        """``Learner.episode_logprobs``; with FSDP the trajectories are dealt to the ranks (longest first to
        the rank with the fewest tokens), each scores its share, and rank 0 puts them back in order."""
        if not self.sharded:
            return super().episode_logprobs(trajectories)
        assert self.group is not None
        parts = deal([sum(len(s) for s in t.sequences) for t in trajectories], self.group.world_size)
        shares = [[trajectories[i] for i in part] for part in parts]
        mine, theirs = self._on_all(
            "episode_logprobs",
            [(share,) for share in shares[1:]],
            partial(super().episode_logprobs, shares[0]),
        )
        out: list[torch.Tensor] = [torch.empty(0)] * len(trajectories)
        for part, values in zip(parts, [mine, *theirs], strict=True):
            for i, v in zip(part, values, strict=True):
                out[i] = v
        return out

    def token_logprobs(self, sequence: Sequence[int]) -> list[float]:
        """``Learner.token_logprobs``; with FSDP every rank runs the same forward (rank 0's answer is kept)."""
        if not self.sharded:
            return super().token_logprobs(sequence)
        return self._on_all(
            "token_logprobs", self._same(list(sequence)), partial(super().token_logprobs, sequence)
        )[0]

    def digests(self) -> list[str]:
        """Every rank's ``parameter_digest``, in rank order: all equal while the replicas agree."""
        for handle in self._ranks:
            handle.send("digest", ())
        return [parameter_digest(self), *self._results()]

    def close(self) -> None:
        """Stop the other ranks and leave the group."""
        for handle in self._ranks:
            handle.close()
        self._ranks = []
        if self.group is not None:
            self.group.close()
            self.group = None

    def _same(self, *args: Any) -> list[tuple[Any, ...]]:
        """The same ``args`` for every other rank (``_on_all``)."""
        return [args] * len(self._ranks)

    def _on_all(
        self, method: str, args: Sequence[tuple[Any, ...]], mine: Callable[[], T]
    ) -> tuple[T, list[Any]]:
        """Call ``LearnerRank.<method>(*args[r - 1])`` on every other rank r and ``mine()`` here, at once (so
        that they meet in their collectives); this rank's result, and the others' in rank order. A rank that
        fails takes the call down with its error."""
        for handle, rank_args in zip(self._ranks, args, strict=True):
            handle.send(method, rank_args)
        try:
            result = mine()
        except RuntimeError as exc:
            failure = self._rank_failure()
            if failure is None:
                raise
            raise failure from exc
        return result, self._results()

    def _rank_failure(self) -> RuntimeError | None:
        """After a collective of rank 0 failed: the error of the rank that took it down, if one stopped."""
        for handle in self._ranks:
            why = handle.failure(timeout=5.0)
            if why is not None:
                return RuntimeError(f"learner rank {handle.rank} failed:\n{why}")
        return None

    def _results(self) -> list[Any]:
        out = []
        for handle in self._ranks:
            status, value = handle.receive()
            if status != "ok":
                raise RuntimeError(f"learner rank {handle.rank} failed:\n{value}")
            out.append(value)
        return out

    def _expect(self, what: str) -> None:
        for handle in self._ranks:
            status, value = handle.receive()
            if status != what:
                raise RuntimeError(f"learner rank {handle.rank} failed to start:\n{value}")
