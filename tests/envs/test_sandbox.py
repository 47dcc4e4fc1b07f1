"""The Python tool sandbox: real zygote processes, real hostile code, real process-table checks.

The whole file runs twice in CI: as root, and (``test_the_suite_passes_as_an_ordinary_user``) as a free,
unprivileged uid whose home holds a private file -- the way most people train.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from streamrl.envs import sandbox as sandbox_module
from streamrl.envs.sandbox import SandboxConfig, SandboxPool, ToolResult, error_summary, truncate_middle

ROOT = Path(__file__).resolve().parents[2]
AS_USER = ROOT / "tests" / "sandbox_user.py"  # runs a command as an unprivileged uid (we are root in CI)
CONFIG = SandboxConfig(timeout_s=3.0, cpu_time_s=1, pool_size=2, max_output_chars=2048)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(CONFIG) as p:
        yield p


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_gone(pids: list[int], limit_s: float = 10.0) -> list[int]:
    """Pids still running (not zombies) after waiting up to ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_runs_code_with_preloaded_libraries(pool: SandboxPool) -> None:
    result = pool.run(
        "import sympy as sp, numpy as np\nx = sp.symbols('x')\n"
        "print(sp.solve(x**2 - 5*x + 6, x), int(np.arange(5).sum()))"
    )
    assert result == ToolResult("ok", "[2, 3] 10\n", result.seconds, 0)


def test_calls_share_no_state(pool: SandboxPool) -> None:
    assert pool.run("secret_value = 41\nopen('state.txt', 'w').write('x')").ok
    result = pool.run("import os\nprint('secret_value' in globals(), 'state.txt' in os.listdir('.'))")
    assert result.output == "False False\n"
    draws = {pool.run("import random\nprint(random.getrandbits(64))").output for _ in range(3)}
    assert len(draws) == 3  # every call draws fresh random numbers


