"""A sandbox for model-written Python: a pool of fork servers ("zygotes"), one fresh process per call.

Why a fork server: a fresh ``python -c`` per call pays the interpreter's start-up, and far more when the
snippet imports sympy; a zygote that pre-imports math/fractions/sympy/numpy once and ``fork``s a child per
call pays neither, with the same per-call isolation (docs/platform.md §7 has the costs; SimpleTIR and ToRL run each
snippet in a fresh, resource-limited process too, behind SandboxFusion).

Each zygote is *spawned* (``subprocess.Popen`` of a new interpreter with ``-I`` and a scrubbed
environment), never forked from the caller, so a process that holds torch, CUDA or threads is never
forked. What the code may do depends on :attr:`SandboxConfig.isolation`; the default, ``"namespaces"``,
gives every user -- root or not -- the same confinement:

* the zygote enters, once, a user namespace (unless it is root: an ordinary user maps only its own uid and
  gid), a mount namespace and a network namespace, and ``pivot_root``s into a tmpfs that holds read-only
  bind mounts of ``/usr``, ``/etc``, a few device nodes and the interpreter's own trees -- nothing else:
  no ``/home``, no ``$HOME``, no ``/root``, ``/mnt``, ``/srv``, ``/var``, ``/run``, ``/sys`` or project
  checkout exists for the code. The network namespace holds only a down loopback: no network, not even a
  service on 127.0.0.1;
* the zygote itself is PID 1 of a new PID namespace; per call it forks a child into a further PID
  namespace of its own. The child mounts a fresh, empty, size-limited tmpfs on ``/tmp`` (its work
  directory; ``/var/tmp`` and ``/dev/shm`` lead there) and a ``/proc`` that lists only its own processes,
  in a mount namespace that vanishes with it. When the child ends, the kernel kills everything it started,
  even processes that called ``setsid``;
* the child has stdin from ``/dev/null``, no inherited file descriptors, and an environment holding only
  ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG``; it sets rlimits on CPU time, address space, open files, file
  size, process count and core dumps;
* as root, the child switches to an unprivileged uid/gid (``nobody`` by default), which also drops every
  capability; ``RLIMIT_NPROC`` (not enforced for root) then bounds a fork bomb. In a user namespace the child
  keeps the caller's uid, drops the capabilities it held over the zygote's namespaces (``capset``), and sees
  no process of that user to signal or trace; ``RLIMIT_NPROC`` counts that uid's processes in the zygote's
  user namespace, so a fork bomb stops at the limit and dies with the call's PID namespace;
* ``PR_SET_NO_NEW_PRIVS`` is set, so no set-uid binary can regain privileges.

Where the kernel does not allow these namespaces (unprivileged user namespaces disabled, a container
without them), creating a pool fails with :class:`SandboxUnavailableError`, which names the cause and the
choices; nothing downgrades silently. ``isolation="rlimits"`` must be chosen by name (and is logged once per
process): the child then gets only rlimits, the timeout, the scrubbed environment, a private work directory
and, as root, the uid switch -- it can read and write whatever that uid can, and as an ordinary user signal
that user's processes. :attr:`SandboxPool.isolation` reports what a pool got.

The zygote enforces a wall-clock timeout (SIGKILL of the child and its group) and keeps the head and the
tail of the output. A zygote that dies is replaced transparently; :meth:`SandboxPool.close` (also run at
interpreter exit) leaves no process behind.

This module is the caller's side: the config, the results, the pool and its zygote handles, the isolation
check. What runs inside a zygote and its children (the confinement, the fork per call, the preloading) is
:mod:`streamrl.envs.sandbox_zygote`, which each zygote loads by its file path.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from streamrl.envs import sandbox_zygote
from streamrl.envs.sandbox_zygote import EXCEPTION_LINE, recv_message, send_message, truncate_middle

ToolStatus = Literal["ok", "error", "timeout", "killed"]

Isolation = Literal["namespaces", "rlimits"]
ISOLATION_MODES: tuple[Isolation, ...] = ("namespaces", "rlimits")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and pool settings of the Python tool sandbox.

    Defaults follow the measurements in docs/platform.md §7 and SimpleTIR's firejail profile
    (``rlimit as 512M, cpu 3, nproc 50``), loosened where numpy/sympy work needs room.
    """

    timeout_s: float = 5.0
    """Wall-clock limit of one call in seconds (> 0). The child and everything it started are SIGKILLed."""
    cpu_time_s: int = 5
    """RLIMIT_CPU of the child in seconds (>= 1); exceeding it is reported as a timeout."""
    memory_mb: int = 1024
    """RLIMIT_AS (virtual address space) of the child in MiB (>= 256; the preloaded zygote alone maps
    a large share of that, docs/platform.md §7). Allocations beyond it raise ``MemoryError`` inside the
    snippet."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE in MiB: the largest file the code may write."""
    max_open_files: int = 64
    """RLIMIT_NOFILE: descriptors the code may hold (>= 16)."""
    max_processes: int = 64
    """RLIMIT_NPROC of the child (>= 1): processes + threads of its uid -- as root, of the sandbox uid across
    all sandboxes; in a user namespace, of the caller's uid within that zygote's namespace. Not enforced for
    root, hence the switch to ``sandbox_uid``."""
    max_output_chars: int = 16_384
    """Captured output kept per call: the first and last ``max_output_chars // 2`` characters, with a
    marker saying how much was cut in between."""
    max_code_chars: int = 200_000
    """Longest snippet accepted; longer ones are rejected without running."""
    pool_size: int = 2
    """Zygotes in a pool = calls that can run at once (>= 1)."""
    preload: tuple[str, ...] = ("math", "fractions", "sympy", "numpy")
    """Modules the zygote imports once so calls do not pay for them."""
    sandbox_uid: int = 65534
    """Uid (and gid) the child switches to when the zygote runs as root (65534 = ``nobody``)."""
    isolation: Isolation = "namespaces"
    """``"namespaces"`` (default): each call runs in user (unless root), mount, PID and network namespaces --
    a read-only view of the system and the interpreter only, a fresh tmpfs, its own ``/proc``, no network
    -- and creating a pool fails with :class:`SandboxUnavailableError` where the kernel does not allow it.
    ``"rlimits"``: no namespaces at all; rlimits, the wall-clock timeout, a scrubbed environment, a private
    work directory and (as root) the uid switch only. The code can then read and write whatever the
    running user can and, run by an ordinary user, signal that user's processes. Choosing it is logged once
    per process. docs/platform.md §7 lists what each mode holds."""
    isolate_network: bool = True
    """In ``namespaces`` mode: give the calls a network namespace with only a down loopback (no network)."""
    isolate_pids: bool = True
    """In ``namespaces`` mode: run each call as PID 1 of a new PID namespace with its own ``/proc``, so
    nothing it starts survives and it sees no other process. Turning it off leaves the host's ``/proc``
    visible (as an ordinary user, the processes of that user could then be traced)."""
    warmup: bool = True
    """After preloading, run a small sympy/numpy workload in the zygote so that lazily imported submodules
    and sympy's caches are ready in every forked child (a child's first ``sympy.solve`` then skips that
    work; docs/platform.md §7). Costs a fraction of a second once per zygote."""
    start_timeout_s: float = 60.0
    """How long a zygote may take to start and preload before it is reported as failed."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("timeout_s", self.timeout_s > 0, "> 0"),
            ("cpu_time_s", self.cpu_time_s >= 1, ">= 1"),
            ("memory_mb", self.memory_mb >= 256, ">= 256"),
            ("max_file_mb", self.max_file_mb >= 1, ">= 1"),
            ("max_open_files", self.max_open_files >= 16, ">= 16"),
            ("max_processes", self.max_processes >= 1, ">= 1"),
            ("max_output_chars", self.max_output_chars >= 64, ">= 64"),
            ("max_code_chars", self.max_code_chars >= 1, ">= 1"),
            ("pool_size", self.pool_size >= 1, ">= 1"),
            ("sandbox_uid", self.sandbox_uid > 0, "> 0 (a non-root uid)"),
            ("start_timeout_s", self.start_timeout_s > 0, "> 0"),
            ("isolation", self.isolation in ISOLATION_MODES, f"one of {ISOLATION_MODES}"),
        ]
        for name, ok, valid in checks:
            if not ok:
                raise ValueError(
                    f"SandboxConfig.{name}={getattr(self, name)!r} is invalid; it must be {valid}"
                )


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one sandboxed call.

    ``status`` is ``"ok"`` (exit code 0), ``"error"`` (an exception, a non-zero exit, a rejected snippet),
    ``"timeout"`` (wall-clock or CPU limit) or ``"killed"`` (ended by a signal, e.g. a segfault from runaway
    recursion, or the sandbox process died). ``output`` is stdout and stderr interleaved, truncated
    head+tail; for errors it ends with the traceback or a line saying what happened.
    """

    status: ToolStatus
    output: str
    seconds: float
    returncode: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def error_summary(output: str) -> str:
    """The line of a failed call's output that says what went wrong: the last exception line
    (``ZeroDivisionError: division by zero``) -- processes that fail together may interleave their
    tracebacks -- else the last non-empty line (the sandbox's own timeout/kill note)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines else ""


_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_streamrl_sandbox_zygote', sys.argv.pop(1))\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.zygote_main()\n"
)

_ZYGOTE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One thread per BLAS/OpenMP pool: forked children must not inherit thread pools, and RLIMIT_NPROC
    # counts threads.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class _ZygoteHandle:
    """The pool's end of one zygote process: start, call, restart, stop."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.scratch: str | None = None

    def start(self) -> None:
        args = [sys.executable, "-I", "-c", _BOOTSTRAP, os.path.abspath(sandbox_zygote.__file__)]
        self.scratch = tempfile.mkdtemp(prefix="streamrl-sandbox-")
        args += [json.dumps(asdict(self.config)), self.scratch]
        # The zygote's own stderr (import errors, a crash) goes to an anonymous file we can quote; the
        # calls' output never does (children write to their own pipe).
        log = tempfile.TemporaryFile()
        # A scrubbed environment: nothing of the caller's (tokens, keys) reaches the zygote or the code.
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=dict(_ZYGOTE_ENV),
            cwd="/",
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        try:
            self.info = recv_message(
                self.proc.stdout.fileno(), time.monotonic() + self.config.start_timeout_s
            )
        except (TimeoutError, EOFError) as e:
            self.stop()
            log.seek(0)
            said = log.read()[-2000:].decode(errors="replace").strip()
            raise RuntimeError(
                f"the sandbox zygote failed to start within {self.config.start_timeout_s}s "
                f"(preload={self.config.preload!r}): {e}" + (f"\nzygote stderr:\n{said}" if said else "")
            ) from e
        finally:
            log.close()  # the zygote keeps its own descriptor
        if "error" in self.info:
            self.stop()
            raise SandboxUnavailableError(_unavailable_message(self.info["error"], self.info["cause"]))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, code: str, timeout: float) -> ToolResult:
        if not self.alive:
            self.stop()
            self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        request = {"code": code, "timeout": timeout}
        start = time.monotonic()
        try:
            try:
                send_message(self.proc.stdin.fileno(), request)
            except OSError:
                # The zygote died before it could take the request: the process we started (which waits
                # for the zygote, PID 1 of its namespace) had not exited yet when ``alive`` looked. Nothing
                # ran, so a fresh zygote takes the call.
                self.stop()
                self.start()
                assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
                start = time.monotonic()
                send_message(self.proc.stdin.fileno(), request)
            # The zygote enforces `timeout`; the margin covers fork, cleanup and a loaded machine.
            reply = recv_message(self.proc.stdout.fileno(), start + timeout + 10.0)
        except (OSError, EOFError, TimeoutError) as e:
            self.stop()  # a fresh zygote is started by the next call
            return ToolResult(
                "killed", f"Killed: the sandbox process died during the call ({e})", time.monotonic() - start
            )
        return ToolResult(reply["status"], reply["output"], reply["seconds"], reply["returncode"])

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                send_message(proc.stdin.fileno(), {"shutdown": True})
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                # Its session holds any call child still running (without a PID namespace).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


