"""The procedural Math-TIR problems: seeded generators of multi-step word problems with exact answers.

Each family draws one problem of a given difficulty (1-3) from a ``random.Random`` and returns its question,
its exact answer (a ``Fraction``) and the Python program that computes it; :func:`sample_procedural` draws
distinct problems across families. Standard library only, so the same seed gives the same problems on
every machine. :mod:`streamrl.envs.math_tasks` makes the ``procedural`` task sets (ids, splits) from them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from fractions import Fraction

__all__ = ["PROCEDURAL_FAMILIES", "Problem", "sample_procedural"]

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
