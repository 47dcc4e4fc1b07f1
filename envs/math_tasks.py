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
  families where each step's result feeds the next.
* ``custom`` -- a user's own ``(question, answer)`` records (:func:`custom_tasks`).

Task ids are ``"<source>/<split>/<index>"`` (e.g. ``"gsm_symbolic/test/00017"``); with the pinned
reasoning-gym version and the fixed seeds below they name the same problem on every machine.
"""

from __future__ import annotations

import ast
import functools
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, get_args

__all__ = [
    "GSM_TEST_SEED",
    "GSM_TRAIN_SEED",
    "PROCEDURAL_FAMILIES",
    "MathTask",
    "SolutionKind",
    "Source",
    "Split",
    "TaskOrigin",
    "cot_to_program",
    "custom_tasks",
    "gsm_symbolic_tasks",
    "procedural_records",
    "procedural_tasks",
    "solution_coverage",
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
GSM_TRAIN_SEED = 42
GSM_TEST_SEED = 20_260_101
PROCEDURAL_TRAIN_SEED = 0
PROCEDURAL_TEST_SEED = 1_000_003


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
# gsm_symbolic: worked solution -> Python
# --------------------------------------------------------------------------------------------------

_RESULT = re.compile(r"=\s*[$€£¥₹]?\s*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)(\s*%)?")
_NUM = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w.])")
_ALLOWED_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.Pow,
    ast.USub,
    ast.UAdd,
)


def _arith_value(expr: str) -> Fraction | None:
    """Exact value of a +-*/ arithmetic expression over decimal literals (``None`` if it is not one)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    if not all(isinstance(node, _ALLOWED_NODES) for node in ast.walk(tree)):
        return None
    if not any(isinstance(node, ast.BinOp) for node in ast.walk(tree)):
        return None  # "= 24" restating a number is not a computation

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div):
                return left / right
            if isinstance(node.op, ast.Pow) and right.denominator == 1 and abs(right) <= 64:
                return left ** int(right)
        raise ValueError("unsupported")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _clean_arithmetic(text: str) -> str:
    """Turn the prose left of an ``=`` into arithmetic: operators, no currency, units or words."""
    s = text.replace("×", "*").replace("÷", "/").replace("−", "-").replace("^", "**")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # 1,000 -> 1000
    s = re.sub(r"[$€£¥₹]", "", s)
    s = re.sub(r"(\d)\s*%\s*of\b", r"\1/100*", s)
    s = re.sub(r"(\d+(?:\.\d+)?)\s*%", r"(\1/100)", s)
    s = re.sub(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])", " * ", s)
    s = re.sub(r"/\s*[A-Za-z]+", "", s)  # per-unit: 57/hour -> 57
    s = re.sub(r"[A-Za-z_'’]+", " ", s)
    s = re.sub(r"(\d|\))\s*\(", r"\1*(", s)  # implicit multiplication: 2(3+4), (1+2)(3+4)
    s = re.sub(r"\)\s*(\d)", r")*\1", s)
    return s


def _near(value: Fraction, target: Fraction) -> bool:
    """Equal up to the rounding a worked solution may show (two decimals, or 0.1 %)."""
    return abs(value - target) <= max(Fraction(1, 100), abs(target) / 1000)


def _arith_suffix(text: str, targets: Sequence[Fraction]) -> tuple[str, Fraction] | None:
    """Longest suffix of ``text`` (cut at a token boundary) that is arithmetic evaluating to one of
    ``targets``; returns it with its exact value."""
    s = _clean_arithmetic(text).rstrip()
    for m in re.finditer(r"[\d(.\-]", s):  # the first start gives the longest suffix
        candidate = s[m.start() :].strip()
        value = _arith_value(candidate)
        if value is not None and any(_near(value, t) for t in targets):
            tidy = re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", " ".join(candidate.split())))
            return tidy, value
    return None


