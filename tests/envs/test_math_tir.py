"""streamrl/MathTIR-v0 end to end: gym registration, check_env, the episode protocol over the real sandbox,
hostile code through the env, and the scripted solver on the whole test split."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import gymnasium as gym
import psutil
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st
from streamrl.agents.math_solver import MathSolverAgent, read_tool_output
from streamrl.agents.prompts import MathTIRPrompt
from streamrl.agents.rollout import play_episode
from streamrl.envs.math_tir import CHARSET, MathTIRConfig, MathTIREnv, parse_turn
from streamrl.envs.sandbox import SandboxConfig

SANDBOX = SandboxConfig(timeout_s=2.0, cpu_time_s=2)
FENCE = "```"


def code(src: str) -> str:
    return f"I will compute.\n{FENCE}python\n{src}\n{FENCE}"


@pytest.fixture(scope="module")
def env():
    e = MathTIREnv(split="test", sandbox=SANDBOX)
    yield e
    e.close()


def test_make_without_prior_import_in_a_fresh_interpreter() -> None:
    script = (
        "import gymnasium as gym\n"
        "env = gym.make('streamrl.envs:MathTIR-v0', source='procedural', split='test')\n"
        "obs, info = env.reset(seed=0)\n"
        "assert isinstance(obs, str) and info['task_id'].startswith('procedural/test/'), info\n"
        "import streamrl.envs\n"
        "env2 = gym.make('streamrl/MathTIR-v0')\n"
        "print(type(env.unwrapped).__name__, type(env2.unwrapped).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["MathTIREnv", "MathTIREnv"]


def test_check_env_passes_without_warnings() -> None:
    made = gym.make("streamrl/MathTIR-v0", split="test", sandbox=SANDBOX)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium reports most findings as warnings
        check_env(made.unwrapped)  # including the "ansi" render mode
    assert made.observation_space.contains(made.reset(seed=1)[0])
    made.close()


def test_reset_is_reproducible_and_selects_by_id(env: MathTIREnv) -> None:
    first = [env.reset(seed=s)[1]["task_id"] for s in range(8)]
    assert first == [env.reset(seed=s)[1]["task_id"] for s in range(8)]
    assert len(set(first)) > 4
    obs, info = env.reset(options={"task_id": "gsm_symbolic/test/00005"})
    task = env.task("gsm_symbolic/test/00005")
    assert obs == task.question and info["ground_truth"] == task.answer
    assert info == {
        "task_id": task.task_id,
        "question": task.question,
        "ground_truth": task.answer,
        "won": False,
        "tool_calls": 0,
        "action_valid": True,
        "answer": None,
        "turn": 0,
    }
    with pytest.raises(ValueError, match="unknown task_id 'nope'"):
        env.reset(options={"task_id": "nope"})
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(options={"level": 3})


def test_bad_constructor_options() -> None:
    with pytest.raises(ValueError, match="source"):
        MathTIREnv(source="gsm8k")
    with pytest.raises(ValueError, match="split"):
        MathTIREnv(split="dev")
    with pytest.raises(ValueError, match="max_turns"):
        MathTIREnv(max_tool_calls=8, max_turns=8)
    with pytest.raises(TypeError, match="unknown MathTIREnv option"):
        MathTIREnv(max_calls=3)
    with pytest.raises(ValueError, match="render_mode"):
        MathTIREnv(render_mode="human")


def test_a_full_episode_with_tool_output_and_answer(env: MathTIREnv) -> None:
    env.reset(options={"task_id": "procedural/test/00000"})
    obs, reward, terminated, truncated, info = env.step(code("import sympy as sp\nprint(sp.Rational(6, 4))"))
    assert obs == f"{FENCE}output\n3/2\n{FENCE}"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_calls"] == 1 and info["action_valid"] and info["tool_status"] == "ok"
    truth = info["ground_truth"]
    obs, reward, terminated, truncated, info = env.step(f"So the answer is \\boxed{{{truth}}}.")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["won"] and info["answer"] == truth
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("more")


def test_wrong_answer_ends_with_zero(env: MathTIREnv) -> None:
    _, info = env.reset(options={"task_id": "gsm_symbolic/test/00000"})
    wrong = str(int(info["ground_truth"]) + 1)
    _, reward, terminated, _, info = env.step(f"\\boxed{{{wrong}}}")
    assert (reward, terminated, info["won"], info["answer"]) == (0.0, True, False, wrong)


def test_errors_show_the_last_traceback_line_and_output_is_cut(env: MathTIREnv) -> None:
    env.reset(seed=0)
    obs, *_, info = env.step(code("x = 1\nprint('before')\n1 / x - 1 / 0"))
    assert obs == f"{FENCE}output\nZeroDivisionError: division by zero\n{FENCE}"
    assert info["tool_status"] == "error" and info["action_valid"]
    obs, *_ = env.step(code("print('A' * 300 + 'B' * 2000 + 'C' * 300)"))
    shown = read_tool_output(obs)
    assert shown is not None and len(shown) < 560
    assert shown.startswith("A" * 256) and shown.endswith("C" * 256) and "truncated" in shown
    obs, *_ = env.step(code("x = 2"))
    assert "no output" in obs


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("", "Expected either Python code"),
        ("I think the answer is 5.", "Expected either Python code"),
        (f"{FENCE}python\nprint(1)", "not closed"),
        (f"{FENCE}\nprint(1)\n{FENCE}", "Expected either Python code"),
        (f"{FENCE}output\n5\n{FENCE}", "Expected either Python code"),
        ("\\boxed{", "never closed"),
        ("\\boxed{}", "empty"),
        ("\udcff\udcfe broken surrogates", "Expected either Python code"),
        (b"\xff\xfe not utf-8", "Expected either Python code"),
        ("x" * 20_000, "at most"),
    ],
)
def test_invalid_actions_get_a_clear_observation(env: MathTIREnv, action: str | bytes, expected: str) -> None:
    env.reset(seed=3)
    obs, reward, terminated, truncated, info = env.step(action)  # type: ignore[arg-type]
    assert expected in obs
    assert not info["action_valid"] and reward == 0.0 and not terminated and not truncated
    assert env.observation_space.contains(obs)


def test_boxed_inside_code_runs_the_code(env: MathTIREnv) -> None:
    env.reset(seed=4)
    obs, _, terminated, _, info = env.step(code("print('\\\\boxed{5}')"))
    assert not terminated and info["tool_calls"] == 1 and "\\boxed{5}" in obs
    assert parse_turn(code("print(1)") + "\nHence \\boxed{7}.").answer == "7"


def test_tool_limit_and_turn_limit() -> None:
    with MathTIREnv(source="procedural", split="test", max_tool_calls=2, max_turns=4, sandbox=SANDBOX) as e:
        e.reset(seed=0)
        for _ in range(2):
            assert e.step(code("print(1)"))[4]["tool_status"] == "ok"
        obs, _, _, truncated, info = e.step(code("print(1)"))
        assert "refused" in obs and not info["action_valid"] and info["tool_calls"] == 2 and not truncated
        obs, reward, terminated, truncated, info = e.step("thinking...")
        assert truncated and not terminated and reward == 0.0 and "turn limit" in obs


@pytest.mark.parametrize(
    ("src", "needle"),
    [
        ("while True:\n    pass", "TimeoutError"),
        ("x = bytearray(16 * 2**30)", "MemoryError"),
        ("import os\nwhile True:\n    os.fork()", "Error"),
        ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')", "still here"),
        ("import sys\nsys.stdout.buffer.write(bytes(range(256)))", ""),
        ("print('漢字 ∑ 🙂')", "∑"),
    ],
)
def test_hostile_code_through_the_env(env: MathTIREnv, src: str, needle: str) -> None:
    env.reset(seed=5)
    obs, *_ = env.step(code(src))
    assert needle in obs and env.observation_space.contains(obs)
    assert env.step(code("print(6 * 7)"))[0] == f"{FENCE}output\n42\n{FENCE}"


# Final answers a policy can write that once hung or crashed a step (issue 12): power towers that sympy
# evaluates holding the GIL, huge factorials, literals beyond float range or Python's int-string limit, deep
# nesting, unbalanced braces -- next to answers that are right and must stay right. The task's answer is 4.
# Expected reward, or None for an action the env refuses (the episode goes on).
HOSTILE_ANSWERS: list[tuple[str, float | None]] = [
    ("\\boxed{2^{2^{64}}}", 0.0),
    ("\\boxed{2^{10^{20}}}", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", 0.0),
    ("\\boxed{2**2**2**2**2**2}", 0.0),
    ("\\boxed{x^{x^{x}}}", 0.0),
    ("\\boxed{(10**7)!}", 0.0),
    ("\\boxed{(10^{7})!}", 0.0),
    ("\\boxed{\\Gamma(10^{9})}", 0.0),
    ("\\boxed{" + "7" * 5000 + "}", 0.0),
    ("\\boxed{-" + "9" * 4500 + ".5}", 0.0),
    ("\\boxed{1e400}", 0.0),
    ("\\boxed{4e-400}", 0.0),
    ("\\boxed{" + "(" * 140 + "5" + ")" * 140 + "}", 0.0),
    ("\\boxed{" + "\\frac{1}{" * 20 + "5" + "}" * 20 + "}", 0.0),
    ("\\boxed{" + "\\sqrt{" * 400 + "5" + "}" * 400 + "}", 0.0),
    ("\\boxed{" + "{" * 3000 + "4" + "}" * 3000 + "}", 0.0),
    ("\\boxed{\\frac{1}{0}}", 0.0),
    ("\\boxed{" + "{" * 1000, None),
    ("\\boxed{{4}", None),
    ("\\boxed{}", None),
    ("\\boxed{4}}}}}", 1.0),
    ("\\boxed{2^{2}}", 1.0),
    ("\\boxed{\\frac{8!}{7!}-4}", 1.0),
    ("\\boxed{\\sqrt{16}}", 1.0),
    ("\\boxed{4.0000000001}", 1.0),
]

_HOSTILE_SCRIPT = """
import json, sys, time
from streamrl.envs.math_tir import MathTIREnv

