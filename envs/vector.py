"""Streaming vector env: first-ready results from many text envs, with timeouts and no lost episodes.

Single-stream RL exists because agent episodes take very different times; a lock-step vector env (every
sub-env steps together, Gymnasium's ``AsyncVectorEnv``) reintroduces the wait it removes. Here the caller
sends actions to whichever sub-envs it has actions for and receives whichever results are ready, each
tagged with its env id, episode id and step count (PufferLib's ``send``/``recv``)::

    from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

    venv = StreamingVectorEnv.from_env("streamrl/ALFWorld-v0", num_envs=8,
                                       config=VectorEnvConfig(step_timeout=60, max_rss_mb=2048))
    venv.reset_async(range(8))
    while training:
        for r in venv.recv():                   # at least one result; the fast sub-envs come first
            if r.done:                          # terminated, truncated, or a failed worker (r.error)
                finish(r); venv.reset_async([r.env_id], options={"task_id": next_task()})
            else:
                venv.send([r.env_id], [agent_action(r.obs)])
    venv.close()

Group seeding (GRPO: G sub-envs on one task) is a broadcast of the same reset options:
``venv.reset_async(group_env_ids, options={"task_id": t})`` (and ``seeds=s`` broadcasts one seed).

Sub-env state machine (:class:`SubEnvState`); a call that does not fit raises at once, naming the env::

    NEEDS_RESET --reset_async--> RESETTING --recv--> READY --send--> STEPPING --recv--> READY
         ^                                             |                          |
         +--------- recv delivers a final result ------+--------------------------+
    READY --reset_async--> RESETTING  (abandons the running episode: the caller's choice)
    NEEDS_RESET --send--> RESETTING   (only with autoreset NEXT_STEP/SAME_STEP; the action is ignored)

Fault tolerance. Every call crossing the process boundary has a deadline (``step_timeout``,
``reset_timeout``, ``start_timeout``). An env that builds data on first use (ALFWorld generates a split's
games) does so once, in the parent, before any worker starts, when its registered class has a
``prepare_data(**kwargs)`` (``EnvFactory.prepare``): a worker's start timeout covers building its envs, not making
their data. A worker that crashes, is killed, hangs past its deadline or grows past ``max_rss_mb`` is killed
(with its process group) and replaced, and every episode it held comes back exactly once as a result with
``truncated=True`` and ``info["error"]`` / ``info["error_kind"]``: episodes with
a call in flight come back from ``recv``; an episode that was waiting for an action comes back as the
result of the next ``send`` to that env (its step never runs). An exception inside ``env.step``/``reset``
comes back the same way with the worker's traceback in ``info["traceback"]``. With ``strict=True`` every
failure is raised in the parent instead, Gymnasium-style (:class:`SubEnvError`, with the worker's traceback
and chained to the env's own exception); the worker is still replaced, so the env stays usable.
``close()`` reaps every worker; so does garbage collection and interpreter exit.

Workers (``streamrl.envs.vector_workers``): subprocesses by default, in-process for debugging, or Ray
actors anywhere in a cluster (``backend="ray"``, ``streamrl.envs.ray_workers``); all three implement the
``EnvWorker`` interface documented there, and the deadlines, replacement and exactly-once rules above are
this module's, the same for each. Results cross the process boundary as pickles; the parent's overhead is
one pipe round trip per call with worker processes (its cost: ``docs/benchmarks.md``, the vector env row).

:class:`LockstepVectorEnv` is a ``gymnasium.vector.VectorEnv`` over the same workers for code that wants
Gymnasium's batched ``step``/``reset``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, TypeAlias

import gymnasium as gym
import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from streamrl.envs.vector_workers import (
    Command,
    EnvFactory,
    EnvWorker,
    InProcessWorker,
    Reply,
    SubprocessWorker,
    WorkerLost,
)

__all__ = [
    "AutoresetMode",
    "EnvFactory",
    "EnvResult",
    "LockstepVectorEnv",
    "ResetNeededError",
    "StreamingVectorEnv",
    "SubEnvError",
    "SubEnvState",
    "VectorEnvConfig",
    "WorkerStartError",
]

EnvFactoryLike: TypeAlias = EnvFactory | str | Callable[[], gym.Env]
ErrorKind = Literal["exception", "timeout", "crash", "memory"]


# --------------------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VectorEnvConfig:
    """How sub-envs are hosted and guarded. Every field has a safe default.

    Attributes:
        backend: ``"subprocess"`` (default: one process per worker, timeouts and memory limits enforced),
            ``"inprocess"`` (run in the caller, for tests and debugging; no timeouts, no memory limit) or
            ``"ray"`` (one Ray actor per worker, on any node of the cluster this process joined; timeouts
            enforced, memory limits for actors on this node; ``streamrl.envs.ray_workers``).
        start_method: ``"spawn"`` (default): each worker is a fresh interpreter that does not re-import
            the caller's ``__main__`` (no ``__main__`` guard needed, none of the script's imports paid);
            ``"forkserver"``: ``multiprocessing``'s forkserver, faster restarts but needs the guard.
            ``"fork"`` is refused: forking a process that holds threads (torch, tokenizers, vLLM) can
            deadlock the child.
        envs_per_worker: sub-envs hosted by one worker; they share its process and run one call at a time,
            so a crash or hang of the worker ends all of their episodes. Default 1.
        autoreset_mode: ``DISABLED`` (default: the caller decides when an episode starts), or Gymnasium's
            ``NEXT_STEP`` / ``SAME_STEP`` (https://farama.org/Vector-Autoreset-Mode). Declared in
            ``metadata["autoreset_mode"]``.
        step_timeout: seconds one ``env.step`` may run before its worker is declared hung and replaced
            (``None`` = wait forever). Default 300.
        reset_timeout: the same for ``env.reset``. Default 300.
        start_timeout: seconds a worker may take to start and build its envs. Default 120.
        max_rss_mb: resident memory (MiB) above which a worker is replaced (``None`` = no limit). Checked
            with psutil every ``memory_check_interval`` seconds while the caller waits in ``recv``.
        memory_check_interval: seconds between RSS checks. Default 0.1.
        strict: re-raise every sub-env failure in the parent as :class:`SubEnvError` instead of returning
            a truncated result (Gymnasium's behaviour). Default ``False``.
        close_timeout: seconds ``close()`` lets workers close their envs before killing them. Default 10.
        max_start_failures: a worker slot whose replacement dies this many times in a row before it is
            up raises :class:`WorkerStartError` instead of retrying forever. Default 3.
        ray_actor_options: ``backend="ray"`` only: options of each worker's actor (``actor.options(**...)``:
            resources such as ``{"num_cpus": 0.5}``, scheduling, runtime env), laid over
            ``streamrl.envs.ray_workers.DEFAULT_ACTOR_OPTIONS`` (one CPU, ``OMP_NUM_THREADS=1``).
    """

    backend: Literal["subprocess", "inprocess", "ray"] = "subprocess"
    start_method: Literal["spawn", "forkserver"] = "spawn"
    envs_per_worker: int = 1
    autoreset_mode: AutoresetMode | str = AutoresetMode.DISABLED
    step_timeout: float | None = 300.0
    reset_timeout: float | None = 300.0
    start_timeout: float = 120.0
    max_rss_mb: float | None = None
    memory_check_interval: float = 0.1
    strict: bool = False
    close_timeout: float = 10.0
    max_start_failures: int = 3
    ray_actor_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in ("subprocess", "inprocess", "ray"):
            raise ValueError(f"backend must be 'subprocess', 'inprocess' or 'ray', got {self.backend!r}")
        if self.ray_actor_options and self.backend != "ray":
            raise ValueError(f"ray_actor_options apply to backend='ray' only, got backend={self.backend!r}")
        if self.start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver', got {self.start_method!r} "
                "('fork' is unsafe in a process that holds threads)"
            )
        if self.envs_per_worker < 1:
            raise ValueError(f"envs_per_worker must be >= 1, got {self.envs_per_worker}")
        try:
            mode = AutoresetMode(self.autoreset_mode)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in AutoresetMode)
            raise ValueError(f"autoreset_mode must be one of {valid}, got {self.autoreset_mode!r}") from None
        object.__setattr__(self, "autoreset_mode", mode)
        for name in ("step_timeout", "reset_timeout", "max_rss_mb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        for name in ("start_timeout", "memory_check_interval", "close_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_start_failures < 1:
            raise ValueError(f"max_start_failures must be >= 1, got {self.max_start_failures}")


class SubEnvState(Enum):
    """Where one sub-env is in its life; see the module docstring for the transitions."""

    NEEDS_RESET = "needs_reset"  # no episode running (never reset, or the last one ended)
    RESETTING = "resetting"  # reset in flight or its result not yet received
    READY = "ready"  # episode running, waiting for an action
    STEPPING = "stepping"  # step in flight or its result not yet received
    CLOSED = "closed"


@dataclass
class EnvResult:
    """One result of one sub-env: a reset (``step == 0``) or a step (``step >= 1``, counted per episode).

    ``episode_id`` is unique within the vector env and assigned when the reset is requested, so results of
    an episode can be grouped even across worker restarts. With ``SAME_STEP`` autoreset, a final step's
    ``obs``/``info`` already belong to the next episode (Gymnasium's layout: ``info["final_obs"]``,
    ``info["final_info"]``) and ``next_episode_id`` names it. A failure result has ``truncated=True``,
    ``reward=0``, the last observation the caller saw (``""`` for a failed reset), and ``info["error"]``,
    ``info["error_kind"]`` (``exception`` / ``timeout`` / ``crash`` / ``memory``) and, for exceptions,
    ``info["traceback"]``; its ``error`` field repeats ``info["error"]`` and is ``None`` on every other
    result (an env's own info keys cannot be mistaken for a failure).
    """

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    env_id: int
    episode_id: int
    step: int
    next_episode_id: int | None = None
    error: str | None = None  # set only on failure results (also in info["error"])
    env_seconds: float = 0.0
    """Wall time the sub-env itself spent in this ``reset``/``step`` (SAME_STEP's extra reset included),
    measured in its worker: the rest of the time a caller waited is the vector env's and the OS's."""

    @property
    def done(self) -> bool:
        """The episode ended (terminated or truncated, failures included)."""
        return self.terminated or self.truncated

    @property
    def is_reset(self) -> bool:
        return self.step == 0


class SubEnvError(RuntimeError):
    """A sub-env failed in ``strict`` mode. Carries ``env_id``, ``error_kind`` and the worker's traceback."""

    def __init__(self, message: str, env_id: int, error_kind: ErrorKind, traceback: str | None) -> None:
        full = message if traceback is None else f"{message}\n\nWorker traceback:\n{traceback}"
        super().__init__(full)
        self.env_id = env_id
        self.error_kind = error_kind
        self.traceback = traceback


class ResetNeededError(RuntimeError):
    """``send`` to a sub-env that has no running episode while autoreset is disabled."""


class WorkerStartError(RuntimeError):
    """A worker could not build its envs (the env factory raised) or kept dying while starting."""


# --------------------------------------------------------------------------------------------------------
# Parent-side bookkeeping
# --------------------------------------------------------------------------------------------------------


@dataclass
class _SubEnv:
    env_id: int
    worker: int
    slot: int
    state: SubEnvState = SubEnvState.NEEDS_RESET
    episode_id: int = -1
    step: int = 0
    last_obs: Any = ""
    pending_seq: int | None = None  # the call in flight, if any
    lost: tuple[ErrorKind, str] | None = None  # its worker died while the episode awaited an action


@dataclass
class _WorkerBook:
    worker: EnvWorker
    env_ids: list[int]
    spawned_at: float
    up: bool = False  # hello received
    inflight: deque[tuple[int, Command]] = field(default_factory=deque)  # FIFO, as the worker runs them
    head_since: float = 0.0  # when the head of ``inflight`` started running (approximately)
    start_failures: int = 0


def _close_workers(workers: list[EnvWorker], timeout: float) -> None:
    """Close every worker within ``timeout`` seconds in total; kill the rest. Used by close() and by the
    finalizer that runs on garbage collection and at interpreter exit (before multiprocessing joins)."""
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.close(max(0.0, deadline - time.monotonic()))
        except Exception:  # keep reaping the others
            w.kill()
    workers.clear()


# --------------------------------------------------------------------------------------------------------
# The streaming vector env
# --------------------------------------------------------------------------------------------------------


class StreamingVectorEnv:
    """Sub-envs behind workers; ``send``/``recv`` and ``reset_async`` stream results first-ready.

    Args:
        env_fns: one factory per sub-env: a registered gym id, a zero-argument callable returning a
            ``gym.Env``, or an :class:`EnvFactory`. All sub-envs must share observation and action spaces.
        config: hosting and fault-tolerance settings (:class:`VectorEnvConfig`).

    Attributes: ``num_envs``, ``single_observation_space``, ``single_action_space``, ``metadata`` (with
    ``"autoreset_mode"``), ``render_mode``, ``config``, ``restarts`` (workers replaced so far).

    Raises :class:`WorkerStartError` (here or, for a replacement worker, from ``recv``) when a worker
    cannot build its envs: the factory raised (the worker's traceback is in the message) or the worker
    kept dying before it was up. One thread drives an instance; it holds no locks.
    """

    def __init__(self, env_fns: Sequence[EnvFactoryLike], config: VectorEnvConfig | None = None) -> None:
        self.config = config if config is not None else VectorEnvConfig()
        factories = [EnvFactory.coerce(f) for f in env_fns]
        if not factories:
            raise ValueError("env_fns is empty; pass one env factory per sub-env")
        self.num_envs = len(factories)
        prepared: list[EnvFactory] = []
        for factory in factories:  # first-use data, once, before any worker's start_timeout runs
            if factory not in prepared:
                factory.prepare()
                prepared.append(factory)
        self.autoreset_mode: AutoresetMode = AutoresetMode(self.config.autoreset_mode)
        self.closed = False
        self.restarts = 0
        self._seq = 0
        self._next_episode = 0
        self._ready: dict[int, EnvResult] = {}  # results not yet delivered, in arrival order
        self._exceptions: dict[int, BaseException] = {}  # env id -> exception behind its ready result
        self._last_memory_check = 0.0

        per = self.config.envs_per_worker
        self._factories = [factories[i : i + per] for i in range(0, self.num_envs, per)]
        self._subs = [_SubEnv(env_id=i, worker=i // per, slot=i % per) for i in range(self.num_envs)]
        self._workers: list[EnvWorker] = []  # mutated in place: the finalizer holds this very list
        self._books: list[_WorkerBook] = []
        self._finalizer = multiprocessing.util.Finalize(
            self, _close_workers, args=(self._workers, self.config.close_timeout), exitpriority=10
        )
        try:
            for index in range(len(self._factories)):
                self._books.append(self._spawn(index))
            self._await_hellos()
        except BaseException:
            self.close()
            raise

        hello = self._books[0].worker.hello
        assert hello is not None
        self.single_observation_space: gym.Space = hello.observation_spaces[0]
        self.single_action_space: gym.Space = hello.action_spaces[0]
        for book in self._books:
            assert book.worker.hello is not None
            for env_id, obs_space, act_space in zip(
                book.env_ids,
                book.worker.hello.observation_spaces,
                book.worker.hello.action_spaces,
                strict=True,
            ):
                if obs_space != self.single_observation_space or act_space != self.single_action_space:
                    self.close()
                    raise ValueError(
                        f"sub-env {env_id} has spaces ({obs_space}, {act_space}) but sub-env 0 has "
                        f"({self.single_observation_space}, {self.single_action_space}); all sub-envs "
                        "must share observation and action spaces"
                    )
        self.metadata: dict[str, Any] = {**hello.metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode = hello.render_mode
        self._names = sorted({f.name for f in factories})

    @classmethod
    def from_env(
        cls, env: EnvFactoryLike, num_envs: int, config: VectorEnvConfig | None = None, **env_kwargs: Any
    ) -> StreamingVectorEnv:
        """``num_envs`` copies of one env: ``from_env("streamrl/MathTIR-v0", 8, split="test")``."""
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if env_kwargs:
            if not isinstance(env, str):
                raise ValueError("env_kwargs apply to a registered gym id only; bind them into the callable")
            factory = EnvFactory(env_id=env, kwargs=env_kwargs)
        else:
            factory = EnvFactory.coerce(env)
        return cls([factory] * num_envs, config)

    def __repr__(self) -> str:
        return f"StreamingVectorEnv({', '.join(self._names)}, num_envs={self.num_envs}, backend={self.config.backend})"

    # -- queries ----------------------------------------------------------------------------------------
    def state(self, env_id: int) -> SubEnvState:
        """The state of sub-env ``env_id``."""
        return self._subs[self._check_ids([env_id], calls=False)[0]].state

    def env_ids(self, state: SubEnvState) -> list[int]:
        """All sub-envs in ``state`` (e.g. ``READY``: those waiting for an action)."""
        return [s.env_id for s in self._subs if s.state == state]

    @property
    def num_pending(self) -> int:
        """Calls sent whose results ``recv`` has not delivered yet."""
        return sum(s.state in (SubEnvState.RESETTING, SubEnvState.STEPPING) for s in self._subs)

    def worker_pids(self) -> list[int | None]:
        """Process id of each worker (``None`` in-process), e.g. for monitoring or chaos tests."""
        return [book.worker.pid for book in self._books]

    def worker_of(self, env_id: int) -> int:
        """Index of the worker hosting ``env_id``."""
        return self._subs[self._check_ids([env_id], calls=False)[0]].worker

    # -- the streaming API ------------------------------------------------------------------------------
    def reset_async(
        self,
        env_ids: Iterable[int],
        seeds: int | Sequence[int | None] | None = None,
        options: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[int]:
        """Start a new episode in each of ``env_ids``; results come back through :meth:`recv`.

        ``seeds``: ``None``, one int given to every listed env (the same task for a GRPO group), or one
        seed per env. ``options``: one mapping broadcast to every listed env (e.g. ``{"task_id": t}``) or
        one per env. A sub-env still running an episode abandons it. Returns the new episode ids.
        """
        ids = self._check_ids(env_ids)
        seed_list = self._per_env(seeds, ids, "seeds", (int, np.integer))
        option_list = self._per_env(options, ids, "options", Mapping)
        for i in ids:
            if self._subs[i].state in (SubEnvState.RESETTING, SubEnvState.STEPPING):
                raise AlreadyPendingCallError(
                    f"sub-env {i} is busy ({self._subs[i].state.value}); recv() its result before resetting it",
                    self._subs[i].state.value,
                )
        episode_ids = []
        for i, seed, opts in zip(ids, seed_list, option_list, strict=True):
            sub = self._subs[i]
            sub.lost = None  # the caller abandons that episode explicitly
            seed = None if seed is None else int(seed)
            episode_ids.append(
                self._submit(sub, Command("reset", sub.slot, self._next_seq(), seed=seed, options=opts))
            )
        return episode_ids

    def send(self, env_ids: Iterable[int], actions: Sequence[Any]) -> None:
        """Step each of ``env_ids`` with the matching action; results come back through :meth:`recv`.

        Each env must be ``READY`` (or ``NEEDS_RESET`` with autoreset on, in which case this call resets
        it and the action is ignored, as in Gymnasium's NEXT_STEP mode). Either all calls are sent or,
        on a bad argument, none.
        """
        self._send(self._check_ids(env_ids), actions)

    def _send(self, ids: list[int], actions: Sequence[Any]) -> None:
        """:meth:`send` for already checked ``ids``."""
        if len(actions) != len(ids):
            raise ValueError(
                f"got {len(actions)} actions for {len(ids)} env ids {ids}; pass one action per env"
            )
        for i in ids:
            state = self._subs[i].state
            if state in (SubEnvState.RESETTING, SubEnvState.STEPPING):
                raise AlreadyPendingCallError(
                    f"sub-env {i} is busy ({state.value}); recv() its result before sending to it again",
                    state.value,
                )
            if state == SubEnvState.NEEDS_RESET and self.autoreset_mode == AutoresetMode.DISABLED:
                raise ResetNeededError(
                    f"sub-env {i} has no running episode; call reset_async([{i}]) first "
                    "(or use autoreset_mode NEXT_STEP / SAME_STEP)"
                )
        same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
        for i, action in zip(ids, actions, strict=True):
            sub = self._subs[i]
            if sub.state == SubEnvState.NEEDS_RESET:  # autoreset: this call starts the next episode
                self._submit(sub, Command("reset", sub.slot, self._next_seq()))
            elif sub.lost is not None:  # the worker died while this episode waited for the action
                kind, message = sub.lost
                sub.lost = None
                sub.state = SubEnvState.STEPPING
                sub.step += 1
                self._ready[i] = self._failure(sub, kind, message)
            else:
                cmd = Command(
                    "step", sub.slot, self._next_seq(), action=action, same_step_autoreset=same_step
                )
                self._submit(sub, cmd)

    def recv(self, timeout: float | None = None, min_ready: int = 1) -> list[EnvResult]:
        """Results of whichever sub-envs finished, fastest first: waits until ``min_ready`` are ready (or
        ``timeout`` seconds pass) and returns every result ready by then, possibly an empty list on timeout.

        Raises ``NoAsyncCallError`` when nothing is pending, and :class:`SubEnvError` in strict mode.
        """
        self._check_open()
        pending = self.num_pending
        if pending == 0:
            raise NoAsyncCallError("recv() with no call pending; send() or reset_async() first", "recv")
        if not 1 <= min_ready <= pending:
            raise ValueError(f"min_ready must be between 1 and the {pending} pending calls, got {min_ready}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._ready) < min_ready:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            self._pump(remaining)
        if any(book.inflight for book in self._books):
            self._pump(0.0)  # everything else that is ready now comes along
        return self._deliver(list(self._ready))

    def reset(
        self,
        env_ids: Iterable[int] | None = None,
        seeds: int | Sequence[int | None] | None = None,
        options: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
        timeout: float | None = None,
    ) -> list[EnvResult]:
        """:meth:`reset_async` (all sub-envs by default) and wait for those results, in ``env_ids`` order.
        Results of other sub-envs that arrive meanwhile stay queued for :meth:`recv`."""
        ids = list(range(self.num_envs)) if env_ids is None else self._check_ids(env_ids)
        self.reset_async(ids, seeds=seeds, options=options)
        return self._wait_for(ids, timeout)

    def step(
        self, env_ids: Iterable[int], actions: Sequence[Any], timeout: float | None = None
    ) -> list[EnvResult]:
        """:meth:`send` and wait for those results, in ``env_ids`` order (others stay queued for recv)."""
        ids = self._check_ids(env_ids)
        self._send(ids, actions)
        return self._wait_for(ids, timeout)

    def close(self) -> None:
        """Close every sub-env and reap every worker (killing those that do not close within
        ``config.close_timeout``). Pending results are dropped. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for sub in self._subs:
            sub.state = SubEnvState.CLOSED
        self._ready.clear()
        self._finalizer()  # runs _close_workers once and unregisters it

    def __enter__(self) -> StreamingVectorEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: argument checks --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(f"{self!r} is closed")

    def _check_ids(self, env_ids: Iterable[int], *, calls: bool = True) -> list[int]:
        """Validate ``env_ids``; ``calls=False`` for read-only queries, which also work after close()."""
        if calls:
            self._check_open()
        if isinstance(env_ids, int | np.integer):
            raise TypeError(
                f"env_ids must be an iterable of ints, got the single int {env_ids}; use [{env_ids}]"
            )
        ids = list(env_ids)
        for i in ids:
            if not isinstance(i, int | np.integer) or isinstance(i, bool) or not 0 <= i < self.num_envs:
                raise ValueError(f"env id {i!r} is not valid; valid ids are the ints 0..{self.num_envs - 1}")
        ids = [int(i) for i in ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"env ids {ids} repeat an id; each sub-env takes one call at a time")
        return ids

    @staticmethod
    def _per_env(value: Any, ids: list[int], name: str, single: type | tuple[type, ...]) -> list[Any]:
        """Broadcast one value (``None`` or a ``single``) to every env in ``ids``, or check a per-env list."""
        if value is None or isinstance(value, single):
            return [value] * len(ids)
        if isinstance(value, Sequence) and not isinstance(value, str):
            if len(value) != len(ids):
                raise ValueError(f"{name} has {len(value)} entries for {len(ids)} env ids {ids}")
            for v in value:
                if v is not None and not isinstance(v, single):
                    raise TypeError(
                        f"{name} entry {v!r} has type {type(v).__name__}; expected {single} or None"
                    )
            return list(value)
        raise TypeError(f"{name}={value!r}: expected None, one {single} for all envs, or one per env")

    # -- internals: submitting --------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _submit(self, sub: _SubEnv, command: Command) -> int:
        """Send ``command`` for ``sub`` and move it to RESETTING / STEPPING. Returns its episode id."""
        if command.kind == "reset":
            sub.episode_id, sub.step = self._next_episode, 0
            self._next_episode += 1
            sub.state = SubEnvState.RESETTING
        else:
            sub.state = SubEnvState.STEPPING
        sub.pending_seq = command.seq
        book = self._books[sub.worker]
        if not book.inflight:
            book.head_since = time.monotonic()
        book.inflight.append((sub.env_id, command))
        try:
            book.worker.submit(command)
        except WorkerLost as lost:
            self._replace(sub.worker, "crash", lost.reason)
        return sub.episode_id

    # -- internals: receiving ---------------------------------------------------------------------------
    def _pump(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` s for worker activity, then file replies and enforce deadlines."""
        wake = self._next_deadline()
        if wake is not None:
            until = max(0.0, wake - time.monotonic())
            timeout = until if timeout is None else min(timeout, until)
        backend = type(self._books[0].worker)
        for worker in backend.wait([b.worker for b in self._books], timeout):
            self._collect(worker.index)
        self._enforce_deadlines()

    def _collect(self, index: int) -> None:
        book = self._books[index]
        try:
            replies = book.worker.fetch()
        except WorkerLost as lost:
            self._replace(index, "crash", lost.reason)
            return
        if not book.up:
            self._mark_up(book)
        for reply in replies:
            self._file(book, reply)

    def _file(self, book: _WorkerBook, reply: Reply) -> None:
        env_id, command = book.inflight.popleft()
        book.head_since = time.monotonic()
        sub = self._subs[env_id]
        if (reply.seq, reply.slot) != (command.seq, command.slot) or sub.pending_seq != command.seq:
            raise RuntimeError(  # a broken worker protocol, not an env failure: never paper over it
                f"worker {book.worker.index} answered call {reply.seq} (slot {reply.slot}) but call "
                f"{command.seq} (slot {command.slot}, env {env_id}) was next; please report this bug"
            )
        sub.pending_seq = None
        if reply.kind == "step":
            sub.step += 1
        if reply.error is not None:
            result = self._failure(sub, "exception", reply.error, reply.traceback, reply.exception)
        else:
            result = EnvResult(
                obs=reply.obs,
                reward=reply.reward,
                terminated=reply.terminated,
                truncated=reply.truncated,
                info=reply.info,
                env_id=env_id,
                episode_id=sub.episode_id,
                step=sub.step,
                env_seconds=reply.env_seconds,
            )
            if reply.autoreset:  # SAME_STEP: the next episode has already begun
                result.next_episode_id = self._next_episode
                sub.episode_id, sub.step = self._next_episode, 0
                self._next_episode += 1
        self._ready[env_id] = result

    def _failure(
        self,
        sub: _SubEnv,
        kind: ErrorKind,
        message: str,
        traceback: str | None = None,
        exception: BaseException | None = None,
    ) -> EnvResult:
        """The one result that ends ``sub``'s current episode because of a failure."""
        info: dict[str, Any] = {"error": message, "error_kind": kind}
        if traceback is not None:
            info["traceback"] = traceback
        result = EnvResult(
            obs=sub.last_obs if sub.step > 0 else "",
            reward=0.0,
            terminated=False,
            truncated=True,
            info=info,
            env_id=sub.env_id,
            episode_id=sub.episode_id,
            step=sub.step,
            error=message,
        )
        if exception is not None:  # kept out of ``info`` (which callers log or pickle); strict mode chains it
            self._exceptions[sub.env_id] = exception
        return result

    def _deliver(self, env_ids: list[int]) -> list[EnvResult]:
        """Hand the ready results of ``env_ids`` to the caller and advance their state machines.

        In strict mode a failure is raised instead, and the other results stay queued for the next recv.
        """
        if self.config.strict:
            for i in env_ids:
                failure = self._ready[i]
                if failure.error is not None:
                    cause = self._exceptions.get(i)
                    self._advance(self._ready.pop(i))
                    raise SubEnvError(
                        f"sub-env {i} (episode {failure.episode_id}) failed: {failure.error}",
                        i,
                        failure.info["error_kind"],
                        failure.info.get("traceback"),
                    ) from cause
        results = [self._ready.pop(i) for i in env_ids]
        for r in results:
            self._advance(r)
        return results

    def _advance(self, result: EnvResult) -> None:
        sub = self._subs[result.env_id]
        self._exceptions.pop(result.env_id, None)
        sub.last_obs = result.obs
        if result.done and result.next_episode_id is None:
            sub.state, sub.lost = SubEnvState.NEEDS_RESET, None  # nothing left to lose
        else:
            sub.state = SubEnvState.READY

    def _wait_for(self, ids: list[int], timeout: float | None) -> list[EnvResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(i in self._ready for i in ids):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                missing = [i for i in ids if i not in self._ready]
                raise TimeoutError(
                    f"sub-envs {missing} did not answer within {timeout} s; their results will come "
                    "through recv()"
                )
            self._pump(remaining)
        return self._deliver(ids)

    # -- internals: deadlines, memory, replacement ------------------------------------------------------
    def _call_timeout(self, command: Command) -> float | None:
        return self.config.reset_timeout if command.kind == "reset" else self.config.step_timeout

    def _next_deadline(self) -> float | None:
        if self.config.backend == "inprocess":
            return None  # nothing can be enforced without a process boundary
        times = []
        for book in self._books:
            if not book.up:
                times.append(book.spawned_at + self.config.start_timeout)
            elif book.inflight:
                limit = self._call_timeout(book.inflight[0][1])
                if limit is not None:
                    times.append(book.head_since + limit)
        if self.config.max_rss_mb is not None:
            times.append(self._last_memory_check + self.config.memory_check_interval)
        return min(times) if times else None

    def _enforce_deadlines(self) -> None:
        if self.config.backend == "inprocess":
            return
        now = time.monotonic()
        for index, book in enumerate(self._books):
            if not book.up:
                if now > book.spawned_at + self.config.start_timeout:
                    self._replace(
                        index,
                        "timeout",
                        f"worker {index} did not start within start_timeout={self.config.start_timeout} s",
                    )
                continue
            if book.inflight:
                env_id, command = book.inflight[0]
                limit = self._call_timeout(command)
                if limit is not None and now > book.head_since + limit:
                    name = "reset_timeout" if command.kind == "reset" else "step_timeout"
                    self._replace(
                        index,
                        "timeout",
                        f"sub-env {env_id}'s {command.kind} ran past {name}={limit} s; worker {index} was replaced",
                    )
        if (
            self.config.max_rss_mb is not None
            and now >= self._last_memory_check + self.config.memory_check_interval
        ):
            self._last_memory_check = now
            for index, book in enumerate(self._books):
                rss = book.worker.rss_bytes()
                if rss is not None and rss > self.config.max_rss_mb * 2**20:
                    self._replace(
                        index,
                        "memory",
                        f"worker {index} used {rss / 2**20:.0f} MiB > max_rss_mb={self.config.max_rss_mb:g}; replaced",
                    )

    def _spawn(self, index: int) -> _WorkerBook:
        factories = self._factories[index]
        per = self.config.envs_per_worker
        env_ids = list(range(index * per, index * per + len(factories)))
        worker: EnvWorker
        if self.config.backend == "subprocess":
            worker = SubprocessWorker(index, factories, self.config.start_method)
        elif self.config.backend == "ray":
            from streamrl.envs.ray_workers import RayWorker  # Ray is an optional extra

            worker = RayWorker(index, factories, self.config.ray_actor_options)
        else:
            worker = InProcessWorker(index, factories)
        if index < len(self._workers):
            self._workers[index] = worker
        else:
            self._workers.append(worker)
        return _WorkerBook(
            worker=worker, env_ids=env_ids, spawned_at=time.monotonic(), up=worker.hello is not None
        )

    def _await_hellos(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout
        backend = type(self._books[0].worker)
        while not all(b.up for b in self._books):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [b.worker.index for b in self._books if not b.up]
                raise WorkerStartError(
                    f"workers {late} did not start within start_timeout={self.config.start_timeout} s"
                )
            for worker in backend.wait([b.worker for b in self._books if not b.up], remaining):
                try:
                    worker.fetch()  # nothing was submitted yet: only the hello can arrive
                except WorkerLost as lost:
                    raise WorkerStartError(
                        f"worker {worker.index} died while starting: {lost.reason}"
                    ) from None
                self._mark_up(self._books[worker.index])

    def _mark_up(self, book: _WorkerBook) -> None:
        """Note that ``book``'s worker has built its envs, once its hello arrived; raise if it could not."""
        hello = book.worker.hello
        if hello is None:
            return
        if hello.error is not None:
            raise WorkerStartError(
                f"worker {book.worker.index} could not build its envs: {hello.error}\n\n"
                f"Worker traceback:\n{hello.traceback}"
            )
        book.up, book.start_failures, book.head_since = True, 0, time.monotonic()

    def _replace(self, index: int, kind: ErrorKind, message: str) -> None:
        """Kill worker ``index`` and start a fresh one; every episode it held ends exactly once."""
        old = self._books[index]
        old.worker.kill()
        failures = old.start_failures + (0 if old.up else 1)
        if failures >= self.config.max_start_failures:
            raise WorkerStartError(
                f"worker {index} failed {failures} times in a row before it was up (last: {message}); giving up"
            )
        self.restarts += 1
        for env_id, _ in old.inflight:  # calls in flight: their results come back now
            sub = self._subs[env_id]
            sub.pending_seq = None
            if sub.state == SubEnvState.STEPPING:
                sub.step += 1
            self._ready[env_id] = self._failure(sub, kind, message)
        for env_id in old.env_ids:
            # Episodes waiting for an action, or about to (a result not yet received), lived in the dead
            # worker: each ends with the result of its next send. A received final result clears this.
            sub = self._subs[env_id]
            if sub.state != SubEnvState.NEEDS_RESET and not any(e == env_id for e, _ in old.inflight):
                sub.lost = (kind, message)
        new = self._spawn(index)
        new.start_failures = failures
        self._books[index] = new


# --------------------------------------------------------------------------------------------------------
# The Gymnasium lock-step facade
# --------------------------------------------------------------------------------------------------------


class LockstepVectorEnv(VectorEnv):
    """``gymnasium.vector.VectorEnv`` over the streaming workers: ``step``/``reset`` move every sub-env.

    Follows Gymnasium's conventions for Text spaces: observations are a tuple of strings (the batched
    space is ``Tuple(Text, ...)``), rewards ``float64`` and terminations/truncations ``bool`` arrays of
    shape ``(num_envs,)``, infos one dict of per-env arrays with ``_key`` masks; ``reset(seed=s)`` seeds
    sub-env ``i`` with ``s + i`` and ``options["reset_mask"]`` resets a subset. The default autoreset mode
    is NEXT_STEP, as in ``AsyncVectorEnv``. Worker failures appear as ``truncated`` with
    ``infos["error"]`` (or raise, with ``strict=True``); timeouts and memory limits come from ``config``.
    """

    def __init__(self, env_fns: Sequence[EnvFactoryLike], config: VectorEnvConfig | None = None) -> None:
        self.streaming = StreamingVectorEnv(
            env_fns, config if config is not None else VectorEnvConfig(autoreset_mode=AutoresetMode.NEXT_STEP)
        )
        self.num_envs = self.streaming.num_envs
        self.autoreset_mode = self.streaming.autoreset_mode
        self.metadata = dict(self.streaming.metadata)
        self.render_mode = self.streaming.render_mode
        self.single_observation_space = self.streaming.single_observation_space
        self.single_action_space = self.streaming.single_action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._observations: list[Any] = [None] * self.num_envs

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Reset every sub-env (or those in ``options["reset_mask"]``); Gymnasium's seeding rules."""
        super().reset(seed=seed if isinstance(seed, int) else None)
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, int):
            seeds = [seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"got {len(seeds)} seeds for num_envs={self.num_envs}; pass one per sub-env")
        options = dict(options) if options is not None else {}
        mask = options.pop("reset_mask", None)
        if mask is None:
            ids = list(range(self.num_envs))
        else:
            if not isinstance(mask, np.ndarray) or mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
                raise ValueError(
                    f"options['reset_mask'] must be a bool numpy array of shape ({self.num_envs},), got {mask!r}"
                )
            if not mask.any():
                raise ValueError(f"options['reset_mask'] must select at least one sub-env, got {mask}")
            ids = [int(i) for i in np.flatnonzero(mask)]
        results = self.streaming.reset(ids, seeds=[seeds[i] for i in ids], options=options or None)
        infos: dict[str, Any] = {}
        for r in results:
            self._observations[r.env_id] = r.obs
            infos = self._add_info(infos, r.info, r.env_id)
        return tuple(self._observations), infos

    def step(
        self, actions: Sequence[Any]
    ) -> tuple[tuple[Any, ...], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-env with its action and wait for all of them."""
        actions = list(actions)
        if len(actions) != self.num_envs:
            raise ValueError(f"got {len(actions)} actions for num_envs={self.num_envs}; pass one per sub-env")
        results = self.streaming.step(range(self.num_envs), actions)
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminations = np.zeros(self.num_envs, dtype=np.bool_)
        truncations = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for r in results:
            self._observations[r.env_id] = r.obs
            rewards[r.env_id], terminations[r.env_id], truncations[r.env_id] = (
                r.reward,
                r.terminated,
                r.truncated,
            )
            infos = self._add_info(infos, r.info, r.env_id)
        return tuple(self._observations), rewards, terminations, truncations, infos

    def close_extras(self, **kwargs: Any) -> None:
        """Close the streaming env (reaps every worker; also happens on garbage collection and exit)."""
        self.streaming.close()