def cot_to_program(cot: str, answer: str, question: str = "") -> str | None:
    """Translate a GSM8K-style worked solution into a Python program that prints ``answer``.

    Each stated computation ``<arithmetic> = <result>`` becomes ``step_k = <arithmetic>``; numbers that
    are earlier results (and not given in ``question``) are replaced by the step that computed them, so
    the program reads as the chain of reasoning. Returns ``None`` when no stated computation reaches the
    final answer.
    """
    try:
        final = Fraction(answer.replace(",", ""))
    except ValueError:
        return None
    given = {Fraction(n) for n in _NUM.findall(question.replace(",", ""))}
    lines: list[str] = []
    steps: list[tuple[str, Fraction]] = []
    final_step: str | None = None
    for raw_line in cot.splitlines():
        line = raw_line.strip()
        if not line or line.startswith("####"):
            continue
        lines.append(f"# {line}")
        prev_end = 0
        for m in _RESULT.finditer(line):
            stated = Fraction(m.group(1).replace(",", ""))
            # "131 / 524 * 100% = 25%": a percent result may be stated as 25 or mean 0.25.
            targets = (stated, stated / 100) if m.group(2) else (stated,)
            found = _arith_suffix(line[prev_end : m.start()], targets)
            prev_end = m.end()
            if found is None:
                continue
            expr, result = found
            known = {value: name for name, value in steps if value not in given}

            def substitute(num: re.Match[str], known: dict[Fraction, str] = known) -> str:
                return known.get(Fraction(num.group(1)), num.group(1))

            name = f"step_{len(steps) + 1}"
            lines.append(f"{name} = {_NUM.sub(substitute, expr)}")
            steps.append((name, result))
            finish = _finish(name, result, final)
            if finish is not None:
                final_step = finish
    if final_step is None:
        return None
    body = "\n".join(lines)
    header = "import math\n" if "math." in final_step else ""
    return f"{header}{body}\n{final_step}\nprint(round(answer, 6) if isinstance(answer, float) else answer)\n"


def _finish(name: str, value: Fraction, final: Fraction) -> str | None:
    """The line turning step ``name`` (exact ``value``) into the final answer, if it leads there."""
    import math

    if value == final or (final.denominator != 1 and _near(value, final)):
        return f"answer = {name}"
    if final.denominator == 1 and math.floor(value) == final:
        return f"answer = int({name} + 1e-9)  # whole units only"
    if final.denominator == 1 and round(value) == final:
        return f"answer = round({name})"
    if final.denominator == 1 and math.ceil(value) == final:
        return f"answer = math.ceil({name})  # a partly used one counts as a whole"
    if value * 100 == final or (final.denominator != 1 and _near(value * 100, final)):
        return f"answer = {name} * 100  # as a percentage"
    return None


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
# procedural problems (stdlib only), each with its program
# --------------------------------------------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena")
_ITEMS = (("notebook", "notebooks"), ("pencil", "pencils"), ("apple", "apples"), ("book", "books"))

Problem = tuple[str, Fraction, str]  # question, exact answer, program


