"""Env workers for :mod:`streamrl.envs.vector`: where sub-environments live and how commands reach them.

A *worker* hosts one or more sub-envs and runs the commands sent to it one at a time, in the order they
were submitted (FIFO); every command produces exactly one :class:`Reply`. Two backends here share that
contract, and a third, Ray actors, lives in :mod:`streamrl.envs.ray_workers` (Ray is an optional extra):

- :class:`InProcessWorker` runs each command in the caller's process the moment it is submitted
  (tests, debugging, ``pdb``). Env exceptions are caught exactly as in a subprocess, but a hung env hangs
  the caller and a crash takes it down: timeouts and memory limits need a process boundary.
- :class:`SubprocessWorker` (the default) runs a child process: a fresh interpreter (``spawn``, default;
  the caller's ``__main__`` is not re-imported) or a ``multiprocessing`` ``forkserver`` child. Never
  threads: the ALFWorld/TextWorld engine is not thread-safe, and only a process can be killed when it hangs.

The worker interface (cf. tianshou's ``EnvWorker``):

=====================================  ========================================================================
``submit(command)``                    queue one :class:`Command`; never blocks on the env
``fetch() -> list[Reply]``             replies available now, without blocking, in submission order;
                                       raises :class:`WorkerLost` once the worker is known to be dead
``wait(workers, timeout)``             (classmethod) the workers that have replies or have died, waiting at
                                       most ``timeout`` seconds (``ray.wait`` on the pending object refs)
``hello``                              the :class:`WorkerHello` (spaces, metadata) once the envs exist
``pid`` / ``rss_bytes()``              for memory limits and chaos tests (``None`` where not applicable)
``kill()`` / ``close(timeout)``        force-stop (the replacement path) / graceful stop, always reaping
=====================================  ========================================================================

The Ray backend (:class:`streamrl.envs.ray_workers.RayWorker`) is an actor wrapping :class:`EnvHost`
(``execute`` as its remote method; a synchronous actor runs calls in submission order), ``submit`` keeping
the returned object refs in a deque, ``fetch`` taking the finished prefix of that deque, and ``kill``
calling ``ray.kill``.

All env code on either side of the process boundary goes through :class:`EnvHost`, so the backends cannot
drift apart.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import multiprocessing
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import cloudpickle
import gymnasium as gym
import psutil

__all__ = [
    "Command",
    "EnvFactory",
    "EnvHost",
    "EnvWorker",
    "InProcessWorker",
    "Reply",
    "SubprocessWorker",
    "WorkerHello",
    "WorkerLost",
]


# --------------------------------------------------------------------------------------------------------
# Env factories
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvFactory:
    """A picklable recipe for one sub-env: a registered Gymnasium id plus ``gym.make`` kwargs, or a callable.

    ``EnvFactory("streamrl/ALFWorld-v0", {"split": "train"})`` calls ``gym.make(id, **kwargs)`` in the
    worker; ``EnvFactory(fn=make_my_env)`` calls ``fn()``. Ids of the form ``"module:Name-v0"`` import
    ``module`` first, as ``gym.make`` does. Callables travel with ``cloudpickle``, so lambdas and closures
    work with ``spawn``/``forkserver``. An unknown id fails here, in the parent, with Gymnasium's
    suggestion of close names, rather than later inside a worker. The id's registration (its
    ``gymnasium`` ``EnvSpec``) is looked up here too and travels with the factory, so a worker builds an env
    registered only in the parent (by a script's ``gym.register``, or a module imported from a file).
    """

    env_id: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    fn: Callable[[], gym.Env] | None = None
    registration: gym.envs.registration.EnvSpec | None = field(default=None, compare=False, repr=False)
    """The parent's registration of ``env_id`` (set from it; ``gym.make`` builds the env from it)."""

    def __post_init__(self) -> None:
        if (self.env_id is None) == (self.fn is None):
            raise ValueError(
                f"EnvFactory needs exactly one of env_id (a registered gym id) or fn (a callable returning an "
                f"env); got env_id={self.env_id!r}, fn={self.fn!r}"
            )
        if self.fn is not None:
            if not callable(self.fn):
                raise TypeError(f"EnvFactory.fn must be callable, got {type(self.fn).__name__}: {self.fn!r}")
            if self.kwargs:
                raise ValueError("EnvFactory.kwargs only applies to env_id; bind arguments into fn instead")
        else:
            object.__setattr__(self, "registration", _registration(str(self.env_id)))

    @classmethod
    def coerce(cls, value: EnvFactory | str | Callable[[], gym.Env]) -> EnvFactory:
        """Accept an :class:`EnvFactory`, a gym id string or a zero-argument callable."""
        if isinstance(value, EnvFactory):
            return value
        if isinstance(value, str):
            return cls(env_id=value)
        if callable(value):
            return cls(fn=value)
        raise TypeError(
            f"cannot build an env from {value!r} ({type(value).__name__}); pass a registered gym id, "
            "a zero-argument callable returning a gym.Env, or an EnvFactory"
        )

    def __call__(self) -> gym.Env:
        if self.fn is not None:
            env = self.fn()
        else:
            env = gym.make(self.registration or str(self.env_id), **dict(self.kwargs))
        if not isinstance(env, gym.Env):
            raise TypeError(f"{self!r} produced {type(env).__name__}, not a gymnasium.Env")
        return env

    def prepare(self) -> None:
        """Call the registered env class's ``prepare_data(**kwargs)`` here, when it has one (a static or class
        method: an instance method of that name is not this hook): data the env builds on first use (ALFWorld's
        generated games) is then made once, in the parent, instead of inside every worker's ``start_timeout`` (a
        worker waiting on another's generation would count it against its own start). A callable factory has no
        class to ask: it is not prepared."""
        if self.registration is None:
            return
        entry = self.registration.entry_point
        creator = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
        hook = inspect.getattr_static(creator, "prepare_data", None) if isinstance(creator, type) else None
        if isinstance(hook, (staticmethod, classmethod)):
            creator.prepare_data(**{**(self.registration.kwargs or {}), **dict(self.kwargs)})

    @property
    def name(self) -> str:
        """A short label for reprs and error messages."""
        if self.env_id is not None:
            return self.env_id
        return getattr(self.fn, "__qualname__", repr(self.fn))


def _registration(env_id: str) -> gym.envs.registration.EnvSpec:
    # Same parsing as gym.make: "pkg.module:Name-v0" imports pkg.module (which registers Name-v0).
    name = env_id
    if ":" in env_id:
        module, name = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise gym.error.Error(f"env id {env_id!r}: cannot import module {module!r} ({e})") from e
    return gym.spec(name)  # raises NameNotFound / VersionNotFound with close-match suggestions


# --------------------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------------------

CommandKind = Literal["reset", "step"]


@dataclass(frozen=True)
class Command:
    """One call to run on sub-env ``slot`` of a worker. ``seq`` is unique per vector env (sanity check).

    ``same_step_autoreset``: after a step that ends the episode, reset at once and return the reset
    observation with ``final_obs`` / ``final_info`` in the info (Gymnasium's SAME_STEP convention).
    """

    kind: CommandKind
    slot: int
    seq: int
    action: Any = None
    seed: int | None = None
    options: Mapping[str, Any] | None = None
    same_step_autoreset: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # a plain tuple on the wire: half the pickling time
        return Command, (
            self.kind,
            self.slot,
            self.seq,
            self.action,
            self.seed,
            self.options,
            self.same_step_autoreset,
        )


@dataclass
class Reply:
    """The outcome of one :class:`Command`. On an env exception ``error`` holds ``"Type: message"``,
    ``traceback`` the worker-side traceback text and ``exception`` the exception itself when it pickles."""

    slot: int
    seq: int
    kind: CommandKind
    obs: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    autoreset: bool = False  # SAME_STEP: obs/info belong to a freshly reset episode
    error: str | None = None
    traceback: str | None = None
    exception: BaseException | None = None
    env_seconds: float = 0.0  # wall time spent inside the env's reset/step

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # a plain tuple on the wire, as Command
        return Reply, tuple(getattr(self, f) for f in _REPLY_FIELDS)


_REPLY_FIELDS = tuple(f.name for f in fields(Reply))


@dataclass
class WorkerHello:
    """First message of a worker: the spaces of its envs, or why they could not be created."""

    observation_spaces: list[gym.Space] = field(default_factory=list)
    action_spaces: list[gym.Space] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    render_mode: str | None = None
    pid: int | None = None
    error: str | None = None
    traceback: str | None = None


class WorkerLost(RuntimeError):
    """The worker died (killed, crashed, exited); ``reason`` says how. Raised by ``fetch``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------------------------------------
# The env side: one object executes commands, wherever it lives
# --------------------------------------------------------------------------------------------------------


class EnvHost:
    """Owns the sub-envs of one worker and turns each :class:`Command` into a :class:`Reply`.

    Exceptions raised by ``env.reset`` / ``env.step`` never escape: they become error replies, so one
    broken env cannot take the other envs of its worker down.
    """

    def __init__(self, factories: Sequence[EnvFactory]) -> None:
        self.envs: list[gym.Env] = []
        try:
            for factory in factories:
                self.envs.append(factory())
        except BaseException:
            self.close()
            raise

    def hello(self) -> WorkerHello:
        first = self.envs[0]
        return WorkerHello(
            observation_spaces=[env.observation_space for env in self.envs],
            action_spaces=[env.action_space for env in self.envs],
            metadata=dict(first.metadata),
            render_mode=first.render_mode,
            pid=os.getpid(),
        )

    def execute(self, command: Command) -> Reply:
        env = self.envs[command.slot]
        reply = Reply(slot=command.slot, seq=command.seq, kind=command.kind)
        start = time.perf_counter()
        try:
            if command.kind == "reset":
                options = dict(command.options) if command.options is not None else None
                reply.obs, reply.info = env.reset(seed=command.seed, options=options)
            elif command.kind == "step":
                obs, reward, terminated, truncated, info = env.step(command.action)
                reply.obs, reply.reward, reply.info = obs, float(reward), info
                reply.terminated, reply.truncated = bool(terminated), bool(truncated)
                if command.same_step_autoreset and (reply.terminated or reply.truncated):
                    reset_obs, reset_info = env.reset()
                    # Gymnasium's SAME_STEP layout (gymnasium.vector.SyncVectorEnv.step).
                    reply.info = {"final_obs": obs, "final_info": info, **reset_info}
                    reply.obs, reply.autoreset = reset_obs, True
            else:
                raise ValueError(f"unknown command kind {command.kind!r}; valid kinds are 'reset', 'step'")
        except Exception as exc:  # any env failure becomes an error reply
            reply.error = f"{type(exc).__name__}: {exc}"
            reply.traceback = traceback.format_exc()
            reply.exception = exc
        reply.env_seconds = time.perf_counter() - start
        return reply

    def close(self) -> None:
        for env in self.envs:
            with contextlib.suppress(Exception):
                env.close()
        self.envs = []


# --------------------------------------------------------------------------------------------------------
# The worker interface and its two backends
# --------------------------------------------------------------------------------------------------------


class EnvWorker(ABC):
    """Hosts the sub-envs built by ``factories``; see the module docstring for the contract."""

    def __init__(self, index: int, factories: Sequence[EnvFactory]) -> None:
        self.index = index
        self.factories = list(factories)
        self.hello: WorkerHello | None = None

    @abstractmethod
    def submit(self, command: Command) -> None: ...

    @abstractmethod
    def fetch(self) -> list[Reply]: ...

    @classmethod
    @abstractmethod
    def wait(cls, workers: Sequence[EnvWorker], timeout: float | None) -> list[EnvWorker]: ...

    @property
    @abstractmethod
    def pid(self) -> int | None: ...

    @abstractmethod
    def rss_bytes(self) -> int | None: ...

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    def close(self, timeout: float) -> None: ...


class InProcessWorker(EnvWorker):
    """Runs commands synchronously in the caller's process (tests, debugging); no timeouts, no RSS limit."""

    def __init__(self, index: int, factories: Sequence[EnvFactory]) -> None:
        super().__init__(index, factories)
        self._host: EnvHost | None = EnvHost(self.factories)
        self.hello = self._host.hello()
        self._replies: deque[Reply] = deque()

    def submit(self, command: Command) -> None:
        if self._host is None:
            raise WorkerLost(f"in-process worker {self.index} is closed")
        self._replies.append(self._host.execute(command))

    def fetch(self) -> list[Reply]:
        replies = list(self._replies)
        self._replies.clear()
        return replies

    @classmethod
    def wait(cls, workers: Sequence[EnvWorker], timeout: float | None) -> list[EnvWorker]:
        # Work happens at submit time, so waiting can never make more replies appear.
        return [w for w in workers if isinstance(w, InProcessWorker) and w._replies]

    @property
    def pid(self) -> int | None:
        return None

    def rss_bytes(self) -> int | None:
        return None

    def kill(self) -> None:
        self.close(0.0)

    def close(self, timeout: float) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None


_CLOSE = "close"


class _Channel:
    """Length-prefixed pickle frames over one end of a connected stream socket (``socket.socketpair``).

    The per-step cost of the whole vector env is one round trip through this channel, so it is lean where
    ``multiprocessing.connection.Connection`` is general: a frame is sent with one ``send`` call, and the
    caller side reads *whatever has arrived* with one non-blocking ``recv`` (instead of a ``poll`` to see
    whether a message is there, then one read for its length and one for its body), buffering partial
    frames. Payloads use the plain pickler (env observations and infos need none of ``ForkingPickler``'s
    fd and connection reducers). Each syscall is a sizeable part of what a bare round trip costs
    (``benchmarks/bench_vector.py --transport`` measures it).

    One reader thread and one writer thread may use a channel at the same time (the worker's command
    reader does), never two readers.
    """

    _HEADER = struct.Struct("!Q")
    _CHUNK = 1 << 16

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._scratch = bytearray(self._CHUNK)  # recv_into it: no allocation per read
        self._view = memoryview(self._scratch)
        self._eof = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(self._HEADER.pack(len(data)) + data)

    def recv(self) -> Any:
        """The next message, blocking until it is complete; ``EOFError`` when the peer has closed."""
        while True:
            message = self._pop()
            if message is not _NOTHING:
                return message
            if self._eof:
                raise EOFError("the other end of the channel closed")
            self._read(0)

    def recv_ready(self) -> list[Any]:
        """The messages complete now, without blocking (possibly none); ``EOFError`` once the peer has
        closed and every message it sent has been returned."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            # A full chunk means more may be waiting (a large frame): keep reading until the socket is dry.
            while not self._eof and self._read(socket.MSG_DONTWAIT) == self._CHUNK:
                pass
        messages = []
        while (message := self._pop()) is not _NOTHING:
            messages.append(message)
        if not messages and self._eof:
            raise EOFError("the other end of the channel closed")
        return messages

    def _read(self, flags: int) -> int:
        n = self._sock.recv_into(self._scratch, self._CHUNK, flags)
        if n:
            self._buffer += self._view[:n]
        else:
            self._eof = True
        return n

    def _pop(self) -> Any:
        if len(self._buffer) < self._HEADER.size:
            return _NOTHING
        (size,) = self._HEADER.unpack_from(self._buffer)
        end = self._HEADER.size + size
        if len(self._buffer) < end:
            return _NOTHING
        message = pickle.loads(memoryview(self._buffer)[self._HEADER.size : end])
        del self._buffer[:end]
        return message

    def close(self) -> None:
        self._sock.close()


_NOTHING = object()


class _SpawnedProcess:
    """A fresh interpreter (``python -c``) running :func:`_spawned_main`, with the ``multiprocessing.Process``
    surface that :class:`SubprocessWorker` uses (``pid``, ``exitcode``, ``sentinel``, ``join``).

    Unlike ``multiprocessing``'s spawn and forkserver, the child does not re-import the caller's
    ``__main__``: training scripts need no ``if __name__ == "__main__"`` guard, and workers do not pay for
    the script's own imports (torch, vLLM). It starts in its own process group, so ``kill`` can reap
    whatever its envs start.
    """

    def __init__(self, index: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        code = "from streamrl.envs.vector_workers import _spawned_main; _spawned_main()"
        self._popen = subprocess.Popen(
            [sys.executable, "-c", code, str(child_sock.fileno()), str(index)],
            pass_fds=[child_sock.fileno()],
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        child_sock.close()
        self.conn = _Channel(parent_sock)
        self.pid: int | None = self._popen.pid
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # Linux >= 5.3: a waitable handle on the process
            self._pidfd = os.pidfd_open(self._popen.pid)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()  # negative = killed by that signal, as multiprocessing reports it

    @property
    def sentinel(self) -> int | None:
        return self._pidfd

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def release(self) -> None:
        """Close the process handle (after the worker is finished with it)."""
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


class _ForkserverProcess:
    """A ``multiprocessing`` forkserver child: fast to (re)start, but like every ``multiprocessing``
    start method it re-imports the caller's ``__main__`` (scripts need the ``__main__`` guard)."""

    def __init__(self, index: int, blob: bytes, buffered: bool) -> None:
        context = multiprocessing.get_context("forkserver")
        parent_sock, child_sock = socket.socketpair()
        self.conn = _Channel(parent_sock)
        self._process = context.Process(
            target=_forkserver_main,
            args=(child_sock, blob, index, buffered),
            name=f"streamrl-env-worker-{index}",
            daemon=False,  # envs may start processes of their own; daemonic processes may not
        )
        self._process.start()
        child_sock.close()
        self.pid: int | None = self._process.pid

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    @property
    def sentinel(self) -> int | None:
        return self._process.sentinel

    def join(self, timeout: float | None = None) -> None:
        self._process.join(timeout)

    def release(self) -> None:
        self._process.close()


StartMethod = Literal["spawn", "forkserver"]


class SubprocessWorker(EnvWorker):
    """A worker process running :func:`_subprocess_main`; ``start_method`` is ``"spawn"`` (a fresh
    interpreter, see :class:`_SpawnedProcess`) or ``"forkserver"``.

    The child leads its own process group, so :meth:`kill` also reaps whatever the envs started (a code
    sandbox, a game engine), and it exits by itself when the parent's end of the pipe closes.
    """

    def __init__(
        self, index: int, factories: Sequence[EnvFactory], start_method: StartMethod = "spawn"
    ) -> None:
        super().__init__(index, factories)
        blob = cloudpickle.dumps(self.factories)
        buffered = len(self.factories) > 1
        self._process: _SpawnedProcess | _ForkserverProcess
        if start_method == "spawn":
            self._process = _SpawnedProcess(index)
            # sys.path travels along (as multiprocessing does), so factories pickled by reference resolve.
            self._process.conn.send((list(sys.path), blob, buffered))
        elif start_method == "forkserver":
            self._process = _ForkserverProcess(index, blob, buffered)
        else:
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self._conn: _Channel = self._process.conn
        self._psutil: psutil.Process | None = None
        self._lost: str | None = None
        # The pipe, and the process handle where there is one (it fires on death even if a grandchild
        # inherited the pipe and keeps it open). A raw poll object: the send/recv round trip is the
        # per-step overhead of the whole vector env, and multiprocessing's wait() builds a selector per call.
        self._fds = [self._conn.fileno()]
        if self._process.sentinel is not None:
            self._fds.append(self._process.sentinel)
        self._poller = select.poll()
        for fd in self._fds:
            self._poller.register(fd, select.POLLIN)

    # -- commands ---------------------------------------------------------------------------------------
    def submit(self, command: Command) -> None:
        if self._lost is not None:
            raise WorkerLost(self._lost)
        try:
            self._conn.send(command)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            self._lost = self._death_reason(f"pipe broke on send ({type(e).__name__})")
            raise WorkerLost(self._lost) from e

    def fetch(self) -> list[Reply]:
        if self._lost is not None:
            raise WorkerLost(self._lost)
        replies: list[Reply] = []
        heard = False
        try:
            for message in self._conn.recv_ready():
                heard = True
                if isinstance(message, WorkerHello):
                    self.hello = message
                else:
                    replies.append(message)
        except (EOFError, ConnectionResetError, OSError):
            self._lost = self._death_reason("pipe closed")
        if self._lost is None and not heard and self._process.exitcode is not None:
            self._lost = self._death_reason("process gone")
        if self._lost is not None and not heard:
            raise WorkerLost(self._lost)
        # Messages that made it out before a death are real (results, or the hello saying why the envs
        # could not be built): hand them over first; the next fetch raises.
        return replies

    def _death_reason(self, how: str) -> str:
        self._process.join(timeout=1.0)
        code = self._process.exitcode
        if code is None:
            return f"worker {self.index} (pid {self._process.pid}) stopped answering: {how}"
        if code < 0:
            try:
                signame = signal.Signals(-code).name
            except ValueError:
                signame = f"signal {-code}"
            return f"worker {self.index} (pid {self._process.pid}) was killed by {signame}"
        return f"worker {self.index} (pid {self._process.pid}) exited with code {code}"

    @classmethod
    def wait(cls, workers: Sequence[EnvWorker], timeout: float | None) -> list[EnvWorker]:
        millis = None if timeout is None else max(0, math.ceil(timeout * 1000))
        if len(workers) == 1:  # the common one-worker case: its own poll object, nothing to build
            (only,) = workers
            if not isinstance(only, SubprocessWorker):
                return []
            return [only] if only._lost is not None or only._poller.poll(millis) else []
        owners: dict[int, SubprocessWorker] = {}
        ready: list[EnvWorker] = []
        for w in workers:
            if not isinstance(w, SubprocessWorker):
                continue
            if w._lost is not None:
                ready.append(w)
            else:
                owners.update(dict.fromkeys(w._fds, w))
        if ready:
            millis = 0
        poller = select.poll()
        for fd in owners:
            poller.register(fd, select.POLLIN)
        events = poller.poll(millis)
        for fd, _ in events:
            worker = owners[fd]
            if worker not in ready:
                ready.append(worker)
        return ready

    # -- process ----------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._process.pid

    def rss_bytes(self) -> int | None:
        try:
            if self._psutil is None:
                self._psutil = psutil.Process(self._process.pid)
            return int(self._psutil.memory_info().rss)
        except (psutil.Error, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and anything its envs started) and reap it."""
        pid = self._process.pid
        if pid is not None and self._process.exitcode is None:
            # The child calls setpgid(0, 0) first thing; until then its group is ours, so fall back to
            # killing the process alone rather than our own group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        self._process.join(timeout=5.0)
        if self._lost is None:
            self._lost = f"worker {self.index} (pid {pid}) was killed by the vector env"
        self._release()

    def _release(self) -> None:
        """Close the pipe and the process handle; the worker is never polled again (``_lost`` is set)."""
        with contextlib.suppress(OSError):
            self._conn.close()
        with contextlib.suppress(OSError, ValueError):
            self._process.release()

    def close(self, timeout: float) -> None:
        """Ask the envs to close, wait up to ``timeout`` seconds, then kill. Always reaps the process."""
        if self._process.exitcode is None and self._lost is None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(_CLOSE)
            self._process.join(timeout=timeout)
        if self._process.exitcode is None:
            self.kill()
        else:
            self._process.join()
            # The worker's process group may still hold grandchildren that an env failed to stop.
            if self._process.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                    os.killpg(self._process.pid, signal.SIGKILL)
        if self._lost is None:
            self._lost = f"worker {self.index} is closed"
        self._release()


def _spawned_main() -> None:
    """Entry point of a ``spawn`` worker (``python -c``): argv = [socket fd, worker index]."""
    conn = _Channel(socket.socket(fileno=int(sys.argv[1])))
    parent_path, blob, buffered = conn.recv()
    sys.path[:] = list(dict.fromkeys([*parent_path, *sys.path]))
    _subprocess_main(conn, blob, int(sys.argv[2]), buffered)


def _forkserver_main(sock: socket.socket, blob: bytes, index: int, buffered: bool) -> None:
    """Entry point of a ``forkserver`` worker (``multiprocessing`` passes the socket along)."""
    _subprocess_main(_Channel(sock), blob, index, buffered)


def _subprocess_main(conn: _Channel, blob: bytes, index: int, buffered: bool) -> None:
    """Entry point of a worker process: build the envs, then execute commands until told to close.
    ``buffered``: read commands on a thread (the worker hosts several envs)."""
    # Own process group: kill() reaps env grandchildren too, and the terminal's Ctrl-C goes to the parent
    # alone (which then closes us in order).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Parent death: exit even while an env call, or building the envs, hangs (nobody could kill us then).
    # Polling the parent pid costs nothing per step, unlike a second thread reading the pipe, and unlike
    # PR_SET_PDEATHSIG it does not fire when merely the parent *thread* that started us exits.
    parent = os.getppid()

    def watch_parent() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    try:
        host = EnvHost(cloudpickle.loads(blob))
    except BaseException as exc:  # reported to the parent, which raises
        conn.send(
            WorkerHello(
                pid=os.getpid(), error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
            )
        )
        conn.close()
        return
    conn.send(host.hello())

    next_command: Callable[[], Any] = conn.recv
    if buffered:
        # Several envs share this worker: the parent may send the next command while we send a large
        # result. A reader thread keeps the pipe drained so that both sides can never block in send()
        # at once (the two-full-pipes deadlock). Env code still runs on the main thread only.
        commands: queue.Queue[Any] = queue.Queue()

        def read_commands() -> None:
            while True:
                try:
                    commands.put(conn.recv())
                except (EOFError, OSError):
                    os._exit(0)  # parent gone: nobody will read our results

        threading.Thread(target=read_commands, name="command-reader", daemon=True).start()
        next_command = commands.get
    while True:
        try:
            command = next_command()
        except (EOFError, OSError):
            return  # parent gone
        if command == _CLOSE:
            host.close()
            return
        reply = host.execute(command)
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable obs/info must not kill the worker
            conn.send(
                Reply(
                    slot=reply.slot,
                    seq=reply.seq,
                    kind=reply.kind,
                    error=f"could not send the result to the parent: {type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc(),
                )
            )
