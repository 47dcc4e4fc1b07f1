"""Math task sets for Math-TIR: stable task ids, deterministic content, disjoint train/test splits.

Three sources, each task carrying a *reference solution program* (Python that prints the answer), which
the scripted solver (``streamrl.agents.math_solver``) sends through the real sandbox:

* ``gsm_symbolic`` -- ``reasoning-gym==0.1.25``'s GSM8K-derived templates (Apache-2.0). The training split
  is 1,500 problems (seed 42; docs/platform.md §5); the test split is drawn with another seed
  and keeps only questions absent from the training split (the two share templates, as GSM-Symbolic
  variants do). Solution programs are translated from each problem's worked solution
  (``metadata["answer_cot"]``): every ``<arithmetic> = <number>`` it states becomes one Python line; a
  problem whose worked arithmetic cannot be translated to its final answer gets a program that prints the
  answer key and says so (``MathTask.solution_kind == "answer_key"``; see :func:`solution_coverage`).
* ``procedural`` -- our own generator of multi-step arithmetic and algebra word problems with exact
  (``Fraction``) answers: thirteen families (docs/platform.md §5) plus two chained
  families where each step's result feeds the next. Its test split is ten times the others (3,000
  problems, about 200 per family), so that a held-out evaluation of one family has several hundred
  distinct tasks; generated SFT data (:func:`synthetic_procedural`) never draws a test problem.
* ``custom`` -- a user's own ``(question, answer)`` records (:func:`custom_tasks`).

This module turns the sources into task sets (ids, splits, sizes, the ``mixed`` interleaving); the
translation of worked solutions is :mod:`streamrl.envs.math_cot`, the generators
:mod:`streamrl.envs.math_procedural` (their public names are importable from here too).

Task ids are ``"<source>/<split>/<index>"`` (e.g. ``"gsm_symbolic/test/00017"``); with the pinned
reasoning-gym version and the fixed seeds below they name the same problem on every machine.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, get_args

from streamrl.envs.math_cot import cot_to_program
from streamrl.envs.math_procedural import PROCEDURAL_FAMILIES, sample_procedural

__all__ = [
    "GSM_TEST_SEED",
    "GSM_TRAIN_SEED",
    "MATH_SFT_FAMILIES",
    "PROCEDURAL_FAMILIES",
    "PROCEDURAL_TEST_SIZE",
    "SFT_POOLS",
    "MathTask",
    "SolutionKind",
    "Source",
    "Split",
    "TaskOrigin",
    "cot_to_program",
    "custom_tasks",
    "extra_training_tasks",
    "gsm_symbolic_tasks",
    "procedural_records",
    "procedural_tasks",
    "solution_coverage",
    "synthetic_procedural",
    "task_set",
]

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = get_args(Split)
Source = Literal["gsm_symbolic", "procedural", "mixed"]
"""A task set to draw from: one source, or both interleaved (``"mixed"``)."""
SOURCES: tuple[Source, ...] = get_args(Source)
SolutionKind = Literal["program", "cot", "answer_key"]
"""Where a task's solution program comes from (see :class:`MathTask`)."""
TaskOrigin = Literal["gsm_symbolic", "procedural", "custom"]
"""Which source a single task came from (``"custom"``: a user's record)."""

