"""Run a command as an ordinary (unprivileged) user, so that the sandbox's tests and benchmark can check the
ordinary-user path on a machine where they run as root (CI).

    python tests/sandbox_user.py [--uid UID] [--no-user-namespaces] -- COMMAND [ARG ...]

Run as root. In a mount namespace of its own (nothing of it is seen outside), it

* mounts an empty tmpfs on ``/home`` and makes ``/home/sandbox-user``, owned by the uid, the command's
  ``HOME`` -- the user's home that the sandbox must keep from model code;
* lets the uid reach the interpreter and the checkout when a directory on the way is closed to it (e.g. a
  pyenv Python under a ``0700`` ``/root``): a tmpfs over that directory holds bind mounts of just those
  trees, the rest of it stays invisible;
* with ``--no-user-namespaces``, first enters a user namespace whose ``user.max_user_namespaces`` is 0, so the
  command cannot create a user namespace: a machine where unprivileged user namespaces are disabled;

then drops to the uid (no supplementary groups, hence no capabilities) and execs the command. It exits with
the command's status. The uid is a free one (no passwd entry) unless ``--uid`` names another.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pwd
import stat
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
HOME = "/home/sandbox-user"

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {source} on {target}")


def free_uid() -> int:
    """A uid with no passwd entry (so no files on the machine belong to it)."""
    for uid in range(61_000, 65_000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no free uid in 61000..64999")


def _expose(paths: list[str]) -> None:
    """Cover each directory the uid cannot traverse on the way to ``paths`` with a tmpfs that holds bind
    mounts of just those paths."""
    wanted = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    outermost = [p for p in wanted if not any(p != q and p.startswith(q + os.sep) for q in wanted)]
    by_blocker: dict[str, list[str]] = {}
    for path in outermost:
        parts = path.split(os.sep)
        for i in range(2, len(parts) + 1):
            prefix = os.sep.join(parts[:i])
            if not os.stat(prefix).st_mode & stat.S_IXOTH:
                by_blocker.setdefault(prefix, []).append(path)
                break
    for blocker, inside in by_blocker.items():
        fds = {path: os.open(path, os.O_PATH) for path in inside}
        _mount("tmpfs", blocker, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for path, fd in fds.items():
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            os.close(fd)


def _enter_namespace_without_user_namespaces() -> None:
    """Become root of a new, identity-mapped user namespace whose limit on nested user namespaces is 0.

    Only a process outside may write a full uid map, so a forked helper writes it and waits for us."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(ready_w)
        os.close(go_r)
        os.read(ready_r, 1)
        parent = os.getppid()
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{parent}/{name}", "w") as f:
                f.write("0 0 4294967294\n")
        os.write(go_w, b"1")
        os._exit(0)
    os.close(ready_r)
    os.close(go_w)
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    os.write(ready_w, b"1")
    if os.read(go_r, 1) != b"1":
        raise RuntimeError("the helper could not write the uid map")
    os.waitpid(helper, 0)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--uid", type=int, default=None, help="the uid to run as (default: a free one)")
    parser.add_argument("--no-user-namespaces", action="store_true", help="the command cannot create any")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if os.geteuid() != 0:
        parser.error("run as root: it switches to an unprivileged uid")
    uid = free_uid() if args.uid is None else args.uid
    if uid <= 0:
        parser.error(f"--uid must be an unprivileged uid (> 0), got {uid}")

    if args.no_user_namespaces:
        _enter_namespace_without_user_namespaces()
    else:
        _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _expose([sys.base_prefix, sys.prefix, *sys.path, os.getcwd()])
    _mount("tmpfs", "/home", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    os.mkdir(HOME, 0o700)
    os.chown(HOME, uid, uid)

    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HOME=HOME, USER="sandbox-user", PYTHONDONTWRITEBYTECODE="1", TMPDIR="/tmp")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