class SandboxUnavailableError(RuntimeError):
    """The kernel does not allow the isolation a :class:`SandboxConfig` asks for; the message names the
    cause and the choices (enable user namespaces, run in a container, or ``isolation="rlimits"``)."""


def _unavailable_message(error: str, cause: str) -> str:
    who = "root" if os.geteuid() == 0 else f"an ordinary user (uid {os.getuid()})"
    return (
        f"The Python tool sandbox cannot isolate model code here, running as {who}: {cause} ({error}). "
        "Without namespaces, model-written code could read and change this user's files and signal its "
        "processes, so the sandbox refuses to start. Choose one:\n"
        "  * enable unprivileged user namespaces: `sysctl -w user.max_user_namespaces=15000`; on Debian and "
        "older Ubuntu kernels also `sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu 24.04+ "
        "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile for python);\n"
        "  * run in a container that permits namespaces (e.g. as root with CAP_SYS_ADMIN, or with a seccomp "
        "profile that allows unshare);\n"
        '  * or accept rlimits-only isolation by name: SandboxConfig(isolation="rlimits") (for Math-TIR: '
        'MathTIRConfig(sandbox=SandboxConfig(isolation="rlimits"))); see docs/platform.md §7.'
    )


_logger = logging.getLogger(__name__)
_probed: dict[tuple[Any, ...], str | None] = {}
_probe_lock = threading.Lock()
_rlimits_logged = False


