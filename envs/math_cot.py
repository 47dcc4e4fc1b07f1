"""GSM-Symbolic's worked solutions as Python programs: the translation behind ``solution_kind == "cot"``.

A GSM8K-style worked solution states its computations as ``<arithmetic> = <result>``; :func:`cot_to_program`
turns each into one line of Python (``step_k = <arithmetic>``, with earlier results named by their step) and
ends with the line that reaches the final answer, so the program reads as the chain of reasoning and the
scripted solver can run it in the sandbox. :mod:`streamrl.envs.math_tasks` uses it for every
``gsm_symbolic`` task and falls back to an answer-key program where it returns ``None``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from fractions import Fraction

__all__ = ["cot_to_program"]

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