def _shop(r: random.Random, d: int) -> Problem:
    n = r.choice(_NAMES)
    (_, a), (_, b) = r.sample(_ITEMS, 2)
    qa, qb, pa, pb = r.randint(2, 6 * d), r.randint(2, 6 * d), r.randint(2, 9 * d), r.randint(3, 12 * d)
    cost = qa * pa + qb * pb
    paid = (cost // 50 + 1 + r.randint(0, d)) * 50
    q = (
        f"{n} buys {qa} {a} at ${pa} each and {qb} {b} at ${pb} each, and pays with ${paid}. "
        f"How much change does {n} get, in dollars?"
    )
    code = f"cost = {qa} * {pa} + {qb} * {pb}\nchange = {paid} - cost\nprint(change)\n"
    return q, Fraction(paid - cost), code


def _percent(r: random.Random, d: int) -> Problem:
    price, disc, tax = r.randint(4, 40 * d) * 5, r.choice([10, 15, 20, 25, 30, 40]), r.choice([5, 8, 10, 20])
    q = (
        f"A jacket costs ${price}. It is discounted by {disc}%, and then a {tax}% sales tax is added to the "
        f"discounted price. What is the final price in dollars?"
    )
    code = (
        "from fractions import Fraction\n"
        f"discounted = {price} * Fraction(100 - {disc}, 100)\n"
        f"final = discounted * Fraction(100 + {tax}, 100)\nprint(final)\n"
    )
    return q, Fraction(price) * (100 - disc) / 100 * (100 + tax) / 100, code


def _rate(r: random.Random, d: int) -> Problem:
    v1, v2, t1, t2 = r.randint(30, 90), r.randint(30, 90), r.randint(1, 3 * d), r.randint(1, 3 * d)
    q = (
        f"A train travels at {v1} km/h for {t1} hours and then at {v2} km/h for {t2} hours. "
        f"What is its average speed for the whole trip in km/h?"
    )
    code = (
        "from fractions import Fraction\n"
        f"distance = {v1} * {t1} + {v2} * {t2}\nhours = {t1} + {t2}\nprint(Fraction(distance, hours))\n"
    )
    return q, Fraction(v1 * t1 + v2 * t2, t1 + t2), code


def _work(r: random.Random, d: int) -> Problem:
    a, b = r.sample([2, 3, 4, 5, 6, 8, 9, 10, 12, 15], 2)
    q = (
        f"One pipe fills a tank in {a} hours and another fills it in {b} hours. Working together, how many "
        f"hours do they take to fill the tank?"
    )
    code = f"from fractions import Fraction\nrate = Fraction(1, {a}) + Fraction(1, {b})\nprint(1 / rate)\n"
    return q, Fraction(a * b, a + b), code


def _ages(r: random.Random, d: int) -> Problem:
    n1, n2 = r.sample(_NAMES, 2)
    k, y, x = r.randint(2, 4), r.randint(3, 15), r.randint(3, 12)
    q = (
        f"{n1} is {k} times as old as {n2}. In {y} years, {n1} will be {(k - 1) * x} years older than {n2}. "
        f"How old is {n2} now?"
    )
    code = (
        "import sympy as sp\nc = sp.symbols('c')\n"
        f"# the age gap never changes: {k}c - c = {(k - 1) * x}\n"
        f"print(sp.solve(sp.Eq({k} * c - c, {(k - 1) * x}), c)[0])\n"
    )
    return q, Fraction(x), code


def _linear(r: random.Random, d: int) -> Problem:
    x0 = r.randint(-20, 20)
    a, c = r.sample(range(2, 10 * d), 2)
    b = r.randint(-50, 50)
    e = (a - c) * x0 + b
    q = f"Solve for x: {a}x + {b} = {c}x + {e}.".replace("+ -", "- ")
    code = f"import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(sp.Eq({a} * x + {b}, {c} * x + {e}), x)[0])\n"
    return q, Fraction(x0), code


def _system(r: random.Random, d: int) -> Problem:
    n = r.choice(_NAMES)
    p, qq, x, y = r.randint(2, 9), r.randint(10, 25), r.randint(3, 20 * d), r.randint(3, 20 * d)
    q = (
        f"{n} sold {x + y} tickets in total. Child tickets cost ${p} and adult tickets cost ${qq}. "
        f"The sales came to ${p * x + qq * y}. How many adult tickets were sold?"
    )
    code = (
        "import sympy as sp\nchild, adult = sp.symbols('child adult')\n"
        f"sol = sp.solve([child + adult - {x + y}, {p} * child + {qq} * adult - {p * x + qq * y}], [child, adult])\n"
        "print(sol[adult])\n"
    )
    return q, Fraction(y), code


def _quadratic(r: random.Random, d: int) -> Problem:
    r1, r2 = r.randint(-12, 12), r.randint(-12, 12)
    b, c = -(r1 + r2), r1 * r2
    poly = (
        "x^2"
        + (f" + {b}x" if b > 0 else f" - {-b}x" if b < 0 else "")
        + (f" + {c}" if c > 0 else f" - {-c}" if c < 0 else "")
    )
    q = f"Let a and b be the roots of {poly} = 0. Compute a^2 + b^2."
    code = (
        "import sympy as sp\nx = sp.symbols('x')\n"
        f"roots = sp.solve(x**2 + ({b}) * x + ({c}), x)\n"
        "a, b = (roots * 2)[:2]  # a double root counts twice\nprint(sp.expand(a**2 + b**2))\n"
    )
    return q, Fraction(r1 * r1 + r2 * r2), code


def _series(r: random.Random, d: int) -> Problem:
    a, k, n = r.randint(1, 30), r.randint(2, 9), r.randint(10, 40 * d)
    q = (
        f"A sequence starts at {a} and each term is {k} more than the previous one. "
        f"What is the sum of the first {n} terms?"
    )
    code = f"print(sum({a} + {k} * i for i in range({n})))\n"
    return q, Fraction(n * (2 * a + (n - 1) * k), 2), code


def _ratio(r: random.Random, d: int) -> Problem:
    p, qq = r.sample(range(1, 9), 2)
    unit = r.randint(5, 40 * d)
    n1, n2 = r.sample(_NAMES, 2)
    f = r.choice([Fraction(1, 2), Fraction(1, 3), Fraction(1, 4), Fraction(2, 5)])
    q = (
        f"{n1} and {n2} share ${(p + qq) * unit} in the ratio {p}:{qq}. {n2} then spends {f} of their share. "
        f"How many dollars does {n2} have left?"
    )
    code = (
        "from fractions import Fraction\n"
        f"share = Fraction({(p + qq) * unit} * {qq}, {p} + {qq})\n"
        f"print(share * (1 - Fraction({f.numerator}, {f.denominator})))\n"
    )
    return q, qq * unit * (1 - f), code


def _combin(r: random.Random, d: int) -> Problem:
    n, k = r.randint(6, 12 + 2 * d), r.randint(2, 5)
    q = f"In how many ways can a committee of {k} be chosen from {n} people?"
    import math

    return q, Fraction(math.comb(n, k)), f"import math\nprint(math.comb({n}, {k}))\n"


def _mod(r: random.Random, d: int) -> Problem:
    b, e, m = r.randint(2, 30), r.randint(20, 200 * d), r.randint(7, 97)
    q = f"What is the remainder when {b}^{e} is divided by {m}?"
    return q, Fraction(pow(b, e, m)), f"print(pow({b}, {e}, {m}))\n"


def _tiles(r: random.Random, d: int) -> Problem:
    length, width, s, ts = r.randint(10, 40 * d), r.randint(8, 30 * d), r.randint(2, 6), r.choice([1, 2])
    length, width = length - length % ts, width - width % ts
    q = (
        f"A room is {length} m by {width} m. A {s} m by {s} m square area is left uncovered and the rest is "
        f"covered with tiles measuring {ts} m by {ts} m. How many tiles are needed?"
    )
    code = (
        "from fractions import Fraction\n"
        f"area = {length} * {width} - {s} * {s}\nprint(Fraction(area, {ts} * {ts}))\n"
    )
    return q, Fraction(length * width - s * s, ts * ts), code


def _chain(r: random.Random, d: int) -> Problem:
    """2-4 operations on one quantity, each step's result feeding the next (multi-step reasoning)."""
    n = r.choice(_NAMES)
    value = r.randint(10, 60) * r.choice([2, 3, 4, 6])
    sentences = [f"{n} starts the week with {value} marbles."]
    code = [f"marbles = {value}"]
    for _ in range(r.randint(2, 1 + 2 * d if d > 1 else 2)):
        op = r.choice(["buy", "give_fraction", "double", "lose", "share"])
        if op == "buy":
            bags, per = r.randint(2, 5 * d), r.randint(3, 12)
            sentences.append(f"Then {n} buys {bags} bags with {per} marbles in each bag.")
            code.append(f"marbles += {bags} * {per}")
            value += bags * per
        elif op == "give_fraction" and value % 3 == 0:
            sentences.append(f"Next, {n} gives away one third of the marbles.")
            code.append("marbles -= marbles // 3")
            value -= value // 3
        elif op == "double":
            sentences.append(f"A friend then gives {n} as many marbles as {n} already has.")
            code.append("marbles *= 2")
            value *= 2
        elif op == "share" and value % 4 == 0:
            sentences.append(f"{n} then keeps a quarter of the marbles and puts the rest in a jar.")
            code.append("marbles //= 4")
            value //= 4
        else:
            lost = r.randint(1, max(1, value // 3))
            sentences.append(f"Then {n} loses {lost} marbles.")
            code.append(f"marbles -= {lost}")
            value -= lost
    sentences.append(f"How many marbles does {n} have at the end?")
    return " ".join(sentences), Fraction(value), "\n".join(code) + "\nprint(marbles)\n"


def _chain_money(r: random.Random, d: int) -> Problem:
    """Earn at an hourly rate, pay a percentage in tax, then buy items: three dependent steps."""
    n = r.choice(_NAMES)
    rate, hours, tax = r.randint(8, 30), r.randint(5, 20 * d), r.choice([10, 20, 25, 50])
    price = r.randint(3, 15)
    q = (
        f"{n} earns ${rate} per hour and works {hours} hours. {tax}% of the pay goes to taxes. With the rest, "
        f"{n} buys as many ${price} games as possible. How many dollars are left over?"
    )
    net = Fraction(rate * hours) * (100 - tax) / 100
    left = net - price * (net // price)
    code = (
        "from fractions import Fraction\n"
        f"pay = {rate} * {hours}\nnet = pay * Fraction(100 - {tax}, 100)\n"
        f"games = net // {price}\nprint(net - games * {price})\n"
    )
    return q, left, code


PROCEDURAL_FAMILIES: dict[str, Callable[[random.Random, int], Problem]] = {
    f.__name__.lstrip("_"): f
    for f in (
        _shop,
        _percent,
        _rate,
        _work,
        _ages,
        _linear,
        _system,
        _quadratic,
        _series,
        _ratio,
        _combin,
        _mod,
        _tiles,
        _chain,
        _chain_money,
    )
}


def _canonical(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def sample_procedural(
    seed: int | str,
    size: int,
    exclude: frozenset[str] = frozenset(),
    families: Sequence[str] | None = None,
) -> list[tuple[str, str, str, str, int]]:
    """``size`` distinct procedural problems as ``(question, answer, program, family, difficulty)``, drawn
    with ``random.Random(seed)`` from ``families`` (default: all, in ``PROCEDURAL_FAMILIES`` order), none of
    whose questions is in ``exclude``."""
    rng = random.Random(seed)
    if families is None:
        chosen = list(PROCEDURAL_FAMILIES.items())
    else:
        unknown = sorted(set(families) - set(PROCEDURAL_FAMILIES))
        if unknown or not families:
            raise ValueError(f"unknown procedural families {unknown}; valid: {sorted(PROCEDURAL_FAMILIES)}")
        chosen = [(name, PROCEDURAL_FAMILIES[name]) for name in families]
    out: list[tuple[str, str, str, str, int]] = []
    seen = set(exclude)
    while len(out) < size:
        name, family = rng.choice(chosen)
        difficulty = rng.choice((1, 2, 3))
        question, answer, code = family(rng, difficulty)
        if question in seen:
            continue
        seen.add(question)
        out.append((question, _canonical(answer), code, name, difficulty))
    return out


@functools.lru_cache(maxsize=8)
def procedural_tasks(split: Split = "train", size: int | None = None) -> tuple[MathTask, ...]:
    """Procedural multi-step problems: ``train`` = 1,500, ``test`` = ``TEST_SIZE``, disjoint by question.
    ``size`` takes a prefix (ids do not change with it)."""
    _check_split(split)
    full = TRAIN_SIZE if split == "train" else TEST_SIZE
    size = full if size is None else size
    _check_size(size, full)
    if split == "train":
        raw = sample_procedural(PROCEDURAL_TRAIN_SEED, size)
    else:
        train = frozenset(q for q, *_ in sample_procedural(PROCEDURAL_TRAIN_SEED, TRAIN_SIZE))
        raw = sample_procedural(PROCEDURAL_TEST_SEED, size, exclude=train)
    return procedural_records(raw, f"procedural/{split}/", split, digits=5)


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
    full splits).
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
    gsm, proc = gsm_symbolic_tasks(split), procedural_tasks(split)
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