def check_isolation(config: SandboxConfig) -> None:
    """Raise :class:`SandboxUnavailableError` when ``config.isolation`` cannot be had on this machine.

    ``"namespaces"`` is checked by starting a zygote without preloads once per process (and uid and
    namespace settings): the same setup and first call a real zygote does, so a refusal surfaces where the
    env or pool is created, not at the first tool call. Choosing ``"rlimits"`` is logged once per process.
    """
    global _rlimits_logged
    if config.isolation == "rlimits":
        with _probe_lock:
            if _rlimits_logged:
                return
            _rlimits_logged = True
        _logger.warning(
            'Python tool sandbox: isolation="rlimits" chosen -- model code runs without namespaces, as uid %d, '
            "and can read and write what that user can (only rlimits, timeouts, a scrubbed environment and a "
            "private work directory hold)",
            config.sandbox_uid if os.geteuid() == 0 else os.geteuid(),
        )
        return
    key = (os.geteuid(), config.isolate_pids, config.isolate_network, config.sandbox_uid)
    with _probe_lock:
        if key not in _probed:
            probe = _ZygoteHandle(replace(config, preload=(), warmup=False, pool_size=1))
            try:
                probe.start()
                _probed[key] = None
            except SandboxUnavailableError as e:
                _probed[key] = str(e)
            finally:
                probe.stop()
        failure = _probed[key]
    if failure is not None:
        raise SandboxUnavailableError(failure)


