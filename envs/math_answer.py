"""Final-answer extraction (the last ``\\boxed{...}``) and mathematical equivalence for Math-TIR rewards.

Checking order (docs/platform.md §6): exact match after normalization, then exact rational comparison of
plain numbers (``0.5`` = ``1/2`` = ``\\frac{1}{2}`` = ``50\\%``), then math-verify (Hugging Face; LaTeX, sets,
intervals), then sympy with a numeric tolerance.

The first two stages are cheap and bounded (string operations and rational arithmetic on at most a turn's
worth of digits) and run in the caller. The symbolic stages are not: a policy can write ``2^{2^{64}}`` or
``(10**7)!``, which sympy evaluates while holding the GIL for minutes, so no thread can bound them. They run
in a sandbox process (:class:`streamrl.envs.sandbox.SandboxPool`) that is killed at the deadline; an answer
that runs out of time counts as not equal. The program sent there is this module's own source plus one call
of :func:`_symbolic_equal`, which is why this module imports nothing of streamrl at load time (the sandboxed
process cannot import streamrl).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl.envs.sandbox import SandboxConfig, SandboxPool

__all__ = ["answers_equal", "extract_boxed", "grading_sandbox", "normalize_answer", "parse_number"]

# Answers longer than this (normalized) or with more exponent operators than _MAX_POWERS are judged not
# equal without a symbolic check: no reference answer looks like that, and power towers such as 9^9^9^9
# would only spend the whole deadline in the grading process.
_MAX_SYMBOLIC_CHARS = 300
_MAX_POWERS = 2


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched.

    Returns ``None`` when there is no box or its braces never close. ``\\boxed 5`` (no braces) gives
    ``"5"``. Nested braces (``\\boxed{\\frac{1}{2}}``) are kept intact.
    """
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        bare = re.findall(r"\\boxed\s+([^\s$}]+)", text)
        return bare[-1] if bare else None
    open_brace = text.index("{", start)
    depth = 0
    for i in range(open_brace, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i].strip()
    return None


_UNIT_WORDS = (
    r"(?:dollars?|cents?|euros?|pounds?|hours?|hrs?|minutes?|mins?|seconds?|days?|weeks?|months?|years?(?: old)?"
    r"|km/h|mph|km|kg|cm|mm|m\^?2|meters?|metres?|miles?|feet|foot|inches|grams?|liters?|litres?|units?"
    r"|people|students|ways|tiles|tickets|items|pieces|apples|books|cookies|points)"
)


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer: no ``$``, ``\\text{}`` units, spaces, thousands separators.

    Adapted from the verl ``math_dapo`` / Qwen2.5-Math normalizers; a shared first step before any
    numeric or symbolic comparison.
    """
    s = answer.strip()
    s = re.sub(r"\\text\{\s*" + _UNIT_WORDS + r"\s*\}", "", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}", r"\1", s)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\$", ""),
        ("{,}", ","),
        ("\\%", "%"),
    ):
        s = s.replace(old, new)
    s = s.replace("$", "").strip()
    s = re.sub(r"\s+" + _UNIT_WORDS + r"\s*$", "", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.rstrip(".").strip()
    s = re.sub(r"^[€£¥₹]", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?%?", s):
        s = s.replace(",", "")  # 1,000 -> 1000
    return s.replace(" ", "")


_NUMBER = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?")


def parse_number(answer: str) -> Fraction | None:
    """Exact value of a plain number in normalized form: ``12``, ``-3.50``, ``7/2``, ``\\frac{7}{2}``,
    ``-\\frac{7}{2}``, ``1e-3``, ``25%`` (= 1/4). ``None`` for anything else."""
    s = normalize_answer(answer)
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    frac = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        value = num / den * (-1 if frac.group(1) else 1)
    elif "/" in s:
        parts = s.split("/")
        if len(parts) != 2:
            return None
        num, den = parse_number(parts[0]), parse_number(parts[1])
        if num is None or den is None or den == 0:
            return None
        value = num / den
    else:
        m = _NUMBER.fullmatch(s)
        if not m:
            return None
        try:
            value = Fraction(m.group(2))
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            return None
        if m.group(3):
            exponent = int(m.group(3))
            if abs(exponent) > 400:
                return None
            value *= Fraction(10) ** exponent
        if m.group(1) == "-":
            value = -value
    return value / 100 if percent else value


def _close(a: complex, b: complex, rel_tol: float, abs_tol: float) -> bool:
    return abs(a - b) <= max(abs_tol, rel_tol * abs(b))


def _close_exact(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float) -> bool:
    """:func:`_close` in exact rational arithmetic: numbers beyond float range (``1e400``, a 400-digit
    literal) compare without overflow."""
    return abs(a - b) <= max(Fraction(abs_tol), Fraction(rel_tol) * abs(b))


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off. They are off on purpose: they use ``signal.alarm``
    (main thread only), and the checks run in a process that is killed at the deadline instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


def _symbolic_equal(pred: str, gold: str, rel_tol: float, abs_tol: float) -> bool:
    """math-verify, then sympy (plain or LaTeX expressions) with numeric tolerance; no timeouts inside."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", parsing_timeout=None)
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True

    import sympy as sp
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    def to_sympy(s: str) -> sp.Expr:
        if "\\" in s:
            from latex2sympy2_extended import latex2sympy

            return latex2sympy(s)
        transformations = (*standard_transformations, implicit_multiplication_application, convert_xor)
        return parse_expr(s, transformations=transformations, evaluate=True)

    p_expr, g_expr = to_sympy(normalize_answer(pred)), to_sympy(normalize_answer(gold))
    if p_expr.is_number and g_expr.is_number:
        return _close(complex(p_expr.evalf()), complex(g_expr.evalf()), rel_tol, abs_tol)
    return bool(sp.simplify(p_expr - g_expr) == 0)