env = MathTIREnv(tasks=[("What is 2 + 2?", "4")], answer_timeout_s=2.0)
env.reset()
env.step("\\\\boxed{\\\\sqrt{16}}")  # starts the answer checker's process
for text in json.load(sys.stdin):
    env.reset()
    start = time.monotonic()
    try:
        _, reward, terminated, _, info = env.step(text)
        row = {"reward": reward, "terminated": terminated, "valid": info["action_valid"]}
    except Exception as e:
        row = {"error": repr(e)[:300]}
    row["seconds"] = time.monotonic() - start
    print(json.dumps(row), flush=True)
env.close()
"""


def test_hostile_final_answers_return_in_seconds_and_never_raise() -> None:
    # In a child process: a step that hangs while holding the GIL cannot be interrupted from this one.
    texts = [text for text, _ in HOSTILE_ANSWERS]
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOSTILE_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(json.dumps(texts), timeout=60 + 6 * len(texts))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    rows = [json.loads(line) for line in out.splitlines()]
    if len(rows) < len(texts):
        pytest.fail(f"step({texts[len(rows)][:60]!r}...) did not return; stderr:\n{err[-2000:]}")
    for (text, expected), row in zip(HOSTILE_ANSWERS, rows, strict=True):
        shown = text if len(text) < 60 else f"{text[:40]}...({len(text)} chars)"
        assert "error" not in row, (shown, row)
        assert row["seconds"] < 2.0 + 4.0, (shown, row)  # the checker's deadline + process overhead
        if expected is None:
            assert not row["valid"] and not row["terminated"], (shown, row)
        else:
            assert row["valid"] and row["terminated"] and row["reward"] == expected, (shown, row)


# Turns a policy may write; the agent's parser must accept exactly what the env accepts.
TURNS = [
    f"{FENCE}py\nprint(1)\n{FENCE}",
    f"{FENCE}python\nprint(1)\n{FENCE}",
    f"{FENCE}python  \r\nprint(1)\n{FENCE}",
    f"{FENCE}pyth\nprint(1)\n{FENCE}",
    f"{FENCE} python\nprint(1)\n{FENCE}",
    f"{FENCE}python\nprint(1)",
    f"{FENCE}python print(1){FENCE}",
    f"{FENCE}python\nprint(1)\n{FENCE}\n{FENCE}output\n1\n{FENCE}\nso \\boxed{{1}}",
    f"{FENCE}python\nprint('\\\\boxed{{1}}')\n{FENCE}",
    "\\boxed 5",
    "\\boxed{5}",
    "\\fbox{5}",
    "\\boxed{}",
    "\\boxed{",
    "\\boxed{5",
    "\\boxed{{5}",
    "\\boxed{5}}",
    "The answer is 5.",
    f"{FENCE}output\n5\n{FENCE}",
    "",
    "   ",
]


@pytest.mark.parametrize("text", TURNS)
def test_the_agent_accepts_what_the_env_accepts(env: MathTIREnv, text: str) -> None:
    parsed = MathTIRPrompt().parse_action(text, {})
    env.reset(seed=7)
    *_, info = env.step(parsed.action)
    assert parsed.valid == info["action_valid"], (text, parsed)


_PIECES = [FENCE, "python", "py", "output", "\n", " ", "\\boxed", "\\fbox", "{", "}", "5"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES)))
def test_the_agent_uses_the_envs_grammar(pieces: list[str]) -> None:
    parsed = MathTIRPrompt().parse_action("".join(pieces), {})
    turn = parse_turn(parsed.action)
    assert parsed.valid == (turn.answer is not None or turn.code is not None)


def test_charset_covers_every_question() -> None:
    allowed = set(CHARSET)
    for split in ("train", "test"):
        for task in MathTIREnv(split=split).tasks:
            assert set(task.question) <= allowed, task.task_id


def test_custom_records_and_render() -> None:
    with MathTIREnv(tasks=[("What is 6 times 7?", "42")], render_mode="ansi", sandbox=SANDBOX) as e:
        obs, info = e.reset()
        assert obs == "What is 6 times 7?" and info["task_id"] == "custom/00000"
        e.step(code("print(6 * 7)"))
        assert e.step("\\boxed{42}")[1] == 1.0
        assert "> I will compute." in (e.render() or "")


def test_close_leaves_no_sandbox_process() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = SandboxConfig(timeout_s=2.5)  # its own shared pool
    first, second = MathTIREnv(sandbox=config), MathTIREnv(sandbox=config)
    for e in (first, second):
        e.reset(seed=0)
        assert e.step(code("print(1)"))[4]["tool_status"] == "ok"
    zygotes = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert zygotes
    first.close()
    assert second.step(code("print(2)"))[0].endswith(f"2\n{FENCE}")  # the pool is shared and still up
    second.close()
    assert not any(psutil.pid_exists(pid) for pid in zygotes)  # close() waits for them


@pytest.mark.slow
def test_scripted_solver_solves_the_test_split_through_the_sandbox() -> None:
    with MathTIREnv(split="test") as e:
        agent = MathSolverAgent(e.tasks)
        results = [play_episode(e, agent, options={"task_id": t.task_id}) for t in e.tasks]
    assert len(results) == 600
    assert all(r.final_info["tool_calls"] >= 1 for r in results)  # every answer came through the tool
    success = sum(r.won for r in results) / len(results)
    assert success >= 0.95, success  # measured: 1.0 (600/600)


def test_stateful_tool_keeps_names_from_earlier_successful_blocks() -> None:
    with MathTIREnv(source="procedural", split="test", stateful_tool=True, sandbox=SANDBOX) as e:
        e.reset(seed=0)
        assert e.step(code("a = 6\nprint('set')"))[0] == f"{FENCE}output\nset\n{FENCE}"
        assert "ZeroDivisionError" in e.step(code("b = 1 / 0"))[0]  # failed blocks are not replayed
        assert e.step(code("print(a * 7)"))[0] == f"{FENCE}output\n42\n{FENCE}"  # replay prints nothing
        e.reset(seed=0)
        assert "NameError" in e.step(code("print(a)"))[0]  # a new episode starts empty
    with MathTIREnv(source="procedural", split="test", sandbox=SANDBOX) as e:
        e.reset(seed=0)
        e.step(code("a = 6"))
        assert "NameError: name 'a' is not defined" in e.step(code("print(a)"))[0]


def test_config_object_and_overrides_agree() -> None:
    e = MathTIREnv(MathTIRConfig(source="procedural", split="test"), size=5)
    assert len(e.tasks) == 5 and e.config.source == "procedural"
