"""The inside of the Python tool sandbox: what runs in a spawned zygote and in each call's forked child.

:mod:`streamrl.envs.sandbox` (the caller's side: the config, the pool, the isolation check) spawns each zygote
as a fresh interpreter (``python -I``) that loads *this file by its path* and calls :func:`zygote_main`. So
the module imports only the standard library and nothing of ``streamrl``: importing the package would load
its dependencies into every zygote, and so into every call's address space. What a call may do in each
isolation mode is described in :mod:`streamrl.envs.sandbox`; here is how it is done:

* :class:`_Zygote` isolates the zygote once in ``namespaces`` mode (:meth:`_Zygote._isolate`: user, mount,
  network and PID namespaces, a read-only root of the system and the interpreter only), then forks one
  child per call (:meth:`_Zygote.run`) that enters a PID and mount namespace of its own (in that mode), sets
  rlimits, drops privileges and runs the snippet (:func:`_exec_snippet`); the zygote keeps the head and tail
  of its output and kills it at the deadline;
* :func:`zygote_main` preloads and warms up the heavy modules, freezes the heap against copy-on-write
  faults and serves calls until its request pipe closes;
* the wire format both sides speak: length-prefixed JSON messages (:func:`send_message`,
  :func:`recv_message`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import types
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # only for the type checker: at run time this module imports nothing of streamrl
    from streamrl.envs.sandbox import SandboxConfig

__all__ = ["EXCEPTION_LINE", "recv_message", "send_message", "truncate_middle", "zygote_main"]

_HEADER = struct.Struct(">I")  # length prefix of a JSON message between the pool and a zygote
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_NOATIME = 1, 2, 4, 8, 32, 1024
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_MS_NODIRATIME, _MS_RELATIME, _ST_RELATIME = 2048, 1 << 21, 4096
_MNT_DETACH = 2
_SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64
_AT_RECURSIVE, _MOUNT_ATTR_RDONLY = 0x8000, 0x1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_MADV_COLLAPSE = 25


def truncate_middle(text: str, limit: int) -> str:
    """Keep the first and last ``limit // 2`` characters of ``text`` and say how many were cut between.

    ToRL/SimpleTIR feed back a bounded tool output; head+tail keeps both the first lines and the final
    result/traceback line, which is what a model needs.
    """
    if limit < 2:
        raise ValueError(f"limit must be >= 2, got {limit}")
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters truncated] ...\n{text[len(text) - half :]}"


# --------------------------------------------------------------------------------------------------
# The wire format between the pool and a zygote
# --------------------------------------------------------------------------------------------------


def send_message(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no reply from the sandbox zygote in time")
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("sandbox zygote pipe closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(fd: int, deadline: float | None = None) -> dict[str, Any]:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    message: dict[str, Any] = json.loads(_read_exact(fd, size, deadline))
    return message


# --------------------------------------------------------------------------------------------------
# The zygote and its children
# --------------------------------------------------------------------------------------------------


class _SetupError(Exception):
    """Isolation could not be set up in the zygote; ``cause`` says which kernel facility refused."""

    def __init__(self, step: str, err: int, cause: str) -> None:
        super().__init__(f"{step}: {os.strerror(err)} (errno {err})")
        self.cause = cause


def _refusal_cause(step: str, err: int) -> str:
    """A sentence naming the likely reason the kernel refused ``step`` with ``err``."""
    if step.startswith("unshare(CLONE_NEWUSER"):
        if err == errno.ENOSPC:
            return "the limit on user namespaces is reached (user.max_user_namespaces is 0 or used up)"
        if err == errno.EPERM:
            return (
                "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone=0 on Debian/Ubuntu "
                "kernels) or blocked by a seccomp filter (e.g. a container's default profile)"
            )
        if err == errno.EINVAL:
            return "this kernel does not support user namespaces"
    if err == errno.EPERM:
        if os.geteuid() == 0:
            return "root without CAP_SYS_ADMIN (e.g. an unprivileged container) cannot create namespaces"
        return (
            "the kernel created the user namespace but refused the mounts inside it (e.g. Ubuntu's AppArmor "
            "restriction kernel.apparmor_restrict_unprivileged_userns=1, or a container that masks /proc)"
        )
    return f"{step} failed: {os.strerror(err)}"


class _Zygote:
    """The fork server's state; one instance lives in each spawned zygote process.

    In ``namespaces`` mode the zygote first isolates itself (:meth:`_isolate`): a user namespace unless it
    is root, a mount namespace whose root holds only the system directories and the interpreter, all
    read-only, and a network namespace with only a down loopback. Each call then forks a child into a new
    PID namespace that adds a fresh tmpfs and its own ``/proc``. In ``rlimits`` mode nothing of this
    happens: the child gets rlimits, a private work directory and the process-group kill.
    """

    def __init__(self, config: SandboxConfig, req_fd: int, resp_fd: int, scratch: str) -> None:
        self.config = config
        self.req_fd, self.resp_fd = req_fd, resp_fd
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.is_root = os.geteuid() == 0
        self.namespaces = config.isolation == "namespaces"
        self.user_ns = self.net_ns = self.private_fs = self.readonly = False
        if self.namespaces:
            self._isolate()
        self.drop_uid = self.is_root and self._probe_uid_drop()
        if self.namespaces and self.is_root and not self.drop_uid:  # the code must never run as root
            raise _SetupError(
                f"switching to the sandbox uid {config.sandbox_uid}",
                errno.EACCES,
                "that uid cannot read the interpreter's standard library; set SandboxConfig.sandbox_uid to one that can",
            )
        # Work directories: a fresh tmpfs on /tmp per call in namespaces mode, else folders under the
        # pool's scratch directory (which the pool removes even if this process is killed).
        self.base_dir = None if self.private_fs else scratch
        if self.base_dir is not None and self.drop_uid:
            os.chmod(self.base_dir, 0o711)  # the sandbox uid must reach its own work directory inside
        # /proc is the host's here, so /proc/self names this process as the pool sees it.
        self.host_pid = int(os.readlink("/proc/self"))
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.pid_ns = self.namespaces and config.isolate_pids
        if self.pid_ns:
            self._check(self.libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
            self._check(self.libc.setns(self.own_pid_ns, _CLONE_NEWPID), "setns(CLONE_NEWPID)")
        else:
            # Orphans of a call are re-parented to us, so we can find and kill them after the call.
            self.libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.own_proc = False
        if self.namespaces:
            self._dry_run()

    def _check(self, rc: int, step: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise _SetupError(step, err, _refusal_cause(step, err))

    def _mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
        def enc(value: str | None) -> bytes | None:
            return value.encode() if value else None

        if self.libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
            err = ctypes.get_errno()
            raise _SetupError(f"mount {source} on {target}", err, _refusal_cause("mount", err))

    # ---- zygote setup ----------------------------------------------------------------------------
    def _isolate(self) -> None:
        """Enter a user namespace (unless root), a mount, a network and a PID namespace, and switch to a root
        that shows the system read-only and nothing of the host's data.

        As an ordinary user the zygote maps its own uid and gid into the new user namespace (``setgroups``
        denied, as the kernel requires); it then holds capabilities over its own namespaces only, which
        every call drops before running code. The process the pool started stays outside the new PID
        namespace and only waits: the zygote proper is its child, PID 1 there, so that it may hand each
        call a PID namespace of its own and return to its own afterwards (``setns`` into a PID namespace
        needs privilege over the user namespace that owns it, which an ordinary user has only for its own).
        """
        uid, gid = os.getuid(), os.getgid()
        flags = _CLONE_NEWNS
        flags |= _CLONE_NEWNET if self.config.isolate_network else 0
        flags |= _CLONE_NEWPID if self.config.isolate_pids else 0
        if not self.is_root:
            self._check(self.libc.unshare(_CLONE_NEWUSER | flags), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
            name = "setgroups"
            try:
                for name, text in (
                    ("setgroups", "deny"),
                    ("uid_map", f"{uid} {uid} 1"),
                    ("gid_map", f"{gid} {gid} 1"),
                ):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            except OSError as e:
                raise _SetupError(
                    f"writing /proc/self/{name}", e.errno or 0, _refusal_cause("mount", e.errno or 0)
                ) from e
            self.user_ns = True
        else:
            self._check(self.libc.unshare(flags), "unshare(CLONE_NEWNS)")
        if self.config.isolate_pids:
            self._become_pid_1()
        self.net_ns = self.config.isolate_network
        self._mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        self._build_root()
        self.private_fs = True
        self.readonly = bool(os.statvfs("/").f_flag & os.ST_RDONLY)

    def _become_pid_1(self) -> None:
        """Fork the zygote proper into the new PID namespace; this process waits for it and exits with it.
        The zygote dies with this process (``PR_SET_PDEATHSIG``), and with it every call it runs."""
        pid = os.fork()
        if pid == 0:
            # (Should the parent die before this line, the closed request pipe still ends the zygote.)
            self.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            return
        os.close(self.req_fd)
        os.close(self.resp_fd)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)

    def _build_root(self) -> None:
        """Make a tmpfs holding bind mounts of ``/usr``, ``/etc`` (and the ``/bin``, ``/lib*`` links), a few
        device nodes, ``/proc`` and the interpreter's own trees (``sys.prefix``, ``sys.base_prefix``, the
        site-packages folders on ``sys.path``) at their usual paths; make all of it read-only and ``pivot_root`` into it.

        Everything else -- ``/home``, ``/root``, the caller's ``$HOME``, ``/mnt``, ``/media``, ``/srv``,
        ``/opt``, ``/var``, ``/run``, ``/sys``, project checkouts -- does not exist for the code. ``/tmp``
        is an empty mount point (each call mounts a fresh tmpfs there); ``/var/tmp`` and ``/dev/shm`` are
        links to it. The host's ``/proc`` stays mounted underneath each call's own ``/proc`` because the
        kernel lets a user namespace mount a new ``/proc`` only where one is already fully visible.
        """
        system = [
            p
            for p in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
            if os.path.lexists(p)
        ]
        links = {p: os.readlink(p) for p in system if os.path.islink(p)}
        # The interpreter's installation and its package folders; not other sys.path entries (a source
        # checkout put there by an editable install holds the user's data, and the code needs none of it).
        entries = [p for p in sys.path if p and os.path.basename(p) in ("site-packages", "dist-packages")]
        trees = sorted(
            {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, *entries) if os.path.isdir(p)}
        )
        outermost = [p for p in trees if not any(p != q and p.startswith(q + os.sep) for q in trees)]
        covered = [p for p in system if p not in links]
        binds = [p for p in covered if os.path.isdir(p)]
        # A tree under /tmp would lie beneath each call's fresh tmpfs anyway (its preloaded modules still work).
        skip = [*covered, "/tmp", "/proc", "/dev"]
        binds += [
            p for p in outermost if p != "/" and not any(p == q or p.startswith(q + os.sep) for q in skip)
        ]
        devices = [d for d in ("null", "zero", "full", "random", "urandom") if os.path.exists(f"/dev/{d}")]
        # Open every source before the staging tmpfs hides whatever lies beneath it.
        fds = {path: os.open(path, os.O_PATH) for path in [*binds, "/proc", *(f"/dev/{d}" for d in devices)]}
        new = "/tmp"
        self._mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for path in [*binds, "/proc"]:
            os.makedirs(new + path, mode=0o755, exist_ok=True)
            self._mount(f"/proc/self/fd/{fds[path]}", new + path, None, _MS_BIND | _MS_REC)
        os.makedirs(f"{new}/dev", mode=0o755)
        for d in devices:
            open(f"{new}/dev/{d}", "w").close()
            self._mount(f"/proc/self/fd/{fds[f'/dev/{d}']}", f"{new}/dev/{d}", None, _MS_BIND)
        for fd in fds.values():
            os.close(fd)
        for link, target in links.items():
            os.symlink(target, new + link)
        os.makedirs(f"{new}/var", mode=0o755, exist_ok=True)
        os.mkdir(f"{new}/tmp", 0o755)
        os.symlink("../tmp", f"{new}/var/tmp")
        os.symlink("../tmp", f"{new}/dev/shm")
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ):
            os.symlink(target, f"{new}/dev/{name}")
        self._readonly_tree(new)
        os.chdir(new)
        self._check(self.libc.pivot_root(b".", b"."), "pivot_root")
        self._check(self.libc.umount2(b".", _MNT_DETACH), "umount2(old root)")
        os.chdir("/")

    def _readonly_tree(self, top: str) -> None:
        """Make ``top`` and every mount below it read-only (``mount_setattr`` with ``AT_RECURSIVE``, or one
        bind remount per mount on kernels before 5.12), and check that each one is."""
        attr = ctypes.create_string_buffer(struct.pack("=QQQQ", _MOUNT_ATTR_RDONLY, 0, 0, 0), 32)
        c_long = ctypes.c_long
        rc = self.libc.syscall(
            c_long(_SYS_MOUNT_SETATTR),
            c_long(-100),
            ctypes.c_char_p(top.encode()),
            c_long(_AT_RECURSIVE),
            attr,
            c_long(32),
        )
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4].replace("\\040", " ") for line in f]
        points = [p for p in points if p == top or p.startswith(top + "/")]
        if rc != 0:
            for point in points:
                # Flags the kernel locked (nosuid, nodev, noexec, atime) must be repeated on a remount.
                st = os.statvfs(point).f_flag
                kept = st & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
                kept |= _MS_RELATIME if st & _ST_RELATIME else 0
                self._mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)
        for point in points:
            if not os.path.isfile(point) and not os.statvfs(point).f_flag & os.ST_RDONLY:
                raise _SetupError(f"making {point} read-only", errno.EPERM, f"{point} stayed writable")

    def _probe_uid_drop(self) -> bool:
        """Can a child running as the sandbox uid still import from the standard library?"""
        probe = os.path.join(os.path.dirname(os.__file__), "traceback.py")
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(self.config.sandbox_uid)
                os.setuid(self.config.sandbox_uid)
                with open(probe, "rb"):
                    os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

    def _dry_run(self) -> None:
        """Run one call through the whole per-call setup, so a kernel that refuses part of it fails the start
        of the zygote (with the reason) rather than every call; learn whether calls get their own /proc."""
        reply = self.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", 30.0)
        if reply["status"] != "ok":
            raise _SetupError("the first sandboxed call", errno.EPERM, reply["output"].strip())
        self.own_proc = reply["output"].strip() == "[1]"

    # ---- child -----------------------------------------------------------------------------------
    def _enter_call_namespace(self) -> str:
        """In the child, still privileged: a mount namespace of its own with an empty tmpfs on ``/tmp`` (the
        work directory; ``/var/tmp`` and ``/dev/shm`` lead there) that vanishes with the call, and a
        ``/proc`` of its PID namespace, which lists only the call's own processes."""
        self._check(self.libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        self._mount(
            "tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={self.config.max_file_mb * 4}m"
        )
        if self.pid_ns:
            try:
                self._mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
            except _SetupError:  # the kernel refuses a new /proc here: show an empty one, never the host's
                self._mount(
                    "tmpfs", "/proc", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY, "size=4k"
                )
        return "/tmp"

    def _drop_privileges(self) -> None:
        """Root switches to the sandbox uid (which clears every capability); in a user namespace the child
        keeps its uid and clears the capabilities it holds over the zygote's namespaces."""
        if self.drop_uid:
            uid = self.config.sandbox_uid
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        elif self.user_ns:
            header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
            self._check(self.libc.capset(header, bytes(24)), "capset (drop capabilities)")
        self.libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)

    def _child(self, code: str, out_fd: int, workdir: str | None) -> None:
        """Runs in the forked child; never returns."""
        rc = 1
        try:
            random.seed()  # the one at-fork hook _fork_call_child skips whose effect the code could see
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            os.closerange(3, 1 << 16)
            if workdir is None:
                workdir = self._enter_call_namespace()
            os.chdir(workdir)
            self._set_limits()
            self._drop_privileges()
            os.environ.clear()
            os.environ.update(
                {
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "HOME": workdir,
                    "TMPDIR": workdir,
                    "LANG": "C.UTF-8",
                }
            )
            tempfile.tempdir = workdir
            rc = _exec_snippet(code)
        except BaseException as e:  # a setup failure must not fall through into the zygote's loop
            with contextlib.suppress(BaseException):
                os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        os._exit(rc)

    def _set_limits(self) -> None:
        import resource

        c = self.config
        mib = 1 << 20
        for limit, value in (
            (resource.RLIMIT_CPU, (c.cpu_time_s, c.cpu_time_s + 1)),
            (resource.RLIMIT_AS, (c.memory_mb * mib, c.memory_mb * mib)),
            (resource.RLIMIT_FSIZE, (c.max_file_mb * mib, c.max_file_mb * mib)),
            (resource.RLIMIT_NOFILE, (c.max_open_files, c.max_open_files)),
            (resource.RLIMIT_NPROC, (c.max_processes, c.max_processes)),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(limit, value)

    # ---- one call --------------------------------------------------------------------------------
    def run(self, code: str, timeout: float) -> dict[str, Any]:
        start = time.monotonic()
        workdir = None  # in namespaces mode the child mounts its own (a fresh /tmp)
        if self.base_dir is not None:
            workdir = tempfile.mkdtemp(dir=self.base_dir)
            if self.drop_uid:
                os.chown(workdir, self.config.sandbox_uid, self.config.sandbox_uid)
        out_r, out_w = os.pipe()
        # The child becomes PID 1 of a new PID namespace: when it ends, the kernel kills all it started.
        in_pid_ns = self.pid_ns and self.libc.unshare(_CLONE_NEWPID) == 0
        pid = _fork_call_child()
        if pid == 0:
            os.close(out_r)
            self._child(code, out_w, workdir)
        if in_pid_ns:
            # Later forks (the next call) must not land in this call's namespace.
            self.libc.setns(self.own_pid_ns, _CLONE_NEWPID)
        os.close(out_w)
        head, tail, total, timed_out = self._collect(out_r, pid, start + timeout)
        if timed_out:
            self._kill(pid)
        _, wait_status, usage = os.wait4(pid, 0)
        cpu_seconds = usage.ru_utime + usage.ru_stime
        if not in_pid_ns:
            self._kill_strays(pid)
        os.close(out_r)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        return self._result(
            head, tail, total, timed_out, timeout, wait_status, cpu_seconds, time.monotonic() - start
        )

    def _collect(self, fd: int, pid: int, deadline: float) -> tuple[bytearray, bytearray, int, bool]:
        """Read the child's output until EOF, the child's exit, or the deadline; keep a head and a tail.

        Watching the exit (a pidfd) matters without a PID namespace: a process the code left behind may
        hold the pipe open long after the call is over.
        """
        keep = 2 * self.config.max_output_chars  # bytes; a UTF-8 character is at most 4, cut later
        head, tail, total = bytearray(), bytearray(), 0
        try:
            watch = [fd, os.pidfd_open(pid)]
        except OSError:  # pragma: no cover - kernels before 5.3
            watch = [fd]
        exited = False
        try:
            while True:
                now = time.monotonic()
                if exited and now > deadline:
                    return head, tail, total, False  # a leftover process keeps writing; the call is over
                left = 0.0 if exited else deadline - now
                ready = select.select([fd] if exited else watch, [], [], max(left, 0.0))[0]
                if not ready:
                    return head, tail, total, not exited
                if fd not in ready:  # the child is gone: take what is buffered, then stop
                    exited = True
                    deadline = min(deadline, now + 0.5)
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return head, tail, total, False
                total += len(chunk)
                room = keep - len(head)
                if room > 0:
                    head += chunk[:room]
                    chunk = chunk[room:]
                if chunk:
                    tail += chunk
                    if len(tail) > keep:
                        del tail[: len(tail) - keep]
        finally:
            for extra in watch[1:]:
                os.close(extra)

    def _kill(self, pid: int) -> None:
        for kill in (os.kill, os.killpg):  # PID 1 of a namespace takes the namespace with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)

    def _kill_strays(self, pid: int) -> None:
        """Without a PID namespace: kill the call's process group and any orphan re-parented to us."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        me = os.getpid()
        for _ in range(100):  # each round kills the orphans of the previous one
            strays = []
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read()
                except OSError:
                    continue
                if int(stat[stat.rindex(b")") + 2 :].split()[1]) == me:
                    strays.append(int(entry))
            if not strays:
                return
            for stray in strays:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(stray, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(stray, 0)

    def _result(
        self,
        head: bytearray,
        tail: bytearray,
        total: int,
        timed_out: bool,
        timeout: float,
        wait_status: int,
        cpu_seconds: float,
        seconds: float,
    ) -> dict[str, Any]:
        keep = 2 * self.config.max_output_chars
        raw = bytes(head) if total <= keep else bytes(head) + b"\x00CUT\x00" + bytes(tail)
        text = raw.decode("utf-8", errors="replace")
        if total > keep:
            first, last = text.split("\x00CUT\x00", 1)
            text = first + "\n...\n" + last
        returncode: int | None = None
        if timed_out:
            status, note = "timeout", f"TimeoutError: wall-clock limit of {timeout:g}s exceeded"
        elif os.WIFSIGNALED(wait_status):
            sig = os.WTERMSIG(wait_status)
            returncode = -sig
            # The soft CPU limit sends SIGXCPU, but the child is PID 1 of its own PID namespace, and
            # such an init ignores signals it has no handler for; the hard limit (one second later)
            # then SIGKILLs it. Both mean the CPU budget ran out.
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_seconds >= self.config.cpu_time_s):
                status, note = (
                    "timeout",
                    f"TimeoutError: CPU time limit of {self.config.cpu_time_s}s exceeded",
                )
            else:
                status, note = "killed", f"Killed: process ended by signal {_signal_name(sig)}"
                if sig == signal.SIGSEGV:
                    note += " (segmentation fault, e.g. from too deep recursion)"
        else:
            returncode = os.WEXITSTATUS(wait_status)
            status = "ok" if returncode == 0 else "error"
            note = "" if returncode == 0 else f"Exited with code {returncode}"
            lines = text.strip().splitlines()
            if note and lines and EXCEPTION_LINE.match(lines[-1]):
                note = ""  # the traceback's last line already says what happened
        if note:
            text = f"{text.rstrip()}\n{note}" if text.strip() else note
        text = truncate_middle(text, self.config.max_output_chars)  # the tail keeps the note
        return {"status": status, "output": text, "seconds": seconds, "returncode": returncode}

    def serve(self) -> None:
        while True:
            try:
                request = recv_message(self.req_fd)
            except EOFError:  # the pool (or its process) is gone
                return
            if request.get("shutdown"):
                return
            send_message(self.resp_fd, self.run(request["code"], float(request["timeout"])))

    def describe(self) -> dict[str, Any]:
        """What this zygote's calls get (:attr:`SandboxPool.isolation`)."""
        return {
            "mode": self.config.isolation,
            "user_namespace": self.user_ns,
            "pid_namespace": self.pid_ns,
            "network_namespace": self.net_ns,
            "private_filesystem": self.private_fs,
            "readonly_filesystem": self.private_fs and self.readonly,
            "own_proc": self.own_proc,
            "sandbox_uid": self.config.sandbox_uid if self.drop_uid else os.geteuid(),
        }


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


_glibc_fork = ctypes.PyDLL(None, use_errno=True).fork  # a PyDLL call keeps the GIL held across the fork


def _fork_call_child() -> int:
    """``fork`` for a call's child: glibc's fork without Python's at-fork machinery.

    ``os.fork`` also re-initialises the interpreter's thread state and runs every module's at-fork hooks
    (logging, threading, random, ...) in both processes. The zygote is single-threaded, so there is nothing
    to re-initialise, while those hooks write to pages all over the shared heap, each write a copy-on-write
    fault -- a tenth of a call's cost. The only hook whose effect the code could notice, ``random``'s
    reseed, is repeated by the child (:meth:`_Zygote._child`)."""
    pid: int = _glibc_fork()
    if pid < 0:
        raise OSError(ctypes.get_errno(), "fork failed")
    return pid


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _exec_snippet(code: str) -> int:
    """Run ``code`` as ``__main__`` in the (already confined) child; return the exit code."""
    import builtins
    import io
    import traceback

    out = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace")
    out.reconfigure(write_through=True)
    sys.stdout = sys.stderr = out
    rc = 0
    try:
        compiled = compile(code, "<tool>", "exec")
        exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code)
            rc = 1
    except BaseException as e:
        tb = e.__traceback__
        # Drop our own exec frame so the traceback shows only the snippet's lines.
        if tb is not None and tb.tb_frame.f_code is _exec_snippet.__code__:
            tb = tb.tb_next
        with contextlib.suppress(BaseException):
            traceback.print_exception(type(e), e, tb)
        rc = 1
    with contextlib.suppress(BaseException):
        out.flush()
    return rc


