r"""The Prealgebra and Precalculus templates of ``math_problems_v2`` (its other subjects live there).

Each template takes the draw's seeded ``random.Random`` and returns ``(prompt, answer)``;
``math_problems_v2.TEMPLATES`` names them and sets their order. Its text is part of that
source's cache stamp (``data.prompts``): an edit here re-draws the source once.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

from specforge_opd.data.math_latex import (ANGLES, _column, _cos, _decimal, _frac, _fraction_note, _matrix, _money,
                                           _pi, _root, _sin, _sqrt_parts, _surd, _tan)
from specforge_opd.data.math_problems import _nonzero


# ---------------------------------------------------------------------------
# Prealgebra


def _percent(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["of", "sale", "successive", "what_percent", "increase"])
    if kind == "of":
        p, n = rng.randint(1, 99), rng.randint(10, 400)
        q = Fraction(p * n, 100)
        note = "" if q.denominator == 1 else " Express your answer as a decimal."
        return f"What is ${p}\\%$ of ${n}$?{note}", _decimal(q)
    if kind == "sale":
        price, p = rng.randint(10, 200), rng.choice([10, 15, 20, 25, 30, 40, 50])
        return (f"A jacket regularly priced at \\${price} is on sale for ${p}\\%$ off. What is the sale price, in dollars?",
                _decimal(Fraction(price * (100 - p), 100)))
    if kind == "successive":
        p, q = rng.choice([10, 20, 25, 30, 40, 50]), rng.choice([10, 20, 25, 30, 40, 50])
        return (f"A store reduces the price of a coat by ${p}\\%$ and later reduces the new price by ${q}\\%$. The "
                "final price is what percent of the original price?", _decimal(Fraction((100 - p) * (100 - q), 100)))
    if kind == "what_percent":
        b = rng.choice([4, 5, 8, 10, 16, 20, 25, 40, 50, 80, 125, 200])
        a = rng.randint(1, b)
        return f"What percent of ${b}$ is ${a}$?", _decimal(Fraction(100 * a, b))
    while True:
        start, p = rng.choice([20, 25, 40, 50, 80, 100, 200, 250, 400, 500]), rng.randint(1, 150)
        if start * p % 100 == 0:
            break
    return (f"The population of a town grew from ${start}$ to ${start * (100 + p) // 100}$. By what percent did the "
            "population increase?", str(p))


_RATIO_ITEMS = (("boys", "girls", "students in the class"), ("red marbles", "blue marbles", "marbles in the jar"),
                ("cats", "dogs", "animals at the shelter"), ("fiction books", "nonfiction books", "books on the shelf"))
_GOODS = ("notebooks", "pencils", "apples", "tickets", "muffins", "stamps")


def _ratio(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["parts", "unit_price", "rate", "proportion"])
    if kind == "parts":
        first, second, whole = rng.choice(_RATIO_ITEMS)
        a, b, k = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 12)
        while a == b or math.gcd(a, b) != 1:  # a ratio in lowest terms, as a problem states it
            b = rng.randint(1, 9)
        return (f"The ratio of {first} to {second} is ${a}:{b}$. If there are ${(a + b) * k}$ {whole} in all, how many "
                f"{second} are there?", str(b * k))
    if kind == "unit_price":
        item, unit = rng.choice(_GOODS), rng.randint(15, 300)
        q1, q2 = rng.randint(2, 9), rng.randint(2, 15)
        return (f"If {q1} {item} cost \\${_money(q1 * unit)}, how many dollars do {q2} {item} cost at the same price?",
                _money(q2 * unit))
    if kind == "rate":
        speed, t1, t2 = rng.randint(20, 70), rng.randint(2, 6), rng.randint(2, 12)
        return (f"A car travels ${speed * t1}$ miles in ${t1}$ hours. At this rate, how many miles will it travel in "
                f"${t2}$ hours?", str(speed * t2))
    a, b, m = rng.randint(1, 12), rng.randint(2, 12), rng.randint(2, 40)
    q = Fraction(m * a, b)
    return f"Solve for $x$: $\\frac{{x}}{{{m}}} = \\frac{{{a}}}{{{b}}}$.{_fraction_note(q)}", _frac(q)


#: (larger unit, smaller unit, how many smaller in one larger, whether it measures length).
_UNITS = (("feet", "inches", 12, True), ("yards", "feet", 3, True), ("yards", "inches", 36, True),
          ("miles", "feet", 5280, True), ("meters", "centimeters", 100, True), ("kilometers", "meters", 1000, True),
          ("hours", "minutes", 60, False), ("minutes", "seconds", 60, False), ("hours", "seconds", 3600, False),
          ("days", "hours", 24, False), ("weeks", "days", 7, False), ("kilograms", "grams", 1000, False),
          ("liters", "milliliters", 1000, False), ("pounds", "ounces", 16, False), ("gallons", "quarts", 4, False))


def _units(rng: random.Random) -> tuple[str, str]:
    big, small, factor, length = rng.choice(_UNITS)
    kind = rng.choice(["down", "up", "area"] if length and factor <= 100 else ["down", "up"])
    if kind == "area":
        k = rng.randint(2, 12)
        dim = rng.choice(["square", "cubic"]) if factor <= 12 else "square"
        power = 2 if dim == "square" else 3
        return f"How many {dim} {small} are in ${k}$ {dim} {big}?", str(k * factor**power)
    while True:
        n = Fraction(rng.randint(1, 40), rng.choice([1, 1, 2, 4]))
        if (n * factor).denominator == 1:
            break
    if kind == "down":
        return f"How many {small} are in ${_decimal(n)}$ {big}?", _decimal(n * factor)
    return f"How many {big} are in ${n * factor}$ {small}?", _decimal(n)


def _statistics(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(5, 9)
    kind = rng.choice(["mean", "median", "missing"])
    if kind == "missing":
        m = rng.randint(10, 90)
        given = [m + rng.randint(-20, 20) for _ in range(n - 1)]
        return (f"The mean of {n} numbers is ${m}$. If {n - 1} of the numbers are ${', '.join(map(str, given))}$, "
                "what is the remaining number?", str(m * n - sum(given)))
    vals = [rng.randint(1, 99) for _ in range(n)]
    listing = f"${', '.join(map(str, vals))}$"
    if kind == "median":
        s = sorted(vals)
        med = Fraction(s[n // 2]) if n % 2 else Fraction(s[n // 2 - 1] + s[n // 2], 2)
        return f"What is the median of the numbers {listing}?", _decimal(med)
    mean = Fraction(sum(vals), n)
    if mean.denominator == 1:
        return f"What is the arithmetic mean of the numbers {listing}?", str(mean)
    # half up, exactly (round() on a Fraction rounds half to even)
    tenth = Fraction(math.floor(mean * 10 + Fraction(1, 2)), 10)
    return (f"What is the arithmetic mean of the numbers {listing}? Express your answer as a decimal to the nearest "
            "tenth.", _decimal(tenth))


def _fraction_arithmetic(rng: random.Random) -> tuple[str, str]:
    def draw_fraction() -> Fraction:
        while True:
            q = Fraction(rng.randint(1, 15), rng.randint(2, 16))
            if q.denominator != 1:
                return q

    x, y, z = draw_fraction(), draw_fraction(), draw_fraction()
    kind = rng.choice(["+", "-", "\\cdot", "\\div", "mixed"])
    if kind == "mixed":
        q, expr = x + y * z, f"{_frac(x)} + {_frac(y)} \\cdot {_frac(z)}"
    else:
        q = {"+": x + y, "-": x - y, "\\cdot": x * y, "\\div": x / y}[kind]
        expr = f"{_frac(x)} {kind} {_frac(y)}"
    return f"Find ${expr}$.{_fraction_note(q)}", _frac(q)


def _radicals(rng: random.Random) -> tuple[str, str]:
    free = [2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23]
    kind = rng.choice(["simplify", "product", "rationalize", "sum"])
    if kind == "simplify":
        n = rng.randint(2, 12) ** 2 * rng.choice(free)
        return f"Simplify $\\sqrt{{{n}}}$.", _surd(n)
    if kind == "product":
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return f"Simplify $\\sqrt{{{a}}} \\cdot \\sqrt{{{b}}}$.", _surd(a * b)
    if kind == "rationalize":
        a, b = rng.randint(1, 20), rng.choice([n for n in range(2, 51) if math.isqrt(n) ** 2 != n])
        k, m = _sqrt_parts(b)
        # a / (k sqrt(m)) = a sqrt(m) / (k m)
        return (f"Rationalize the denominator: $\\frac{{{a}}}{{\\sqrt{{{b}}}}}$. Express your answer in simplest form.",
                _root(Fraction(a, k * m), m))
    m, k1, k2 = rng.choice(free[:8]), rng.randint(2, 7), rng.randint(2, 7)
    return f"Simplify $\\sqrt{{{k1 * k1 * m}}} + \\sqrt{{{k2 * k2 * m}}}$.", _root(k1 + k2, m)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["order", "squares", "near_hundred", "powers"])
    if kind == "order":
        a, b, c, d, t = rng.randint(1, 20), rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 12)
        return f"Compute: ${a} + {b} \\cdot {c} - {d * t} \\div {d}$.", str(a + b * c - t)
    if kind == "squares":
        a = rng.randint(20, 999)
        b = a - rng.randint(1, 10)
        return f"Compute ${a}^2 - {b}^2$ in your head.", str(a * a - b * b)
    if kind == "near_hundred":
        base = rng.choice([100, 1000])
        d = rng.randint(1, 9)
        return f"Compute ${base - d} \\times {base + d}$.", str(base * base - d * d)
    a, b, e = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 4)
    return f"What is the value of $({a} - {b})^{e} + {a}^{e} - {b}^{e}$?", str((a - b) ** e + a**e - b**e)


# ---------------------------------------------------------------------------
# Precalculus


def _det(m: list[list[int]]) -> int:
    if len(m) == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return sum((-1) ** j * m[0][j] * _det([row[:j] + row[j + 1:] for row in m[1:]]) for j in range(3))


def _determinant(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["2x2", "3x3", "scaled"])
    if kind == "scaled":
        d, k = _nonzero(rng, -9, 9), rng.randint(2, 5)
        given = _matrix([["a", "b"], ["c", "d"]], "vmatrix")
        if rng.random() < 0.5:
            asked, value = _matrix([[f"{k}a", f"{k}b"], [f"{k}c", f"{k}d"]], "vmatrix"), k * k * d
        else:
            asked, value = _matrix([["a", "b"], [f"{k}c", f"{k}d"]], "vmatrix"), k * d
        return f"If ${given} = {d}$, then find ${asked}$.", str(value)
    n = 2 if kind == "2x2" else 3
    m = [[rng.randint(-7, 9) for _ in range(n)] for _ in range(n)]
    return f"Compute ${_matrix(m, 'vmatrix')}$.", str(_det(m))


def _vectors(rng: random.Random) -> tuple[str, str]:
    dim = rng.choice([2, 3])
    u, v = [rng.randint(-9, 9) for _ in range(dim)], [rng.randint(-9, 9) for _ in range(dim)]
    kind = rng.choice(["dot", "norm", "combination", "orthogonal" if dim == 2 else "cross"])
    if kind == "dot":
        return f"Compute ${_column(u)} \\cdot {_column(v)}$.", str(sum(a * b for a, b in zip(u, v)))
    if kind == "norm":
        return f"Find $\\left\\| {_column(u)} \\right\\|$.", _surd(sum(a * a for a in u))
    if kind == "cross":
        cross = [u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0]]
        return f"Find the cross product of ${_column(u)}$ and ${_column(v)}$.", _column(cross)
    if kind == "orthogonal":
        a1, a2, b2 = _nonzero(rng, -9, 9), rng.randint(-9, 9), _nonzero(rng, -9, 9)
        q = Fraction(-a2 * b2, a1)
        return (f"Find $k$ such that the vectors ${_column([a1, a2])}$ and ${_column(['k', b2])}$ are orthogonal."
                f"{_fraction_note(q)}", _frac(q))
    c1, c2 = _nonzero(rng, -4, 4), _nonzero(rng, -4, 4)
    lead = {1: "", -1: "-"}.get(c1, str(c1))
    expr = f"{lead}{_column(u)} {'-' if c2 < 0 else '+'} {'' if abs(c2) == 1 else abs(c2)}{_column(v)}"
    return f"Compute ${expr}$.", _column([c1 * a + c2 * b for a, b in zip(u, v)])


def _matrix_product(rng: random.Random) -> tuple[str, str]:
    a = [[rng.randint(-5, 6) for _ in range(2)] for _ in range(2)]
    kind = rng.choice(["matrix", "vector", "square"])
    if kind == "vector":
        v = [rng.randint(-6, 6) for _ in range(2)]
        return f"Compute ${_matrix(a)} {_column(v)}$.", _column([a[i][0] * v[0] + a[i][1] * v[1] for i in range(2)])
    b = a if kind == "square" else [[rng.randint(-5, 6) for _ in range(2)] for _ in range(2)]
    prod = [[sum(a[i][k] * b[k][j] for k in range(2)) for j in range(2)] for i in range(2)]
    if kind == "square":
        return f"Let $\\mathbf{{A}} = {_matrix(a)}$. Compute $\\mathbf{{A}}^2$.", _matrix(prod)
    return f"Compute ${_matrix(a)} {_matrix(b)}$.", _matrix(prod)


def _polar(rng: random.Random) -> tuple[str, str]:
    r, d = rng.randint(1, 10), rng.choice(ANGLES)
    (c, cm), (s, sm) = _cos(d), _sin(d)
    point = f"({_root(r * c, cm)}, {_root(r * s, sm)})"
    theta = _pi(Fraction(d, 180))
    if rng.random() < 0.5:
        return (f"Convert the point $\\left( {r}, {theta} \\right)$ in polar coordinates to rectangular coordinates.",
                point)
    return (f"Convert the point ${point}$ in rectangular coordinates to polar coordinates. Enter your answer in the "
            "form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$", f"\\left( {r}, {theta} \\right)")


#: arcsin's and arctan's angles (degrees, in their principal ranges), arccos's.
_ARC_ANGLES = {"arcsin": (-90, -60, -45, -30, 0, 30, 45, 60, 90), "arccos": (0, 30, 45, 60, 90, 120, 135, 150, 180),
               "arctan": (-60, -45, -30, 0, 30, 45, 60)}


def _trig(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["degrees", "degrees", "radians", "inverse"])
    if kind == "inverse":
        fn = rng.choice(["arcsin", "arccos", "arctan"])
        d = rng.choice(_ARC_ANGLES[fn])
        coef, m = {"arcsin": _sin, "arccos": _cos, "arctan": _tan}[fn](d)
        arg = _root(coef, m)
        shown = arg if arg.isdigit() else f"\\left( {arg} \\right)"
        return f"Compute $\\{fn} {shown}.$ Express your answer in radians.", _pi(Fraction(d, 180))
    fn = rng.choice(["sin", "cos", "tan"])
    d = rng.choice(ANGLES)
    if fn == "tan" and _cos(d)[0] == 0:
        fn = "sin"
    coef, m = {"sin": _sin, "cos": _cos, "tan": _tan}[fn](d)
    if kind == "radians":
        return f"Compute $\\{fn} {_pi(Fraction(d, 180))}$.", _root(coef, m)
    shown = d + 360 * rng.choice([0, 0, 0, 1, 2, 5, -1])
    angle = f"{shown}^\\circ" if shown >= 0 else f"({shown}^\\circ)"
    return f"Compute $\\{fn} {angle}$.", _root(coef, m)