TRAIN_SIZE = 1500
TEST_SIZE = 300
"""Test problems of ``gsm_symbolic`` (and of each source in ``mixed``); the first 300 of ``procedural``'s."""
PROCEDURAL_TEST_SIZE = 3000
"""Test problems of ``procedural``: about 200 per family (405 in ``MATH_SFT_FAMILIES``), so that a held-out
evaluation has several hundred distinct tasks, the unit of its intervals. The first ``TEST_SIZE`` are the split
as it was before it grew (same ids, same problems)."""
MATH_SFT_FAMILIES: tuple[str, ...] = ("mod", "combin", "series")
"""Procedural families the SFT recipe trains and evaluates on: their reference programs are one line
(``print(pow(30, 170, 46))``, ``print(math.comb(11, 3))``, ``print(sum(7 + 3 * i for i in range(25)))``), so a
~2M-parameter model trained from scratch only has to learn to copy two or three numbers from the question into
the program and the tool's output into ``\\boxed{}``. Longer programs need a pretrained model."""
SFT_POOLS: tuple[tuple[int, int], ...] = (
    (0, 3000),
    (1000, 3000),
    (2000, 3000),
    (-1, 100),
    (-1001, 100),
    (-2001, 100),
)
"""``(seed, n)`` of the generated SFT problems (:func:`synthetic_procedural`) the shipped checkpoints were built
from: the 3-epoch and 12-epoch recipes' synthetic data (seed 0 and its restarts 1000, 2000) and their validation
draws (``-1 - seed``). They were drawn when the test split had its first 300 problems only; the rest of the test
split avoids them, so those draws (and the checkpoints' data) are unchanged now that every draw avoids the whole
split."""
GSM_TRAIN_SEED = 42
GSM_TEST_SEED = 20_260_101
PROCEDURAL_TRAIN_SEED = 0
PROCEDURAL_TEST_SEED = 1_000_003
EXTRA_TRAIN_SEED = 5000
"""Seed of :func:`extra_training_tasks`' draw (none of ``SFT_POOLS``' seeds)."""
EXTRA_TRAIN_MAX = 10_000
"""Most extra training tasks: the SFT families hold finitely many distinct problems (``combin`` about 50), and a
draw beyond what they hold would never end."""


@dataclass(frozen=True)
class MathTask:
    """One problem: stable id, question text, exact ground-truth answer, and a reference program.

    ``solution`` is Python source that prints the answer; ``solution_kind`` says where it came from:
    ``"program"`` (written with a procedural problem), ``"cot"`` (translated from a worked solution),
    ``"answer_key"`` (prints the known answer; no computation was recoverable).
    """

    task_id: str
    question: str
    answer: str
    solution: str
    solution_kind: SolutionKind
    source: TaskOrigin
    split: str
    meta: Mapping[str, Any] = field(default_factory=dict)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits are {SPLITS}")


def _check_size(size: int, maximum: int | None = None) -> None:
    if not isinstance(size, int) or size < 1 or (maximum is not None and size > maximum):
        top = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"size must be an int >= 1{top}, got {size!r}")


def answer_program(answer: str, note: str) -> str:
    """A program that prints a known answer, with a comment saying why nothing is computed."""
    return f"# {note}\nprint({answer!r})\n"


# --------------------------------------------------------------------------------------------------
# gsm_symbolic: reasoning-gym's problems, each with its worked solution as a program (math_cot)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _gsm_raw(seed: int, size: int) -> tuple[tuple[str, str, str], ...]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    return tuple(
        (entry["question"], str(entry["answer"]), str(entry["metadata"].get("answer_cot", "")))
        for entry in (dataset[i] for i in range(size))
    )


@functools.lru_cache(maxsize=2)
def _gsm_distinct(split: Split) -> tuple[tuple[str, str, str], ...]:
    """The full split: the first distinct questions of a seeded draw (test: none that occur in train)."""
    want = TRAIN_SIZE if split == "train" else TEST_SIZE
    exclude = set() if split == "train" else {q for q, _, _ in _gsm_distinct("train")}
    seed = GSM_TRAIN_SEED if split == "train" else GSM_TEST_SEED
    out: list[tuple[str, str, str]] = []
    for entry in _gsm_raw(seed, 2 * want):
        if entry[0] not in exclude:
            exclude.add(entry[0])
            out.append(entry)
            if len(out) == want:
                return tuple(out)
    raise RuntimeError(  # pragma: no cover - guards a change of the pinned reasoning-gym version
        f"gsm_symbolic produced only {len(out)} distinct {split} problems, need {want}"
    )


@functools.lru_cache(maxsize=8)
def gsm_symbolic_tasks(split: Split = "train", size: int | None = None) -> tuple[MathTask, ...]:
    """reasoning-gym ``gsm_symbolic`` problems: ``train`` = 1,500 (seed 42), ``test`` = ``TEST_SIZE``
    problems whose questions never occur in ``train`` (nor twice in ``test``). ``size`` takes a prefix
    (ids do not change with it)."""
    _check_split(split)
    full = TRAIN_SIZE if split == "train" else TEST_SIZE
    size = full if size is None else size
    _check_size(size, full)
    raw = _gsm_distinct(split)[:size]
    tasks: list[MathTask] = []
    for question, answer, cot in raw:
        program = cot_to_program(cot, answer, question)
        kind: Literal["cot", "answer_key"] = "cot" if program is not None else "answer_key"
        if program is None:
            program = answer_program(answer, "The worked solution's arithmetic could not be translated.")
        tasks.append(
            MathTask(
                task_id=f"gsm_symbolic/{split}/{len(tasks):05d}",
                question=question,
                answer=answer,
                solution=program,
                solution_kind=kind,
                source="gsm_symbolic",
                split=split,
                meta={"answer_cot": cot},
            )
        )
    return tuple(tasks)