HOSTILE = {
    "infinite loop": ("while True:\n    pass", "timeout", "TimeoutError"),
    "sleep past the wall clock": ("import time\ntime.sleep(60)", "timeout", "wall-clock limit"),
    "memory bomb": ("x = bytearray(16 * 2**30)\nprint(len(x))", "error", "MemoryError"),
    "numpy memory bomb": ("import numpy as np\nprint(np.ones((2**16, 2**16)).sum())", "error", "MemoryError"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", None, ""),
    "deep recursion": ("def f(n):\n    return f(n + 1)\nf(0)", "error", "RecursionError"),
    "segfault": ("import ctypes\nctypes.string_at(0)", "killed", "SIGSEGV"),
    "syntax error": ("print(1 +", "error", "SyntaxError"),
    "exception": ("1 / 0", "error", "ZeroDivisionError: division by zero"),
    "sys.exit(3)": ("import sys\nsys.exit(3)", "error", "Exited with code 3"),
    "os._exit(7)": ("import os\nprint('bye', flush=True)\nos._exit(7)", "error", "bye\nExited with code 7"),
    "os._exit(0)": ("import os\nprint('bye', flush=True)\nos._exit(0)", "ok", "bye"),
    "kill the parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('alive')", None, ""),
    "kill the caller": (f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", "error", "Error"),
    "kill every process": ("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')", None, ""),
    "gigantic output": ("print('x' * 10**7)", "ok", "characters truncated"),
    "endless output": ("while True:\n    print('spam' * 1000)", "timeout", "TimeoutError"),
    "daemon that escapes with setsid": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')",
        "ok",
        "parent done",
    ),
    "invalid UTF-8 output": ("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')", "ok", "ok"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_gives_a_tool_error_and_the_pool_goes_on(pool: SandboxPool, name: str) -> None:
    code, status, needle = HOSTILE[name]
    assert pool.isolation  # starts a zygote if none runs yet
    zygotes = set(pool.zygote_pids())
    result = pool.run(code)
    if status is not None:
        assert result.status == status, result
    assert needle in result.output, result
    assert len(result.output) <= CONFIG.max_output_chars + 80
    # The zygotes survived, nothing the call started is left, and the pool still computes.
    assert set(pool.zygote_pids()) == zygotes
    for zygote in zygotes:
        assert _descendants(zygote) == []
    assert pool.run("print(6 * 7)").output == "42\n"


def test_writes_outside_the_work_dir_are_refused(pool: SandboxPool) -> None:
    isolation = pool.isolation
    if isolation["sandbox_uid"] == os.geteuid() and not isolation["readonly_filesystem"]:
        pytest.skip("not running as root: the code runs as the caller's own user, who may write here")
    for target in (Path(__file__).resolve().parent / "sandbox_escape.txt", Path("/etc/streamrl-escape.txt")):
        result = pool.run(f"open({str(target)!r}, 'w').write('pwned')")
        assert result.status == "error", result
        # Refused as read-only or not permitted, or not even visible: a checkout under /tmp lies beneath
        # the call's private tmpfs, so its folder does not exist inside the sandbox.
        refusals = ("PermissionError", "Read-only file system", "FileNotFoundError")
        assert any(r in result.output for r in refusals), result
        assert not target.exists()


def test_scratch_dirs_are_private(pool: SandboxPool) -> None:
    if not pool.isolation["private_filesystem"]:
        pytest.skip("no mount namespace here: /tmp is shared with the host")
    name = f"streamrl-sandbox-probe-{os.getpid()}"
    assert pool.run(f"open('/tmp/{name}', 'w').write('x')\nprint('written')").output == "written\n"
    assert not Path("/tmp", name).exists()
    assert pool.run(f"import os\nprint(os.path.exists('/tmp/{name}'))").output == "False\n"  # next call


def test_no_network(pool: SandboxPool) -> None:
    result = pool.run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)")
    assert result.status == "error"
    assert pool.isolation["network_namespace"] is True
    assert "Network is unreachable" in result.output


def test_environment_secrets_do_not_reach_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMRL_TEST_SECRET", "hunter2-token")
    with SandboxPool(CONFIG) as fresh:  # started after the secret was set
        result = fresh.run(
            "import os\nprint(sorted(os.environ))\nprint(os.environ.get('STREAMRL_TEST_SECRET'))"
        )
        assert result.output == "['HOME', 'LANG', 'PATH', 'TMPDIR']\nNone\n"
        snoop = fresh.run(f"print(open('/proc/{os.getpid()}/environ').read())")
        assert "hunter2-token" not in snoop.output
        # With a /proc of its own the code does not even see this process; else the uid switch keeps it out.
        if fresh.isolation["own_proc"]:
            assert snoop.status == "error" and "FileNotFoundError" in snoop.output
        elif fresh.isolation["sandbox_uid"] != os.geteuid():
            assert snoop.status == "error" and "PermissionError" in snoop.output


def test_without_pid_namespace_escaped_processes_are_still_killed() -> None:
    """The fallback path (no PID namespace): process group kill plus the subreaper sweep."""
    config = SandboxConfig(timeout_s=1.5, pool_size=1, isolate_pids=False)
    with SandboxPool(config) as fallback:
        assert fallback.isolation["pid_namespace"] is False
        code = (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
        )
        assert fallback.run(code).output == "parent done\n"
        (zygote,) = fallback.zygote_pids()
        assert _descendants(zygote) == []
        assert fallback.run("while True: pass").status == "timeout"
        assert _descendants(zygote) == []


def test_dead_zygote_is_replaced_transparently() -> None:
    with SandboxPool(SandboxConfig(pool_size=1, timeout_s=5)) as p:
        assert p.run("print(1)").ok
        (first,) = p.zygote_pids()
        os.kill(first, signal.SIGKILL)
        assert _wait_gone([first]) == []
        assert p.run("print(2)").output == "2\n"  # found dead, restarted before the call
        (second,) = p.zygote_pids()
        assert second != first

        def kill_soon() -> None:
            time.sleep(0.5)
            os.kill(second, signal.SIGKILL)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        result = p.run("import time\ntime.sleep(3)")
        killer.join()
        assert result.status == "killed" and "died" in result.output
        assert p.run("print(3)").output == "3\n"


def test_many_threads_share_a_pool() -> None:
    with SandboxPool(SandboxConfig(pool_size=2)) as p:
        results: dict[int, str] = {}

        def work(i: int) -> None:
            results[i] = p.run(f"print({i} ** 2)").output

        threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {i: f"{i**2}\n" for i in range(12)}
        assert len(p.zygote_pids()) <= 2


def test_close_leaves_no_process() -> None:
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # e.g. the module's pool
    p = SandboxPool(SandboxConfig(pool_size=2))
    assert p.run("import os\nif os.fork() == 0:\n    import time; time.sleep(60)\nprint('x')").ok
    zygotes = p.zygote_pids()
    assert zygotes
    p.close()
    assert _wait_gone(zygotes) == []
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before
    with pytest.raises(RuntimeError, match="closed"):
        p.run("print(1)")


def test_interpreter_exit_closes_open_pools() -> None:
    script = (
        "from streamrl.envs.sandbox import SandboxPool\n"
        "p = SandboxPool()\np.run('print(1)')\nprint(p.zygote_pids()[0], flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert _wait_gone([int(out.stdout.split()[-1])]) == []


def test_rejections_and_config_errors(pool: SandboxPool) -> None:
    too_long = pool.run("#" * (CONFIG.max_code_chars + 1))
    assert too_long.status == "error" and "at most" in too_long.output
    with pytest.raises(TypeError):
        pool.run(b"print(1)")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        pool.run("print(1)", timeout=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxConfig(memory_mb=10)
    with pytest.raises(ValueError, match="pool_size"):
        SandboxConfig(pool_size=0)


def test_per_call_timeout_override(pool: SandboxPool) -> None:
    result = pool.run("import time\ntime.sleep(5)", timeout=0.3)
    assert result.status == "timeout" and "0.3s" in result.output


@pytest.mark.parametrize("n", [0, 10, 99, 100, 101, 5000])
def test_truncate_middle_keeps_head_and_tail(n: int) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(n))
    cut = truncate_middle(text, 100)
    if n <= 100:
        assert cut == text
    else:
        assert cut.startswith(text[:50]) and cut.endswith(text[-50:])
        assert f"[{n - 100} characters truncated]" in cut


def test_error_summary_picks_the_exception_line() -> None:
    interleaved = "Traceback (most recent call last):\nBlockingIOError: [Errno 11] x\nTraceback (most recent call last):\n"
    assert error_summary(interleaved) == "BlockingIOError: [Errno 11] x"
    assert error_summary("bye\nExited with code 7\n") == "Exited with code 7"
    assert error_summary("") == ""


def test_a_zygote_that_cannot_start_says_why() -> None:
    with SandboxPool(SandboxConfig(preload=("math", "no_such_module_xyz"))) as p:
        with pytest.raises(RuntimeError, match="No module named 'no_such_module_xyz'"):
            p.run("print(1)")


# ---- what an ordinary user's sandbox must hold as well as root's ------------------------------------


def test_full_isolation_is_reported(pool: SandboxPool) -> None:
    as_root = os.geteuid() == 0
    assert pool.isolation == {
        "mode": "namespaces",
        "user_namespace": not as_root,
        "pid_namespace": True,
        "network_namespace": True,
        "private_filesystem": True,
        "readonly_filesystem": True,
        "own_proc": True,
        "sandbox_uid": CONFIG.sandbox_uid if as_root else os.geteuid(),
    }


@pytest.fixture
def home_secret() -> Path:
    """A private file in the home of the user running the tests (root's /root in CI, or the ordinary
    user's home); removed afterwards."""
    path = Path.home() / f"streamrl-sandbox-private-{os.getpid()}.txt"
    path.write_text("ssh-key-material-4242\n")
    path.chmod(0o600)
    yield path
    path.unlink()


def test_the_users_home_is_neither_readable_nor_writable(pool: SandboxPool, home_secret: Path) -> None:
    read = pool.run(f"print(open({str(home_secret)!r}).read())")
    assert read.status == "error" and "FileNotFoundError" in read.output, read
    assert "ssh-key-material" not in read.output
    pwned = Path.home() / f"streamrl-sandbox-pwned-{os.getpid()}.txt"
    write = pool.run(f"open({str(pwned)!r}, 'w').write('pwned')")
    assert write.status == "error", write
    assert "FileNotFoundError" in write.output or "Read-only file system" in write.output, write
    assert not pwned.exists()
    # Nor any other place a user keeps data: what is left there only leads to the interpreter's trees.
    seen = pool.run(
        "import json, os\nprint(json.dumps({p: sorted(os.listdir(p)) for p in ('/home', '/root', '/mnt', "
        f"'/media', '/srv', '/opt', '/run', '/var', '/sys', '/work', {str(Path.home())!r}) "
        "if os.path.isdir(p)}))"
    )
    assert seen.ok, seen
    trees = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    for folder, entries in json.loads(seen.output).items():
        for entry in entries:
            path = os.path.join(folder, entry)
            assert any(t == path or t.startswith(path + os.sep) for t in trees) or path == "/var/tmp", path


def test_proc_lists_only_the_calls_own_processes(pool: SandboxPool) -> None:
    code = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    assert pool.run(code).output == "[1]\n"
    forked = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n" + code
    assert pool.run(forked).output == "[1, 2]\n"


def test_another_processes_command_line_is_not_readable(pool: SandboxPool) -> None:
    result = pool.run(f"print(open('/proc/{os.getpid()}/cmdline').read())")
    assert result.status == "error" and "FileNotFoundError" in result.output, result
    assert "pytest" not in result.output


def test_a_service_on_loopback_is_unreachable(pool: SandboxPool) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        result = pool.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert result.status == "error" and "Network is unreachable" in result.output, result
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected


def test_a_math_tir_episode_sees_no_home_no_processes_and_no_network(home_secret: Path) -> None:
    """The issue's table, through the env a user trains with: one Math-TIR episode, one snippet per row."""
    import gymnasium as gym
    import streamrl.envs  # noqa: F401 - registers the envs

    env = gym.make("streamrl/MathTIR-v0", sandbox=SandboxConfig(timeout_s=3.0, cpu_time_s=1))
    try:
        env.reset(seed=0)

        def tool(code: str) -> str:
            obs, _, terminated, truncated, info = env.step(f"```python\n{code}\n```")
            assert not (terminated or truncated) and info["action_valid"], obs
            return str(obs)

        read = tool(f"print(open({str(home_secret)!r}).read())")
        assert "FileNotFoundError" in read and "ssh-key-material" not in read
        pwned = Path.home() / f"streamrl-sandbox-pwned-env-{os.getpid()}.txt"
        assert "Error" in tool(f"open({str(pwned)!r}, 'w').write('pwned')")
        assert not pwned.exists()
        assert "Network is unreachable" in tool(
            "import socket\nsocket.create_connection(('127.0.0.1', 22), 1)"
        )
        assert "```output\n[1]\n```" in tool(
            "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
        )
    finally:
        env.close()


def test_rlimits_mode_is_chosen_by_name_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sandbox_module, "_rlimits_logged", False)
    config = SandboxConfig(isolation="rlimits", pool_size=1, timeout_s=3.0)
    with caplog.at_level(logging.WARNING, logger="streamrl.envs.sandbox"):
        with SandboxPool(config) as first, SandboxPool(config) as second:
            assert first.run("print(6 * 7)").output == "42\n"
            assert second.isolation["mode"] == "rlimits"
            assert not any(second.isolation[k] for k in ("user_namespace", "pid_namespace", "own_proc"))
            # What holds in this mode: the wall clock, rlimits, a private work directory.
            assert first.run("while True: pass").status == "timeout"
            assert first.run("open('x', 'w').write('1')\nprint(open('x').read())").output == "1\n"
    warnings = [r for r in caplog.records if 'isolation="rlimits"' in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="none")  # type: ignore[arg-type]


def _as_user(
    args: list[str], *, no_user_namespaces: bool = False, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    flags = ["--no-user-namespaces"] if no_user_namespaces else []
    return subprocess.run(
        [sys.executable, str(AS_USER), *flags, "--", sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching to another uid needs root; as an ordinary user this file ran as one"
)


USERNS_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: {os.strerror(ctypes.get_errno())}")
uid = os.getuid()
check(libc.unshare(0x10000000 | 0x00020000), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write(f"{uid} {uid} 1")
check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None), "mount tmpfs in the user namespace")
"""


@needs_root
def test_the_suite_passes_as_an_ordinary_user() -> None:
    """Every test of this file, hostile suite included, as a free unprivileged uid with a home of its own."""
    probe = _as_user(["-c", USERNS_PROBE], timeout=60)
    if probe.returncode != 0:  # the kernel itself, not the sandbox: e.g. Ubuntu's AppArmor restriction
        pytest.skip(f"this kernel gives an unprivileged uid no user namespace: {probe.stderr.strip()[-300:]}")
    done = _as_user(["-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider", "-p", "no:xdist"])
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    # Only the two tests that need root to switch users skip; everything else ran and passed.
    assert re.fullmatch(r"\d+ passed, 2 skipped in .*", summary), tail


REFUSAL_SCRIPT = """
import json, logging
import gymnasium as gym
import streamrl.envs  # registers the envs
from streamrl.envs.sandbox import SandboxConfig, SandboxPool, SandboxUnavailableError

out = {}
try:
    gym.make("streamrl/MathTIR-v0")
    out["refused"] = None
except SandboxUnavailableError as e:
    out["refused"] = str(e)
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("streamrl.envs.sandbox").addHandler(handler)
rlimits = SandboxConfig(isolation="rlimits")
env = gym.make("streamrl/MathTIR-v0", sandbox=rlimits)
env.reset(seed=0)
obs, reward, terminated, truncated, info = env.step("```python\\nprint(6 * 7)\\n```")
out["tool_output"] = obs
with SandboxPool(rlimits) as pool:
    out["isolation"] = pool.isolation
env.close()
out["logged"] = [r.getMessage() for r in records]
print(json.dumps(out))
"""


@needs_root
def test_without_user_namespaces_creating_the_env_refuses_unless_rlimits_is_named() -> None:
    """An ordinary user on a kernel whose user namespaces are off (here: a user namespace whose
    ``user.max_user_namespaces`` is 0, so ``unshare(CLONE_NEWUSER)`` genuinely fails)."""
    done = _as_user(["-c", REFUSAL_SCRIPT], no_user_namespaces=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    refused = out["refused"]
    assert refused is not None, "the env was created without isolation"
    for needle in ("user namespaces", "max_user_namespaces", "container", 'isolation="rlimits"'):
        assert needle in refused, refused
    assert "42" in out["tool_output"]
    assert out["isolation"]["mode"] == "rlimits" and out["isolation"]["user_namespace"] is False
    assert len(out["logged"]) == 1 and 'isolation="rlimits"' in out["logged"][0]