_WARMUP = {
    "sympy": (
        "import sympy as sp\n"
        "y, c, d = sp.symbols('y c d')\n"
        "sp.solve(y**2 - 7*y + 12, y); sp.solve([c + d - 3, c - d - 1], [c, d])\n"
        "sp.simplify(sp.sin(y)**2 + sp.cos(y)**2); sp.factor(y**2 - 1); sp.expand((y + 1)**3)\n"
        "sp.integrate(y**2, y); sp.nsimplify(0.5); sp.Rational(3, 4) + 1; sp.sqrt(8); sp.binomial(10, 3)\n"
    ),
    "numpy": "import numpy as np\nnp.linalg.solve(np.eye(2), np.ones(2)); np.arange(10).sum()\n",
    # The answer checker of Math-TIR (streamrl.envs.math_answer): LaTeX parsing and comparison.
    "math_verify": (
        "from math_verify import parse, verify\n"
        "verify(parse('$\\\\frac{1}{2}$', parsing_timeout=None), parse('$0.5$', parsing_timeout=None), "
        "timeout_seconds=None)\n"
    ),
}


def _collapse_heap_into_huge_pages(libc: ctypes.CDLL) -> None:
    """Back the zygote's heap with 2 MiB pages where the kernel can (``MADV_COLLAPSE``, Linux 6.1+).

    Every call forks the zygote, and a fork copies one page-table entry per mapped 4 KiB page of the
    heap -- tens of thousands with sympy and numpy loaded -- which the child's exit then tears down again;
    a huge page is one entry. Pages a process writes later are split back to 4 KiB (copy-on-write keeps
    working as before). Best effort: a kernel that cannot collapse a range leaves it as it is.
    """
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 2 << 20
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    for fields in regions:
        anonymous = len(fields) == 5 or fields[5] == "[heap]"
        if not anonymous or not fields[1].startswith("rw"):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        start, end = (low + huge - 1) & ~(huge - 1), high & ~(huge - 1)
        if end > start:
            madvise(start, end - start, _MADV_COLLAPSE)