_LIVE_POOLS: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool:
    """A pool of zygotes that runs Python snippets; safe to call from many threads at once.

    Zygotes start lazily (the first call that needs one pays for the preloading). A call blocks until
    a zygote is free. Use as a context manager or call :meth:`close`; pools still open at interpreter exit
    are closed by an ``atexit`` hook.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        check_isolation(self.config)
        self._idle: queue.LifoQueue[_ZygoteHandle] = queue.LifoQueue()
        for _ in range(self.config.pool_size):
            self._idle.put(_ZygoteHandle(self.config))
        self._handles = list(self._idle.queue)
        self._lock = threading.Lock()
        self._closed = False
        self._owner_pid = os.getpid()
        _LIVE_POOLS.add(self)

    def run(self, code: str, timeout: float | None = None) -> ToolResult:
        """Execute ``code`` in a fresh confined process and return what it printed.

        ``timeout`` (seconds) overrides :attr:`SandboxConfig.timeout_s` for this call.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        limit = self.config.timeout_s if timeout is None else float(timeout)
        if not limit > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if len(code) > self.config.max_code_chars:
            return ToolResult(
                "error",
                f"ValueError: code is {len(code)} characters long; the sandbox accepts at most "
                f"{self.config.max_code_chars}",
                0.0,
            )
        if self._closed:
            raise RuntimeError("this SandboxPool is closed; create a new one")
        if os.getpid() != self._owner_pid:
            raise RuntimeError("a SandboxPool cannot be used from a forked child; create one in this process")
        handle = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("this SandboxPool was closed while the call waited for a zygote")
            return handle.call(code, limit)
        finally:
            self._idle.put(handle)

    @property
    def isolation(self) -> dict[str, Any]:
        """What each call gets, as reported by a started zygote (starts one if none is running):

        * ``mode``: the :attr:`SandboxConfig.isolation` in force (``"namespaces"`` or ``"rlimits"``);
        * ``user_namespace``: the sandbox runs in a user namespace of its own (an ordinary user's pool);
        * ``pid_namespace``: each call is PID 1 of its own PID namespace (nothing it starts outlives it);
        * ``network_namespace``: no network, only a down loopback;
        * ``private_filesystem``: the code sees only the system directories and the interpreter, and a
          fresh, empty tmpfs as ``/tmp`` (also ``/var/tmp``, ``/dev/shm``) per call -- no home directories,
          no ``/mnt``, ``/srv``, ``/var``, no project checkout;
        * ``readonly_filesystem``: everything but that tmpfs is read-only;
        * ``own_proc``: ``/proc`` lists only the call's own processes;
        * ``sandbox_uid``: the uid the code runs as (65534 as root; the caller's own uid otherwise).
        """
        handle = self._idle.get()
        try:
            if not handle.alive:
                handle.start()
            keys = (
                "mode",
                "user_namespace",
                "pid_namespace",
                "network_namespace",
                "private_filesystem",
                "readonly_filesystem",
                "own_proc",
                "sandbox_uid",
            )
            return {k: handle.info.get(k) for k in keys}
        finally:
            self._idle.put(handle)

    def zygote_pids(self) -> list[int]:
        """Process ids of the running zygotes (for monitoring and tests)."""
        return [h.info.get("pid", h.proc.pid) for h in self._handles if h.proc is not None and h.alive]

    def close(self) -> None:
        """Stop every zygote (waiting for calls in flight). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._owner_pid:
            return  # the zygotes belong to the parent process
        for _ in range(len(self._handles)):
            self._idle.get().stop()
        for handle in self._handles:
            self._idle.put(handle)  # wake any caller blocked in get(); it will see _closed

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


# One pool per process and config, shared by every env in the process and reference counted.
_shared: dict[SandboxConfig, tuple[SandboxPool, int]] = {}
_shared_lock = threading.Lock()


def acquire_shared_pool(config: SandboxConfig | None = None) -> SandboxPool:
    """The process-wide pool for ``config`` (created on first use); pair with :func:`release_shared_pool`."""
    config = config or SandboxConfig()
    with _shared_lock:
        pool, refs = _shared.get(config, (None, 0))
        if pool is None or pool._closed or pool._owner_pid != os.getpid():
            pool, refs = SandboxPool(config), 0
        _shared[config] = (pool, refs + 1)
        return pool


def release_shared_pool(pool: SandboxPool) -> None:
    """Drop one reference to a shared pool; the last one closes it (no sandbox process is left)."""
    with _shared_lock:
        entry = _shared.get(pool.config)
        if entry is None or entry[0] is not pool:
            return
        refs = entry[1] - 1
        if refs > 0:
            _shared[pool.config] = (pool, refs)
            return
        del _shared[pool.config]
    pool.close()


__all__ = [
    "ISOLATION_MODES",
    "Isolation",
    "SandboxConfig",
    "SandboxPool",
    "SandboxUnavailableError",
    "ToolResult",
    "ToolStatus",
    "acquire_shared_pool",
    "check_isolation",
    "error_summary",
    "release_shared_pool",
    "truncate_middle",
]
