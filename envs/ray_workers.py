"""Ray env workers: the sub-envs of a :class:`~streamrl.envs.vector.StreamingVectorEnv` as Ray actors.

``VectorEnvConfig(backend="ray")`` hosts each worker's sub-envs in a Ray actor, on whichever node of the
cluster Ray places it (``ray_actor_options`` says what it needs: ``{"num_cpus": 1}`` by default, a node
label, ...). Everything else is the vector env's, whatever the backend: the deadlines (``step_timeout``,
``reset_timeout``, ``start_timeout``), the replacement of a dead or hung worker, and the exactly-once
return of every episode it held, marked ``truncated`` with ``info["error"]``.

:class:`RayWorker` implements the ``EnvWorker`` interface of :mod:`streamrl.envs.vector_workers`:

- the actor wraps the same :class:`~streamrl.envs.vector_workers.EnvHost` as a worker process (``start``
  builds the envs and answers the :class:`~streamrl.envs.vector_workers.WorkerHello`; ``execute`` runs one
  :class:`~streamrl.envs.vector_workers.Command`); a synchronous actor runs one caller's calls in the order
  they were submitted, the FIFO the vector env relies on;
- ``submit`` keeps each call's object ref in a deque, ``fetch`` takes the finished prefix of that deque, and
  ``wait`` is ``ray.wait`` on the head of each worker's deque (a worker's calls finish in order);
- a dead actor (killed, crashed, its node lost) fails its pending refs with ``RayActorError``: ``fetch``
  raises :class:`~streamrl.envs.vector_workers.WorkerLost`, and the vector env replaces the worker. An actor
  that dies while idle is noticed at its next call (a process worker's pipe tells at once); the episodes it
  held come back the same way. Any other error of a call (e.g. an observation Ray cannot serialize) is an
  error reply for that call only, as in a worker process;
- ``kill`` is ``ray.kill``: the actor's process ends; what its envs started exits with it (the tool sandbox
  watches its parent). ``rss_bytes`` reads the actor's memory when it runs on this node (``max_rss_mb``);
  on other nodes Ray's own memory monitor is what guards a node.

Actors start with ``OMP_NUM_THREADS=1`` (envs need no threads; many share a node).
:func:`streamrl.utils.ray.connect` joins a cluster (``ray.init``) unless this process already did.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle
import psutil
from streamrl.envs.vector_workers import (
    Command,
    EnvFactory,
    EnvHost,
    EnvWorker,
    Reply,
    WorkerHello,
    WorkerLost,
)
from streamrl.utils.ray import node_address, require_ray

__all__ = ["DEFAULT_ACTOR_OPTIONS", "RayWorker"]

DEFAULT_ACTOR_OPTIONS: Mapping[str, Any] = {
    "num_cpus": 1,
    "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}},
}
"""Options every worker actor gets unless ``VectorEnvConfig.ray_actor_options`` overrides them."""


class EnvActor:
    """The actor behind a :class:`RayWorker` (made remote with ``ray.remote`` when first used)."""

    def __init__(self) -> None:
        self._host: EnvHost | None = None

    def start(self, parent_path: Sequence[str], blob: bytes) -> tuple[WorkerHello, str]:
        """Build the envs (``blob``: the pickled factories); the hello says why when they cannot be built.
        ``parent_path``: the caller's ``sys.path``, put first (as the process backend does), so factories
        pickled by reference resolve; on another node only the entries that exist there matter."""
        sys.path[:] = list(dict.fromkeys([*parent_path, *sys.path]))
        try:
            self._host = EnvHost(cloudpickle.loads(blob))
        except BaseException as exc:  # reported to the vector env, which raises WorkerStartError
            hello = WorkerHello(
                pid=os.getpid(), error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
            )
            return hello, node_address()
        return self._host.hello(), node_address()

    def execute(self, command: Command) -> Reply:
        assert self._host is not None, "execute before start"
        return self._host.execute(command)

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None


@functools.cache
def _remote_actor_class() -> Any:
    return require_ray().remote(EnvActor)


class RayWorker(EnvWorker):
    """A worker whose sub-envs live in a Ray actor (see the module doc); ``actor_options`` are laid over
    :data:`DEFAULT_ACTOR_OPTIONS` (``actor.options(**...)``: resources, scheduling, runtime env)."""

    hello: WorkerHello | None

    def __init__(
        self, index: int, factories: Sequence[EnvFactory], actor_options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(index, factories)
        ray = require_ray()
        self._ray = ray
        # Restarts and retries are the vector env's business: Ray must not re-run an env call on its own.
        options = {**DEFAULT_ACTOR_OPTIONS, **(actor_options or {}), "max_restarts": 0, "max_task_retries": 0}
        self._actor = _remote_actor_class().options(**options).remote()
        self._hello_ref: Any = self._actor.start.remote(list(sys.path), cloudpickle.dumps(self.factories))
        self._pending: deque[tuple[Any, Command]] = deque()  # (object ref, command), in submission order
        self._lost: str | None = None
        self._node: str | None = None
        self._psutil: psutil.Process | None = None

    def __repr__(self) -> str:
        return f"RayWorker({self.index}, actor={self._actor!r})"

    @property
    def actor(self) -> Any:
        """The Ray actor handle (e.g. for ``ray.kill`` in a chaos test)."""
        return self._actor

    # -- commands ---------------------------------------------------------------------------------------
    def submit(self, command: Command) -> None:
        if self._lost is not None:
            raise WorkerLost(self._lost)
        self._pending.append((self._actor.execute.remote(command), command))

    def fetch(self) -> list[Reply]:
        if self._lost is not None:
            raise WorkerLost(self._lost)
        ray = self._ray
        if self.hello is None:
            if not ray.wait([self._hello_ref], timeout=0)[0]:
                return []
            try:
                hello, self._node = ray.get(self._hello_ref)
                self.hello = hello
            except ray.exceptions.RayActorError as exc:
                self._lost = self._death_reason(exc)
                raise WorkerLost(self._lost) from None
        replies: list[Reply] = []
        if self._pending:
            refs = [ref for ref, _ in self._pending]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            while self._pending and self._pending[0][0] in ready:
                ref, command = self._pending.popleft()
                try:
                    replies.append(ray.get(ref))
                except ray.exceptions.RayActorError as exc:
                    self._lost = self._death_reason(exc)
                    break
                except ray.exceptions.RayError as exc:  # this call failed, the actor lives on
                    replies.append(
                        Reply(
                            slot=command.slot,
                            seq=command.seq,
                            kind=command.kind,
                            error=f"the Ray call failed: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                            traceback=str(exc),
                        )
                    )
        # Replies that made it out before a death are real: hand them over first; the next fetch raises.
        if self._lost is not None and not replies:
            raise WorkerLost(self._lost)
        return replies

    def _death_reason(self, exc: BaseException) -> str:
        first = str(exc).strip().splitlines()
        why = next((line.strip() for line in reversed(first) if line.strip()), type(exc).__name__)
        return f"worker {self.index} (Ray actor, pid {self.pid}) died: {why}"

    @classmethod
    def wait(cls, workers: Sequence[EnvWorker], timeout: float | None) -> list[EnvWorker]:
        ray = require_ray()
        ready: list[EnvWorker] = []
        heads: dict[Any, RayWorker] = {}
        for w in workers:
            if not isinstance(w, RayWorker):
                continue
            if w._lost is not None:
                ready.append(w)
            elif w.hello is None:
                heads[w._hello_ref] = w
            elif w._pending:
                heads[w._pending[0][0]] = w  # a worker's calls finish in order: its head finishes first
        if not heads:
            return ready
        refs = list(heads)
        done = ray.wait(refs, num_returns=1, timeout=0 if ready else timeout)[0]
        if done:  # everything else that is ready now comes along
            done = ray.wait(refs, num_returns=len(refs), timeout=0)[0]
        return ready + [heads[ref] for ref in done]

    # -- process ----------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None if self.hello is None else self.hello.pid

    def rss_bytes(self) -> int | None:
        if self.pid is None or self._node is None or self._node != _this_node():
            return None
        try:
            if self._psutil is None:
                self._psutil = psutil.Process(self.pid)
            return int(self._psutil.memory_info().rss)
        except (psutil.Error, ValueError):
            return None

    def kill(self) -> None:
        """``ray.kill`` the actor (its pending calls fail); the worker is never used again."""
        with contextlib.suppress(Exception):  # already dead, or Ray already shut down at exit
            self._ray.kill(self._actor, no_restart=True)
        if self._lost is None:
            self._lost = f"worker {self.index} (Ray actor, pid {self.pid}) was killed by the vector env"
        self._pending.clear()

    def close(self, timeout: float) -> None:
        """Ask the actor to close its envs, wait up to ``timeout`` seconds, then kill it."""
        if self._lost is None and self._ray.is_initialized():
            with contextlib.suppress(Exception):  # a dead actor, or the timeout: it is killed either way
                self._ray.get(self._actor.close.remote(), timeout=max(timeout, 0.001))
        self.kill()
        self._lost = f"worker {self.index} is closed"


@functools.cache
def _this_node() -> str:
    try:
        return node_address()
    except Exception:  # no Ray connection: nothing is local then
        return socket.gethostname()