# --------------------------------------------------------------------------------------------------
# procedural: the generators' problems (math_procedural) as task sets
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def procedural_tasks(split: Split = "train", size: int | None = None) -> tuple[MathTask, ...]:
    """Procedural multi-step problems: ``train`` = 1,500, ``test`` = ``PROCEDURAL_TEST_SIZE``, disjoint by
    question; the test split also avoids the generated SFT problems of ``SFT_POOLS``. ``size`` takes a prefix
    (ids do not change with it)."""
    _check_split(split)
    full = TRAIN_SIZE if split == "train" else PROCEDURAL_TEST_SIZE
    size = full if size is None else size
    _check_size(size, full)
    if split == "train":
        raw = sample_procedural(PROCEDURAL_TRAIN_SEED, size)
    else:
        raw = sample_procedural(
            PROCEDURAL_TEST_SEED, size, exclude=_train_questions() | _sft_pool_questions()
        )
    return procedural_records(raw, f"procedural/{split}/", split, digits=5)


@functools.lru_cache(maxsize=1)
def _train_questions() -> frozenset[str]:
    return frozenset(q for q, *_ in sample_procedural(PROCEDURAL_TRAIN_SEED, TRAIN_SIZE))


@functools.lru_cache(maxsize=1)
def _sft_pool_questions() -> frozenset[str]:
    """The questions of ``SFT_POOLS`` as they were drawn, avoiding the first ``TEST_SIZE`` test problems (which
    never meet a pool problem: a draw that met one would have made it a test problem, so drawing the first 300
    test problems while avoiding the pools changes nothing)."""
    first = frozenset(
        q for q, *_ in sample_procedural(PROCEDURAL_TEST_SEED, TEST_SIZE, exclude=_train_questions())
    )
    return frozenset(q for seed, n in SFT_POOLS for q, *_ in _sft_draw(seed, n, first))


def _sft_draw(seed: int, n: int, exclude: frozenset[str]) -> list[tuple[str, str, str, str, int]]:
    return sample_procedural(f"streamrl-sft-math-{seed}", n, exclude=exclude, families=MATH_SFT_FAMILIES)


def synthetic_procedural(n: int, seed: int) -> tuple[MathTask, ...]:
    """``n`` freshly generated problems of ``MATH_SFT_FAMILIES`` drawn with a seed of their own (``seed``), none
    of whose questions is in the ``test`` split (they may repeat a training problem): cheap extra expert data
    for SFT (``"sft-synthetic/<seed>/<index>"`` ids, split ``"train"``)."""
    if n < 0:
        raise ValueError(f"the number of synthetic tasks must be >= 0, got {n}")
    held_out = frozenset(t.question for t in procedural_tasks("test"))
    return procedural_records(_sft_draw(seed, n, held_out), f"sft-synthetic/{seed}/", "train")


@functools.lru_cache(maxsize=4)
def extra_training_tasks(n: int) -> tuple[MathTask, ...]:
    """``n`` more training problems of ``MATH_SFT_FAMILIES`` for RL (``MathTIRConfig.extra_train``): a draw with
    ``EXTRA_TRAIN_SEED`` that avoids every ``test`` and ``train`` question and every generated SFT problem of
    ``SFT_POOLS``, so each is a distinct task the cold start never saw (``"procedural/train-extra/<index>"`` ids,
    split ``"train"``). The draw is sequential, so ``n`` takes a prefix of a larger draw: the same ids name the
    same problems at every ``n``."""
    if not isinstance(n, int) or not 0 <= n <= EXTRA_TRAIN_MAX:
        raise ValueError(
            f"the number of extra training tasks must be an int in [0, {EXTRA_TRAIN_MAX}], got {n!r}"
        )
    if n == 0:
        return ()
    test = frozenset(t.question for t in procedural_tasks("test"))
    raw = _sft_draw(EXTRA_TRAIN_SEED, n, test | _train_questions() | _sft_pool_questions())
    return procedural_records(raw, "procedural/train-extra/", "train", digits=5)