def zygote_main() -> None:
    """Entry point of a spawned zygote; ``argv[1]`` is the config as JSON, ``argv[2]`` its scratch folder.

    The zygote isolates itself first (so that even its preloading sees only the sandbox's view), then
    preloads, says it is ready -- or why isolation failed -- and serves calls until its request pipe
    closes, i.e. when the pool closes or its process dies. (Not PR_SET_PDEATHSIG: that fires when the
    *thread* that spawned the zygote exits.)
    """
    # The pool's SandboxConfig (validated there) as plain attributes: the dataclass lives in the package,
    # which this interpreter does not import.
    config = cast("SandboxConfig", types.SimpleNamespace(**json.loads(sys.argv[1])))
    scratch = sys.argv[2]
    # Protocol on private descriptors; 0/1 point at /dev/null so stray prints cannot corrupt it.
    req_fd, resp_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.umask(0o022)  # the folders of the sandbox's root must be traversable by the sandbox uid
    try:
        zygote = _Zygote(config, req_fd, resp_fd, scratch)
    except _SetupError as e:
        send_message(resp_fd, {"error": str(e), "cause": e.cause})
        return
    except OSError as e:  # a step of the setup that is not a kernel refusal (a folder, a file)
        send_message(resp_fd, {"error": repr(e), "cause": "setting up the sandbox's private root failed"})
        return
    for name in config.preload:
        __import__(name)
    if config.warmup:
        for name, code in _WARMUP.items():
            if name in config.preload:
                with contextlib.suppress(Exception):
                    exec(code, {})
    import gc
    import resource  # noqa: F401 - imported once here rather than in every child
    import traceback  # noqa: F401

    # Park every object in the permanent generation: a child's garbage collections then do not walk
    # (and copy-on-write fault in) the zygote's heap -- Instagram's fork-server trick.
    gc.collect()
    gc.freeze()
    _collapse_heap_into_huge_pages(zygote.libc)
    send_message(resp_fd, {"ready": True, "pid": zygote.host_pid, **zygote.describe()})
    zygote.serve()


# --------------------------------------------------------------------------------------------------
# Pool side: runs in the caller's process.
