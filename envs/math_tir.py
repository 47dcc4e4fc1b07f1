"""``streamrl/MathTIR-v0``: math word problems solved with a sandboxed Python tool (tool-integrated reasoning).

Episode protocol (the ToRL / SimpleTIR / SPO-recipe format):

* ``reset`` returns the problem text.
* Each action is the agent's whole turn (text). If it holds a final answer ``\\boxed{...}`` outside any code
  block, the episode terminates: reward 1.0 when the answer is mathematically equal to the ground truth
  (:func:`streamrl.envs.math_answer.answers_equal`), else 0.0.
* Otherwise, if it holds a fenced ```` ```python ```` block (the last one counts), the block runs in the
  sandbox (a fresh process per call; with ``stateful_tool=True`` the episode's earlier successful
  blocks are replayed first, so their names stay defined) and the next observation is its stdout --
  or, on failure, the last line of the traceback -- inside ```` ```output ```` fences, cut to
  ``max_output_chars`` (head + tail). At most ``max_tool_calls`` calls run; later code blocks are refused.
* A turn with neither is invalid (``info["action_valid"] = False``); the observation says what was expected.
* After ``max_turns`` turns without an answer the episode is truncated with reward 0.

``info`` always carries ``task_id``, ``question``, ``won``, ``tool_calls``, ``action_valid``, ``answer`` (the
extracted final answer or ``None``), ``ground_truth``, ``turn``; after a tool call also ``tool_status``.

The env starts no process until the first tool call; then it uses the process-wide sandbox pool
(:func:`streamrl.envs.sandbox.acquire_shared_pool`), which the last env to close shuts down. Answers that
need a symbolic check (anything but a plain number) are judged the same way, in a sandbox process of their
own that is killed after ``answer_timeout_s`` (:mod:`streamrl.envs.math_answer`), so no answer can hang a step.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gymnasium import spaces
from streamrl.envs.base import TextEnv
from streamrl.envs.math_answer import answers_equal, extract_boxed, grading_sandbox
from streamrl.envs.math_tasks import (
    EXTRA_TRAIN_MAX,
    SOURCES,
    SPLITS,
    MathTask,
    Source,
    Split,
    custom_tasks,
    extra_training_tasks,
    task_set,
)
from streamrl.envs.sandbox import (
    SandboxConfig,
    SandboxPool,
    acquire_shared_pool,
    check_isolation,
    error_summary,
    release_shared_pool,
    truncate_middle,
)

__all__ = ["CHARSET", "MathTIRConfig", "MathTIREnv", "parse_turn"]

# Every character an observation may hold; anything else (rare in tool output) becomes U+FFFD. Gymnasium's
# Text space needs a finite character set, and check_env samples actions from it.
CHARSET = "".join(
    dict.fromkeys(
        string.printable
        + "".join(chr(c) for c in range(0xA0, 0x180))  # Latin-1 supplement, Latin Extended-A
        + "€£¥₹¢×÷−–—‘’“”„…•·°±≤≥≠≈≡∞√∛π∑∏∫∂∆∇∈∉∩∪⊂⊆⊇∀∃∅→←↔⇒⇔′″‰"
        + "αβγδεζηθικλμνξοπρστυφχψωΓΔΘΛΞΠΣΦΨΩ⁰¹²³⁴⁵⁶⁷⁸⁹₀₁₂₃₄₅₆₇₈₉½⅓¼¾✓✗\ufffd"
    )
)
_CHARSET = frozenset(CHARSET)

_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\r?\n(.*?)```", re.DOTALL)
_OPEN_CODE = re.compile(r"```(?:python|py)\b")


@dataclass(frozen=True)
class MathTIRConfig:
    """Settings of :class:`MathTIREnv`."""

    source: Source = "mixed"
    """Task source: ``"gsm_symbolic"`` (word problems), ``"procedural"`` (multi-step arithmetic/algebra,
    where a calculator pays off: big powers mod m, equation systems) or ``"mixed"`` (both, interleaved;
    the default, so a policy learns both to read a problem and to compute with the tool). Ignored when
    custom ``tasks`` are given."""
    split: Split = "train"
    """``"train"`` (1,500 problems per source) or ``"test"`` (disjoint from train: 300 ``gsm_symbolic``
    problems, 3,000 ``procedural`` ones, 600 ``mixed``)."""
    size: int | None = None
    """Use only the first ``size`` tasks of the split (``None`` = all)."""
    extra_train: int = 0
    """On the ``train`` split, this many more problems after its first ``size``: fresh draws of the SFT families
    (:func:`~streamrl.envs.math_tasks.extra_training_tasks`), none of them a train or test problem. More distinct
    tasks for RL at the same budget of episodes: the train split has 271 of those families. The ``test`` split
    ignores it, so one ``env_kwargs`` serves a run's training and held-out envs. Ignored with custom ``tasks``."""
    max_tool_calls: int = 8
    """Code blocks run per episode (ToRL's cap); later ones are refused with an explanation."""
    max_turns: int = 10
    """Turns (actions) before truncation; must be > ``max_tool_calls`` so an answer turn fits."""
    max_output_chars: int = 512
    """Tool output shown to the agent per call: head + tail of this many characters."""
    stateful_tool: bool = False
    """``False`` (default): every code block runs on its own, as in ToRL. ``True``: names defined by the
    episode's earlier *successful* blocks stay defined, notebook-style -- implemented statelessly by
    replaying those blocks (their output discarded) before the new one in the same fresh process."""
    max_action_chars: int = 16_384
    """Longest turn accepted; longer ones are invalid (and the action space's ``max_length``)."""
    max_observation_chars: int = 8_192
    """Observations are cut (head + tail) to this length (the observation space's ``max_length``)."""
    answer_timeout_s: float = 5.0
    """Time bound of one symbolic answer check (math-verify / sympy, in a process killed at the bound)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits and isolation mode of the Python tool sandbox (and the answer checker's, which follows its
    ``isolation``)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is unknown; valid sources are {SOURCES}")
        if self.split not in SPLITS:
            raise ValueError(f"split={self.split!r} is unknown; valid splits are {SPLITS}")
        if not isinstance(self.extra_train, int) or not 0 <= self.extra_train <= EXTRA_TRAIN_MAX:
            raise ValueError(
                f"extra_train must be an int in [0, {EXTRA_TRAIN_MAX}] (0: the split's own tasks), got {self.extra_train!r}"
            )
        if self.max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {self.max_tool_calls}")
        if self.max_turns <= self.max_tool_calls:
            raise ValueError(
                f"max_turns={self.max_turns} must exceed max_tool_calls={self.max_tool_calls} "
                "(the answer needs a turn of its own)"
            )
        for name, low in (("max_output_chars", 16), ("max_action_chars", 64), ("max_observation_chars", 256)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.answer_timeout_s <= 0:
            raise ValueError(f"answer_timeout_s must be > 0, got {self.answer_timeout_s}")


@dataclass(frozen=True)
class ParsedTurn:
    """What a turn asks for: a final ``answer``, ``code`` to run, or neither (``problem`` says why)."""

    answer: str | None = None
    code: str | None = None
    problem: str | None = None


def parse_turn(text: str) -> ParsedTurn:
    """Split a turn into a final answer (a ``\\boxed{}`` outside code blocks) or the last python block."""
    blocks = list(_CODE_BLOCK.finditer(text))
    prose = _CODE_BLOCK.sub(" ", text)
    if "\\boxed" in prose or "\\fbox" in prose:
        answer = extract_boxed(prose)
        if answer is None:
            return ParsedTurn(problem="the \\boxed{ of your answer is never closed with }")
        if not answer:
            return ParsedTurn(problem="\\boxed{} is empty; put the final answer inside it")
        return ParsedTurn(answer=answer)
    if blocks:
        return ParsedTurn(code=blocks[-1].group(1))
    if _OPEN_CODE.search(text):
        return ParsedTurn(problem="the ```python block is not closed with ``` on its own line")
    return ParsedTurn()


def _replay(cells: Sequence[str]) -> str:
    """Python that re-runs earlier cells silently in the current namespace (for ``stateful_tool``)."""
    if not cells:
        return ""
    lines = [
        "import contextlib as _streamrl_ctx, io as _streamrl_io",
        "with _streamrl_ctx.redirect_stdout(_streamrl_io.StringIO()):",
    ]
    for i, cell in enumerate(cells, 1):
        lines.append(f"    exec(compile({cell!r}, '<cell {i}>', 'exec'))")
    return "\n".join(lines) + "\ndel _streamrl_ctx, _streamrl_io\n"


def _clean_text(text: str | bytes) -> str:
    """Valid UTF-8 only: undecodable bytes and lone surrogates become U+FFFD."""
    if isinstance(text, bytes):
        return text.decode("utf-8", errors="replace")
    return text.encode("utf-8", errors="replace").decode("utf-8") if not text.isascii() else text


class MathTIREnv(TextEnv):
    """Math problems with a Python tool; see the module docstring for the episode protocol.

    Args:
        config: all settings (:class:`MathTIRConfig`); keyword ``overrides`` replace single fields, so
            ``gym.make("streamrl/MathTIR-v0", split="test", max_tool_calls=4)`` works.
        tasks: your own ``(question, answer)`` records or ``{"question", "answer"[, "task_id"]}`` mappings
            (or ready :class:`MathTask` objects); replaces the built-in task set.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the episode's transcript).

    ``task_ids`` lists the task ids; ``tasks`` the full records (question, answer, reference program), in
    the same order.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 - gymnasium's own convention

    def __init__(
        self,
        config: MathTIRConfig | None = None,
        *,
        tasks: Iterable[MathTask | Mapping[str, Any] | Sequence[Any]] | None = None,
        render_mode: str | None = None,
        **overrides: Any,
    ) -> None:
        config = config or MathTIRConfig()
        if overrides:
            unknown = sorted(set(overrides) - set(MathTIRConfig.__dataclass_fields__))
            if unknown:
                raise TypeError(
                    f"unknown MathTIREnv option(s) {unknown}; valid: {sorted(MathTIRConfig.__dataclass_fields__)}"
                )
            config = replace(config, **overrides)
        self.config = config
        # Refuse here, not at the first tool call, where the kernel cannot isolate model code.
        check_isolation(config.sandbox)
        self.tasks = self._load_tasks(tasks)
        super().__init__([t.task_id for t in self.tasks], render_mode=render_mode)
        self._by_id = {t.task_id: t for t in self.tasks}
        self.observation_space = spaces.Text(config.max_observation_chars, min_length=1, charset=CHARSET)
        self.action_space = spaces.Text(config.max_action_chars, min_length=0, charset=CHARSET)
        self._pool: SandboxPool | None = None  # the tool's sandbox (started at the first tool call)
        self._grader: SandboxPool | None = None  # the answer checker's (started at the first symbolic check)
        self._task: MathTask | None = None
        self._turn = 0
        self._tool_calls = 0
        self._cells: list[str] = []  # successful code blocks of this episode (for stateful_tool)
        self._transcript: list[str] = []

    def _load_tasks(self, tasks: Iterable[Any] | None) -> tuple[MathTask, ...]:
        c = self.config
        if tasks is None:
            extra = extra_training_tasks(c.extra_train) if c.split == "train" else ()
            return task_set(c.source, c.split, c.size) + extra
        items = list(tasks)
        if items and all(isinstance(t, MathTask) for t in items):
            loaded: tuple[MathTask, ...] = tuple(items)
        else:
            loaded = custom_tasks(items)
        return loaded if c.size is None else loaded[: c.size]

    def _describe_tasks(self) -> str:
        return f"source={self.config.source!r}, split={self.config.split!r}"

    # ---- TextEnv hooks ---------------------------------------------------------------------------
    def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
        self._task = self._by_id[task_id]
        self._turn = self._tool_calls = 0
        self._cells = []
        obs = self._observation(self._task.question)
        self._transcript = [obs]
        return obs, self._info(action_valid=True, answer=None)

    def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play one turn: judge a ``\\boxed{}`` answer, run a python block, or explain what was expected.
        ``bytes`` are accepted and decoded (invalid UTF-8 becomes U+FFFD)."""
        assert self._task is not None
        if not isinstance(action, str | bytes):
            raise TypeError(f"action must be a str (the agent's turn), got {type(action).__name__}")
        text = _clean_text(action)
        self._turn += 1
        reward, terminated, answer = 0.0, False, None
        extra: dict[str, Any] = {}
        valid = True
        if len(text) > self.config.max_action_chars:
            valid = False
            obs = (
                f"Invalid action: the turn is {len(text)} characters long; at most "
                f"{self.config.max_action_chars} are accepted."
            )
        else:
            turn = parse_turn(text)
            if turn.answer is not None:
                answer, terminated = turn.answer, True
                if self._grader is None:
                    grading = grading_sandbox(self.config.answer_timeout_s)
                    isolation = self.config.sandbox.isolation  # the same choice as the tool's
                    self._grader = acquire_shared_pool(replace(grading, isolation=isolation))
                won = answers_equal(
                    answer, self._task.answer, timeout_s=self.config.answer_timeout_s, pool=self._grader
                )
                reward = 1.0 if won else 0.0
                obs = f"Final answer received: {answer}. It is {'correct' if won else 'incorrect'}."
            elif turn.code is not None:
                obs, valid, extra = self._run_tool(turn.code)
            else:
                valid = False
                why = f" ({turn.problem})" if turn.problem else ""
                obs = (
                    f"Invalid action{why}. Expected either Python code in a ```python ... ``` block (its printed "
                    "output comes back) or the final answer written as \\boxed{answer}."
                )
        truncated = not terminated and self._turn >= self.config.max_turns
        if truncated:
            obs += (
                f"\nThe turn limit ({self.config.max_turns}) is reached; the episode ends without an answer."
            )
        obs = self._observation(obs)
        self._transcript += [f"> {text}", obs]
        info = self._info(action_valid=valid, answer=answer, won=reward == 1.0)
        info.update(extra)
        return obs, reward, terminated, truncated, info

    def _run_tool(self, code: str) -> tuple[str, bool, dict[str, Any]]:
        """Run ``code``; return the observation, whether the action was valid, and extra info."""
        if self._tool_calls >= self.config.max_tool_calls:
            return (
                f"Tool call refused: the limit of {self.config.max_tool_calls} code executions is used up. "
                "Give the final answer as \\boxed{answer}.",
                False,
                {"tool_status": "refused"},
            )
        if self._pool is None:
            self._pool = acquire_shared_pool(self.config.sandbox)
        self._tool_calls += 1
        program = _replay(self._cells) + code if self.config.stateful_tool else code
        result = self._pool.run(program)
        if result.ok:
            self._cells.append(code)
            shown = result.output if result.output.strip() else "(no output; print() the values you need)"
        else:
            shown = error_summary(result.output) or result.status  # ToRL: the last line of the traceback
        shown = truncate_middle(shown.rstrip("\n"), self.config.max_output_chars)
        return (
            f"```output\n{shown}\n```",
            True,
            {"tool_status": result.status, "tool_seconds": result.seconds},
        )

    def _observation(self, text: str) -> str:
        text = "".join(ch if ch in _CHARSET else "\ufffd" for ch in _clean_text(text))
        return truncate_middle(text, self.config.max_observation_chars) or " "

    def _info(self, *, action_valid: bool, answer: str | None, won: bool = False) -> dict[str, Any]:
        assert self._task is not None
        return {
            "task_id": self._task.task_id,
            "question": self._task.question,
            "ground_truth": self._task.answer,
            "won": won,
            "tool_calls": self._tool_calls,
            "action_valid": action_valid,
            "answer": answer,
            "turn": self._turn,
        }

    def task(self, task_id: str) -> MathTask:
        """The task record named ``task_id`` (question, answer, reference solution program)."""
        if task_id not in self._by_id:
            raise KeyError(f"unknown task_id {task_id!r}")
        return self._by_id[task_id]

    @property
    def current_task(self) -> MathTask | None:
        """The task of the episode in progress (``None`` before the first reset)."""
        return self._task

    def render(self) -> str | None:  # type: ignore[override]
        if self.render_mode == "ansi":
            return "\n".join(self._transcript)
        return None

    def close(self) -> None:
        """Release this env's hold on the shared sandbox pools (the last holder stops their processes)."""
        for pool in (self._pool, self._grader):
            if pool is not None:
                release_shared_pool(pool)
        self._pool = self._grader = None
        super().close()