def procedural_records(
    raw: Sequence[tuple[str, str, str, str, int]], id_prefix: str, split: Split, digits: int = 6
) -> tuple[MathTask, ...]:
    """:class:`MathTask` records of problems drawn by :func:`sample_procedural`; task ids are ``id_prefix``
    followed by the problem's index, zero-padded to ``digits``."""
    return tuple(
        MathTask(
            task_id=f"{id_prefix}{i:0{digits}d}",
            question=question,
            answer=answer,
            solution=code,
            solution_kind="program",
            source="procedural",
            split=split,
            meta={"family": family, "difficulty": difficulty},
        )
        for i, (question, answer, code, family, difficulty) in enumerate(raw)
    )


# --------------------------------------------------------------------------------------------------
# user records, mixing, coverage
# --------------------------------------------------------------------------------------------------


def custom_tasks(
    records: Iterable[Mapping[str, Any] | Sequence[Any]], split: str = "custom"
) -> tuple[MathTask, ...]:
    """Tasks from a user's records: ``{"question": ..., "answer": ...}`` mappings (optional ``"task_id"``,
    ``"solution"``) or ``(question, answer)`` pairs. Answers may be numbers or strings (LaTeX allowed)."""
    tasks: list[MathTask] = []
    ids: set[str] = set()
    for i, record in enumerate(records):
        if isinstance(record, Mapping):
            if "question" not in record or "answer" not in record:
                raise ValueError(f"record {i} needs 'question' and 'answer' keys, got keys {sorted(record)}")
            question, answer = record["question"], record["answer"]
            task_id = str(record.get("task_id", f"custom/{i:05d}"))
            solution = record.get("solution")
        elif isinstance(record, Sequence) and not isinstance(record, str) and len(record) == 2:
            question, answer = record
            task_id, solution = f"custom/{i:05d}", None
        else:
            raise ValueError(f"record {i} must be a mapping or a (question, answer) pair, got {record!r}")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"record {i}: question must be a non-empty str, got {question!r}")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float | Fraction):
            raise ValueError(f"record {i}: answer must be a str or a number, got {answer!r}")
        answer = str(answer).strip()
        if not answer:
            raise ValueError(f"record {i}: answer is empty")
        if task_id in ids:
            raise ValueError(f"record {i}: duplicate task_id {task_id!r}")
        ids.add(task_id)
        kind: Literal["program", "answer_key"] = "program" if solution else "answer_key"
        program = (
            str(solution) if solution else answer_program(answer, "User record without a solution program.")
        )
        tasks.append(MathTask(task_id, question, answer, program, kind, "custom", split))
    if not tasks:
        raise ValueError("records is empty; pass at least one (question, answer) record")
    return tuple(tasks)


def task_set(
    source: Source = "mixed", split: Split = "train", size: int | None = None
) -> tuple[MathTask, ...]:
    """The tasks of ``source`` (``"gsm_symbolic"``, ``"procedural"`` or ``"mixed"``) and ``split``.

    ``"mixed"`` interleaves the two sources (gsm_symbolic first), ``size`` tasks in all (default: both
    full splits; of the larger procedural test split, its first ``TEST_SIZE`` problems).
    """
    if source == "gsm_symbolic":
        return gsm_symbolic_tasks(split, size)
    if source == "procedural":
        return procedural_tasks(split, size)
    if source != "mixed":
        raise ValueError(f"unknown source {source!r}; valid sources are {SOURCES}")
    _check_split(split)
    full = TRAIN_SIZE if split == "train" else TEST_SIZE
    if size is not None:
        _check_size(size, 2 * full)
    gsm = gsm_symbolic_tasks(split)
    proc = procedural_tasks(split, len(gsm))  # the procedural test split is larger: its first problems
    mixed = [t for pair in zip(gsm, proc, strict=True) for t in pair]
    return tuple(mixed if size is None else mixed[:size])


def solution_coverage(tasks: Iterable[MathTask]) -> dict[str, float]:
    """Fraction of tasks per ``solution_kind`` (how many reference programs really compute)."""
    counts: dict[str, int] = {"program": 0, "cot": 0, "answer_key": 0}
    total = 0
    for task in tasks:
        counts[task.solution_kind] += 1
        total += 1
    return {kind: count / total for kind, count in counts.items()} if total else {}