def answers_equal(
    pred: str | None,
    gold: str,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    timeout_s: float = 5.0,
    pool: SandboxPool | None = None,
) -> bool:
    """Whether the answer ``pred`` is mathematically equal to the ground truth ``gold``.

    Numbers compare exactly as rationals first, then within ``rel_tol`` / ``abs_tol`` (so ``0.3333333``
    matches ``1/3`` only to 1e-6 relative); these checks run here. Anything else goes to math-verify and sympy
    in a sandbox process killed after ``timeout_s`` seconds (see the module doc): a check that runs out of
    time counts as *not equal*. Answers too long or with power towers are judged not equal without a check.

    ``pool``: the sandbox pool to check in, built from :func:`grading_sandbox` (an env keeps one for its
    lifetime). Without one, the process-wide shared pool of that config is held for this call only, which
    starts a sandbox process (a fresh interpreter) unless another holder keeps it running. Safe to call from any thread.
    """
    if pred is None:
        return False
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError(f"answers must be str, got {type(pred).__name__} and {type(gold).__name__}")
    p_norm, g_norm = normalize_answer(pred), normalize_answer(gold)
    if not p_norm:
        return False
    if p_norm == g_norm:
        return True
    p_num, g_num = parse_number(pred), parse_number(gold)
    if p_num is not None and g_num is not None:
        return p_num == g_num or _close_exact(p_num, g_num, rel_tol, abs_tol)
    too_big = max(len(p_norm), len(g_norm)) > _MAX_SYMBOLIC_CHARS
    towers = max(s.count("^") + s.count("**") for s in (p_norm, g_norm)) > _MAX_POWERS
    if too_big or towers:
        return False
    program = f"{_module_source()}\nprint(_symbolic_equal({pred!r}, {gold!r}, {rel_tol!r}, {abs_tol!r}))\n"
    from streamrl.envs.sandbox import acquire_shared_pool, release_shared_pool  # see the module doc

    held = pool if pool is not None else acquire_shared_pool(grading_sandbox(timeout_s))
    try:
        result = held.run(program, timeout=timeout_s)
    finally:
        if pool is None:
            release_shared_pool(held)
    # Unparsable answers raise in there (status "error"): simply not equal. Libraries may log above the verdict.
    lines = result.output.strip().splitlines()
    return result.ok and bool(lines) and lines[-1] == "True"


def grading_sandbox(timeout_s: float = 5.0) -> SandboxConfig:
    """The sandbox config of symbolic answer checks bounded by ``timeout_s`` seconds: one process with sympy
    and math-verify loaded, a CPU-time limit of the same length as a backstop to the wall-clock kill."""
    from streamrl.envs.sandbox import SandboxConfig

    return SandboxConfig(
        timeout_s=timeout_s,
        cpu_time_s=max(1, math.ceil(timeout_s)),
        pool_size=1,
        preload=("math", "fractions", "sympy", "math_verify", "latex2sympy2_extended"),
    )


@functools.cache
def _module_source() -> str:
    return Path(__file__).read_text(encoding="utf-8")
