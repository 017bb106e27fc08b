r"""More synthetic math prompts in the style of MATH-500, across MATH's seven subjects (``math_problems_v2``).

``math_problems`` draws from 11 templates, most of them algebra and calculus; MATH-500
spreads over seven subjects (Algebra, Counting & Probability, Geometry, Intermediate
Algebra, Number Theory, Prealgebra, Precalculus), and each subject has its own response
style: a base conversion, an answer in interval notation, a determinant or an exact
trigonometric value is worked and written differently from a derivative. A drafter learns
the target's style from the prompts it is trained on, so this source draws from those 11
templates (imported from ``math_problems``, not copied) and from 37 more that cover every
subject (``SUBJECTS`` names each template's).

It is a module and a source of its own rather than an edit of ``math_problems``: that
source's records and its cache stamp (the hash of its module's text) stay as they are,
so drafters and configs built on it stay reproducible.

As in ``math_problems``: each record comes from one template with integers drawn by a
seeded ``random.Random``, the templates in turn; the answer is computed exactly
(``Fraction``, integer square roots, a table of exact trigonometric values) and written
as MATH writes it (``\frac{3}{4}``, ``6\sqrt{2}``, ``\frac{5\pi}{6}``, ``(-\infty, 2]``).
The records are the same on every machine for the same ``(count, seed)``: nothing
depends on the clock, the locale, a file or string hashing (no iteration over a set of
strings). The new templates write their LaTeX by hand, in MATH's spacing (``x^2 - 5x``),
and need no sympy; the imported ones print with sympy, whose version is part of the cache
stamp (``data.prompts``).

The LaTeX helpers live in ``data.math_latex`` and the Prealgebra and Precalculus templates in
``data.math_prealgebra_precalculus``; the cache stamp hashes the text of every one of these modules.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from fractions import Fraction
from typing import Callable, Optional

from specforge_opd.data import math_problems
from specforge_opd.data.math_latex import (_based, _combo, _complex, _decimal, _frac, _fraction_note, _pi, _poly, _root,
                                           _signed_sum, _surd)
from specforge_opd.data.math_prealgebra_precalculus import (_arithmetic, _determinant, _fraction_arithmetic,
                                                            _matrix_product, _percent, _polar, _radicals, _ratio,
                                                            _statistics, _trig, _units, _vectors)
from specforge_opd.data.math_problems import _nonzero

#: Records of the ``math_problems_v2`` source and the seed of their draw.
DEFAULT_COUNT = 8000
DEFAULT_SEED = 0
SOURCE = "math_problems_v2"

Draw = Callable[[random.Random], tuple[str, str]]


# ---------------------------------------------------------------------------
# Algebra


def _absolute_value(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(1, 6), _nonzero(rng, -15, 15), rng.randint(1, 20)
    eq = f"$|{_poly([a, b])}| = {c}$"
    r1, r2 = Fraction(c - b, a), Fraction(-c - b, a)
    kind = rng.choice(["sum", "product", "difference"])
    if kind == "sum":
        q, prompt = r1 + r2, f"What is the sum of all values of $x$ that satisfy {eq}?"
    elif kind == "product":
        q, prompt = r1 * r2, f"Find the product of all values of $x$ such that {eq}."
    else:
        q, prompt = abs(r1 - r2), f"What is the positive difference between the two solutions of {eq}?"
    return prompt + _fraction_note(q), _frac(q)


def _vieta(rng: random.Random) -> tuple[str, str]:
    while True:
        a, b, c = rng.randint(1, 6), _nonzero(rng, -20, 20), _nonzero(rng, -20, 20)
        if b * b - 4 * a * c > 0:
            break
    s, p = Fraction(-b, a), Fraction(c, a)
    eq = f"${_poly([a, b, c])} = 0$"
    kind = rng.choice(["sum", "product", "squares", "reciprocals"])
    if kind == "sum":
        q, prompt = s, f"What is the sum of the roots of {eq}?"
    elif kind == "product":
        q, prompt = p, f"What is the product of the roots of {eq}?"
    elif kind == "squares":
        q, prompt = s * s - 2 * p, f"Let $r$ and $s$ be the solutions to {eq}. Compute $r^2 + s^2$."
    else:
        q, prompt = s / p, f"Let $r$ and $s$ be the roots of {eq}. What is $\\frac{{1}}{{r}} + \\frac{{1}}{{s}}$?"
    return prompt + _fraction_note(q), _frac(q)


def _line(rng: random.Random) -> tuple[str, str]:
    x1, y1, y2 = rng.randint(-10, 10), rng.randint(-10, 10), rng.randint(-10, 10)
    x2 = x1 + _nonzero(rng, -8, 8)
    m = Fraction(y2 - y1, x2 - x1)
    b = y1 - m * x1
    pts = f"$({x1}, {y1})$ and $({x2}, {y2})$"
    kind = rng.choice(["slope", "intercept", "sum"])
    if kind == "slope":
        q, prompt = m, f"What is the slope of the line passing through {pts}?"
    elif kind == "intercept":
        q, prompt = b, f"A line passes through the points {pts}. What is the $y$-intercept of the line?"
    else:
        q, prompt = m + b, f"The equation of the line through {pts} can be written in the form $y = mx + b$. What is $m + b$?"
    return prompt + _fraction_note(q), _frac(q)


def _distance_midpoint(rng: random.Random) -> tuple[str, str]:
    x1, y1 = rng.randint(-12, 12), rng.randint(-12, 12)
    x2, y2 = x1 + _nonzero(rng, -10, 10), y1 + rng.randint(-10, 10)
    pts = f"$({x1}, {y1})$ and $({x2}, {y2})$"
    kind = rng.choice(["distance", "midpoint", "midpoint_sum"])
    if kind == "distance":
        d2 = (x2 - x1) ** 2 + (y2 - y1) ** 2
        note = "" if math.isqrt(d2) ** 2 == d2 else " Express your answer in simplest radical form."
        return f"What is the distance between the points {pts}?{note}", _surd(d2)
    mx, my = Fraction(x1 + x2, 2), Fraction(y1 + y2, 2)
    if kind == "midpoint":
        return (f"What is the midpoint of the segment with endpoints {pts}? Express your answer as an ordered pair.",
                f"({_frac(mx)}, {_frac(my)})")
    q = mx + my
    return f"What is the sum of the coordinates of the midpoint of the segment with endpoints {pts}?{_fraction_note(q)}", \
        _frac(q)


def _composition(rng: random.Random) -> tuple[str, str]:
    a, b = _nonzero(rng, -6, 6), rng.randint(-9, 9)
    c, d, e = _nonzero(rng, -3, 3), rng.randint(-6, 6), rng.randint(-9, 9)
    k = rng.randint(-4, 4)

    def f(t):
        return a * t + b

    def g(t):
        return c * t * t + d * t + e

    defs = f"Let $f(x) = {_poly([a, b])}$ and $g(x) = {_poly([c, d, e])}$."
    if rng.random() < 0.5:
        return f"{defs} What is $f(g({k}))$?", str(f(g(k)))
    return f"{defs} What is $g(f({k}))$?", str(g(f(k)))


def _inverse(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b, k = _nonzero(rng, -9, 9), rng.randint(-15, 15), rng.randint(-20, 20)
        q = Fraction(k - b, a)
        return f"If $f(x) = {_poly([a, b])}$, what is $f^{{-1}}({k})$?{_fraction_note(q)}", _frac(q)
    while True:
        a, b, c, d = (_nonzero(rng, -5, 5) for _ in range(4))
        k = rng.randint(-6, 6)
        if a * d - b * c != 0 and c * k != a:
            break
    # y = (ax + b) / (cx + d)  =>  x = (b - dy) / (cy - a)
    q = Fraction(b - d * k, c * k - a)
    return (f"Let $f(x) = \\frac{{{_poly([a, b])}}}{{{_poly([c, d])}}}$. Find $f^{{-1}}({k})$.{_fraction_note(q)}",
            _frac(q))


def _domain(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["sqrt", "rational", "excluded"])
    if kind == "sqrt":
        a, b = _nonzero(rng, -6, 6), rng.randint(-20, 20)
        edge = _frac(Fraction(-b, a))
        answer = f"[{edge}, \\infty)" if a > 0 else f"(-\\infty, {edge}]"
        return (f"What is the domain of the function $f(x) = \\sqrt{{{_poly([a, b])}}}$? "
                "Express your answer in interval notation.", answer)
    r1, r2 = sorted(rng.sample(range(-9, 10), 2))
    den = _poly([1, -(r1 + r2), r1 * r2])
    if kind == "rational":
        num = _poly([1, rng.randint(-9, 9)])
        return (f"What is the domain of the function $f(x) = \\frac{{{num}}}{{{den}}}$? "
                "Express your answer as a union of intervals.",
                f"(-\\infty, {r1}) \\cup ({r1}, {r2}) \\cup ({r2}, \\infty)")
    return (f"What is the sum of all values of $x$ that are not in the domain of the function "
            f"$f(x) = \\frac{{{rng.randint(1, 9)}}}{{{den}}}$?", str(r1 + r2))


def _geometric_series(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, q = _nonzero(rng, -12, 12), rng.randint(2, 7)
        r = Fraction(_nonzero(rng, -(q - 1), q - 1), q)
        total = a / (1 - r)
        return (f"Evaluate the infinite geometric series: ${_signed_sum([a * r**k for k in range(3)])} + \\cdots$"
                f"{_fraction_note(total)}", _frac(total))
    a, r, n = rng.randint(1, 9), rng.choice([2, 3, 4, 5, -2, -3]), rng.randint(4, 8)
    terms = ", ".join(str(a * r**k) for k in range(3))
    return f"What is the sum of the first {n} terms of the geometric sequence ${terms}, \\ldots$?", \
        str(sum(a * r**k for k in range(n)))


def _logarithm(rng: random.Random) -> tuple[str, str]:
    p = rng.choice([2, 3, 5, 7, 10])
    m = 1 if p == 10 else rng.randint(1, 3)
    base = p**m
    kind = rng.choice(["evaluate", "evaluate", "solve", "exponent"])
    if kind == "evaluate":
        n = rng.randint(-4, 7)
        q = Fraction(n, m)
        return f"Evaluate $\\log_{{{base}}} {_frac(Fraction(p) ** n)}$.{_fraction_note(q)}", _frac(q)
    if kind == "solve":
        k = rng.randint(-2, 3)
        q = Fraction(base) ** k
        return f"Solve for $x$: $\\log_{{{base}}} x = {k}$.{_fraction_note(q)}", _frac(q)
    # p^(ax + c) = p^k
    a, c, k = _nonzero(rng, -4, 5), rng.randint(-6, 6), rng.randint(1, 6)
    q = Fraction(k - c, a)
    return f"Solve for $x$: ${p}^{{{_poly([a, c])}}} = {p**k}$.{_fraction_note(q)}", _frac(q)


def _rational_equation(rng: random.Random) -> tuple[str, str]:
    while True:
        a, b, c = rng.randint(-9, 9), rng.randint(-9, 9), _nonzero(rng, -6, 6)
        if c != 1 and Fraction(c * b + a, c - 1) != b:
            break
    # x + a = c(x - b)  =>  x = (cb + a) / (c - 1)
    q = Fraction(c * b + a, c - 1)
    return (f"Solve for $x$: $\\frac{{{_poly([1, a])}}}{{{_poly([1, -b])}}} = {c}$.{_fraction_note(q)}", _frac(q))


# ---------------------------------------------------------------------------
# Intermediate Algebra


def _inequality(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["interval", "interval", "count", "linear"])
    r1, r2 = sorted(rng.sample(range(-9, 10), 2))
    poly = _poly([1, -(r1 + r2), r1 * r2])
    if kind == "interval":
        rel = rng.choice(["<", "\\le", ">", "\\ge"])
        answer = {"<": f"({r1}, {r2})", "\\le": f"[{r1}, {r2}]",
                  ">": f"(-\\infty, {r1}) \\cup ({r2}, \\infty)",
                  "\\ge": f"(-\\infty, {r1}] \\cup [{r2}, \\infty)"}[rel]
        return f"For what values of $x$ is ${poly} {rel} 0$? Express your answer in interval notation.", answer
    if kind == "count":
        return f"How many integers $x$ satisfy ${poly} < 0$?", str(r2 - r1 - 1)
    a, b, c = _nonzero(rng, -7, 7), rng.randint(-20, 20), rng.randint(-20, 20)
    bound = Fraction(c - b, a)
    if a > 0:
        return f"What is the greatest integer $x$ for which ${_poly([a, b])} < {c}$?", str(math.ceil(bound) - 1)
    return f"What is the least integer $x$ for which ${_poly([a, b])} < {c}$?", str(math.floor(bound) + 1)


def _complex_numbers(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = rng.randint(-9, 9), _nonzero(rng, -9, 9), rng.randint(-9, 9), _nonzero(rng, -9, 9)
    z1, z2 = _complex(a, b), _complex(c, d)
    kind = rng.choice(["product", "quotient", "powers", "modulus"])
    if kind == "product":
        return f"Simplify $({z1})({z2})$.", _complex(a * c - b * d, a * d + b * c)
    if kind == "quotient":
        den = c * c + d * d
        return (f"Simplify $\\dfrac{{{z1}}}{{{z2}}}$. Your answer should be of the form $a+bi$, where $a$ and $b$ "
                "are both real numbers and written as improper fractions (if necessary).",
                _complex(Fraction(a * c + b * d, den), Fraction(b * c - a * d, den)))
    if kind == "powers":
        n, m = rng.randint(2, 250), rng.randint(2, 250)
        units = [(1, 0), (0, 1), (-1, 0), (0, -1)]
        re, im = (units[n % 4][0] + units[m % 4][0]), (units[n % 4][1] + units[m % 4][1])
        return f"Evaluate $i^{{{n}}} + i^{{{m}}}$.", _complex(re, im)
    return f"Evaluate $|{z1}|$.", _surd(a * a + b * b)


def _poly_remainder(rng: random.Random) -> tuple[str, str]:
    deg = rng.randint(3, 5)
    coeffs = [_nonzero(rng, -5, 5)] + [rng.randint(-9, 9) for _ in range(deg)]
    r = _nonzero(rng, -3, 3)
    value = sum(c * r ** (deg - i) for i, c in enumerate(coeffs))
    return f"What is the remainder when ${_poly(coeffs)}$ is divided by ${_poly([1, -r])}$?", str(value)


def _floor_ceiling(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["sqrt", "fraction", "decimals"])
    if kind == "sqrt":
        n = rng.randint(2, 999)
        while math.isqrt(n) ** 2 == n:
            n += 1
        if rng.random() < 0.5:
            return f"Evaluate $\\lfloor\\sqrt{{{n}}}\\rfloor$.", str(math.isqrt(n))
        return f"Evaluate $\\lceil\\sqrt{{{n}}}\\rceil$.", str(math.isqrt(n) + 1)
    if kind == "fraction":
        d = rng.randint(2, 9)
        q = Fraction(d * _nonzero(rng, -12, 12) + rng.randint(1, d - 1), d)
        if rng.random() < 0.5:
            return f"Evaluate $\\left\\lfloor {_frac(q)} \\right\\rfloor$.", str(math.floor(q))
        return f"Evaluate $\\left\\lceil {_frac(q)} \\right\\rceil$.", str(math.ceil(q))
    x, y = Fraction(rng.randint(-999, 999), 100), Fraction(rng.randint(-999, 999), 100)
    return f"Evaluate $\\lfloor {_decimal(x)} \\rfloor + \\lceil {_decimal(y)} \\rceil$.", str(math.floor(x) + math.ceil(y))


# ---------------------------------------------------------------------------
# Number Theory


def _base_conversion(rng: random.Random) -> tuple[str, str]:
    b = rng.randint(2, 9)
    kind = rng.choice(["to_base", "from_base", "sum"])
    if kind == "to_base":
        n = rng.randint(b * b, 3000)
        return f"Convert ${n}_{{10}}$ to base ${b}$.", _based(n, b)
    if kind == "from_base":
        n = rng.randint(b * b, b**5 - 1)
        return f"What is ${_based(n, b)}$ in base 10?", str(n)
    x, y = rng.randint(b, b**4), rng.randint(b, b**4)
    return f"Find ${_based(x, b)} + {_based(y, b)}$. Express your answer in base ${b}$.", _based(x + y, b)


def _divisors(rng: random.Random) -> tuple[str, str]:
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31]
    while True:
        chosen = sorted(rng.sample(primes, rng.randint(1, 3)))
        factors = {p: rng.randint(1, 4) for p in chosen}
        n = math.prod(p**e for p, e in factors.items())
        if 12 <= n <= 5000:
            break
    kind = rng.choice(["count", "sum", "largest_prime", "prime_sum"])
    if kind == "count":
        return f"How many positive divisors does ${n}$ have?", str(math.prod(e + 1 for e in factors.values()))
    if kind == "sum":
        return (f"What is the sum of the positive divisors of ${n}$?",
                str(math.prod((p ** (e + 1) - 1) // (p - 1) for p, e in factors.items())))
    if kind == "largest_prime":
        return f"What is the largest prime factor of ${n}$?", str(max(factors))
    return f"What is the sum of the distinct prime factors of ${n}$?", str(sum(factors))


def _congruence(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["solve", "inverse", "units", "sum"])
    if kind in ("solve", "inverse"):
        m = rng.randint(5, 40)
        a = rng.choice([k for k in range(2, m) if math.gcd(k, m) == 1])
        inv = pow(a, -1, m)
        if kind == "inverse":
            return (f"Find ${a}^{{-1}} \\pmod{{{m}}}$, as a residue modulo ${m}$. "
                    f"(Give an answer between $0$ and ${m - 1}$, inclusive.)", str(inv))
        b = rng.randint(1, m - 1)
        return (f"What is the smallest positive integer $x$ that satisfies ${a}x \\equiv {b} \\pmod{{{m}}}$?",
                str(b * inv % m))
    if kind == "units":
        base, e = rng.randint(2, 99), rng.randint(10, 999)
        return f"What is the units digit of ${base}^{{{e}}}$?", str(pow(base, e, 10))
    n, m = rng.randint(10, 200), rng.randint(3, 15)
    return f"What is the remainder when $1 + 2 + 3 + \\cdots + {n}$ is divided by ${m}$?", str(n * (n + 1) // 2 % m)


def _repeating_decimal(rng: random.Random) -> tuple[str, str]:
    k = rng.randint(1, 3)
    while True:
        block = str(rng.randint(1, 10**k - 2)).rjust(k, "0")
        if k == 1 or len(set(block)) > 1:  # 0.\overline{33} is 0.\overline{3}
            break
    pre = "".join(str(rng.randint(0, 9)) for _ in range(rng.choice([0, 0, 1])))
    whole = rng.choice([0, 0, 0, 1, 2, 3])
    value = whole + Fraction(int(pre or 0), 10 ** len(pre)) + Fraction(int(block), (10**k - 1) * 10 ** len(pre))
    return f"Express ${whole}.{pre}\\overline{{{block}}}$ as a common fraction in lowest terms.", _frac(value)


# ---------------------------------------------------------------------------
# Counting & Probability

_WORDS = ("BANANA", "LETTER", "ALABAMA", "COMMITTEE", "BOOKKEEPER", "MISSISSIPPI", "GAMMA", "TARTAR", "PEPPER",
          "LEVEL", "BALLOON", "COOKIE", "ELEVEN", "RADAR", "PUPPY", "TATTOO", "ERROR", "GOOGOL", "ADDED", "SASSY")
_NAMES = ("Alice", "Ben", "Carla", "Diego", "Emma", "Farid", "Grace", "Hiro")


def _counting(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["committee", "binomial", "officers", "round", "word", "apart"])
    if kind == "committee":
        n = rng.randint(6, 15)
        k = rng.randint(2, min(5, n - 1))
        return f"In how many ways can a {k}-person committee be chosen from a group of {n} people?", str(math.comb(n, k))
    if kind == "binomial":
        n = rng.randint(5, 20)
        k = rng.randint(1, n - 1)
        return f"Compute $\\dbinom{{{n}}}{{{k}}}$.", str(math.comb(n, k))
    if kind == "officers":
        n, r = rng.randint(5, 25), rng.choice([2, 3])
        roles = "a president and a vice-president" if r == 2 else "a president, a secretary and a treasurer"
        return (f"In how many ways can {roles} be chosen from a club of {n} members, if no member can hold more "
                "than one office?", str(math.perm(n, r)))
    if kind == "round":
        n = rng.randint(4, 10)
        # not MATH's own wording of this condition: its 13 words match a MATH-500 problem
        return (f"In how many ways can {n} people sit around a round table, if seatings that are rotations of each "
                "other count as the same?", str(math.factorial(n - 1)))
    if kind == "word":
        word = rng.choice(_WORDS)
        ways = math.factorial(len(word)) // math.prod(math.factorial(c) for c in Counter(word).values())
        return f"Determine the number of ways to arrange the letters of the word {word}.", str(ways)
    n = rng.randint(4, 9)
    a, b = rng.sample(_NAMES, 2)
    return (f"In how many ways can {n} people stand in a row if two of them, {a} and {b}, refuse to stand next to "
            "each other?", str(math.factorial(n) - 2 * math.factorial(n - 1)))


def _marbles(rng: random.Random) -> tuple[str, str]:
    colors = rng.sample(["red", "blue", "green", "white", "yellow"], rng.choice([2, 2, 3]))
    counts = [rng.randint(2, 9) for _ in colors]
    total = sum(counts)
    desc = ", ".join(f"{n} {c}" for n, c in zip(counts[:-1], colors[:-1])) + f" and {counts[-1]} {colors[-1]} marbles"
    pairs = math.comb(total, 2)
    kind = rng.choice(["both", "same", "one_each", "replace"])
    if kind == "both":
        q, ask = Fraction(math.comb(counts[0], 2), pairs), f"without replacement. What is the probability that both are {colors[0]}?"
    elif kind == "same":
        q, ask = (Fraction(sum(math.comb(n, 2) for n in counts), pairs),
                  "without replacement. What is the probability that the two marbles are the same color?")
    elif kind == "one_each":
        q, ask = (Fraction(counts[0] * counts[1], pairs),
                  f"without replacement. What is the probability that one is {colors[0]} and the other is {colors[1]}?")
    else:
        q, ask = (Fraction(counts[0], total) ** 2,
                  f"with replacement (the first is put back before the second is drawn). What is the probability "
                  f"that both are {colors[0]}?")
    return f"A bag contains {desc}. Two marbles are drawn at random {ask}{_fraction_note(q)}", _frac(q)


def _coins(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["exactly", "at_least", "expected"])
    if kind == "expected":
        s = rng.choice([4, 6, 8, 10, 12, 20])
        return (f"What is the expected value of the roll of a fair {s}-sided die? (A fair {s}-sided die has {s} faces "
                f"numbered from 1 to {s}.) Express your answer as a decimal.", _decimal(Fraction(s + 1, 2)))
    n = rng.randint(3, 10)
    k = rng.randint(1, n)
    if kind == "exactly":
        q = Fraction(math.comb(n, k), 2**n)
        return (f"A fair coin is flipped {n} times. What is the probability that exactly {k} of the flips come up "
                f"heads?{_fraction_note(q)}", _frac(q))
    q = Fraction(sum(math.comb(n, j) for j in range(k, n + 1)), 2**n)
    return (f"A fair coin is flipped {n} times. What is the probability of getting at least {k} heads?"
            f"{_fraction_note(q)}", _frac(q))


# ---------------------------------------------------------------------------
# Geometry

#: Regular polygons whose interior angle is a whole number of degrees (n divides 360).
_WHOLE_ANGLE_SIDES = (3, 4, 5, 6, 8, 9, 10, 12, 15, 18, 20, 24, 30, 36, 40, 45, 60, 72, 90, 120, 180, 360)


def _polygon(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["interior", "sides", "exterior", "sum", "diagonals"])
    n = rng.choice(_WHOLE_ANGLE_SIDES)
    if kind == "interior":
        return (f"What is the measure, in degrees, of each interior angle of a regular polygon with {n} sides?",
                str(180 - 360 // n))
    if kind == "sides":
        return (f"Each interior angle of a regular polygon measures ${180 - 360 // n}^\\circ$. How many sides does the "
                "polygon have?", str(n))
    if kind == "exterior":
        return (f"Each exterior angle of a regular polygon measures ${360 // n}^\\circ$. How many sides does the "
                "polygon have?", str(n))
    n = rng.randint(4, 40)
    if kind == "sum":
        return f"What is the sum, in degrees, of the interior angles of a convex polygon with {n} sides?", str(180 * (n - 2))
    return f"How many diagonals does a convex polygon with {n} sides have?", str(n * (n - 3) // 2)


def _circle(rng: random.Random) -> tuple[str, str]:
    h, k, r2 = rng.randint(-9, 9), rng.randint(-9, 9), rng.randint(1, 60)
    lhs = _combo([(1, "x^2"), (-2 * h, "x"), (1, "y^2"), (-2 * k, "y")])
    eq = f"${lhs} = {r2 - h * h - k * k}$"
    kind = rng.choice(["center", "radius", "area", "sum"])
    if kind == "center":
        return f"Find the center of the circle with equation {eq}.", f"({h}, {k})"
    if kind == "radius":
        note = "" if math.isqrt(r2) ** 2 == r2 else " Express your answer in simplest radical form."
        return f"What is the radius of the circle with equation {eq}?{note}", _surd(r2)
    if kind == "area":
        return (f"What is the area of the region enclosed by the graph of the equation {eq}? "
                "Express your answer in terms of $\\pi$.", _pi(r2))
    return f"The center of the circle with equation {eq} is the point $(h, k)$. What is $h + k$?", str(h + k)


def _solids(rng: random.Random) -> tuple[str, str]:
    r, h = rng.randint(1, 12), rng.randint(1, 20)
    in_pi = " Express your answer in terms of $\\pi$."
    kind = rng.choice(["cylinder", "cone", "sphere", "sphere_area", "cube_diagonal", "box_diagonal"])
    if kind == "cylinder":
        return (f"A right circular cylinder has a radius of ${r}$ units and a height of ${h}$ units. What is its "
                f"volume, in cubic units?{in_pi}", _pi(r * r * h))
    if kind == "cone":
        return (f"A right circular cone has a base radius of ${r}$ units and a height of ${h}$ units. What is its "
                f"volume, in cubic units?{in_pi}", _pi(Fraction(r * r * h, 3)))
    if kind == "sphere":
        return f"What is the volume, in cubic units, of a sphere with radius ${r}$ units?{in_pi}", _pi(Fraction(4 * r**3, 3))
    if kind == "sphere_area":
        return f"What is the surface area, in square units, of a sphere with radius ${r}$ units?{in_pi}", _pi(4 * r * r)
    if kind == "cube_diagonal":
        return (f"What is the length of a space diagonal of a cube with edge length ${r}$ units? Express your answer "
                "in simplest radical form.", _surd(3, r))
    a, b, c = sorted(rng.randint(1, 12) for _ in range(3))
    d2 = a * a + b * b + c * c
    note = "" if math.isqrt(d2) ** 2 == d2 else " Express your answer in simplest radical form."
    return (f"A rectangular box measures ${a}$ by ${b}$ by ${c}$ units. What is the length of the segment joining "
            f"two opposite vertices of the box (an interior diagonal)?{note}", _surd(d2))


_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41))


def _triangle(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["ratio", "equilateral", "third_side", "angle"])
    if kind == "ratio":
        s = rng.randint(1, 4)
        a, b, c = (s * v for v in rng.choice(_TRIPLES))
        fn = rng.choice(["sin", "cos", "tan"])
        q = {"sin": Fraction(a, c), "cos": Fraction(b, c), "tan": Fraction(a, b)}[fn]
        return (f"In right triangle $ABC$ with $\\angle C = 90^\\circ$, we have $AB = {c}$ and $BC = {a}$. "
                f"What is $\\{fn} A$?{_fraction_note(q)}", _frac(q))
    if kind == "equilateral":
        s = rng.randint(1, 20)
        return (f"What is the area, in square units, of an equilateral triangle whose sides each measure ${s}$ units? "
                "Express your answer in simplest radical form.", _root(Fraction(s * s, 4), 3))
    if kind == "third_side":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return (f"Two sides of a triangle measure ${a}$ cm and ${b}$ cm. How many different whole-number lengths, in "
                "centimeters, are possible for the third side?", str(2 * min(a, b) - 1))
    a = rng.randint(20, 120)
    b = rng.randint(10, 170 - a)
    return (f"In triangle $ABC$, $\\angle A = {a}^\\circ$ and $\\angle B = {b}^\\circ$. What is the measure of "
            "$\\angle C$, in degrees?", str(180 - a - b))


# ---------------------------------------------------------------------------
# the draw

_OLD = math_problems.TEMPLATES

#: template name -> draw; each returns (prompt, answer). The first 11 are ``math_problems``'s.
TEMPLATES: dict[str, Draw] = {
    **_OLD,
    "absolute_value": _absolute_value, "vieta": _vieta, "line": _line, "distance_midpoint": _distance_midpoint,
    "composition": _composition, "inverse": _inverse, "domain": _domain, "geometric_series": _geometric_series,
    "logarithm": _logarithm, "rational_equation": _rational_equation,
    "inequality": _inequality, "complex_numbers": _complex_numbers, "poly_remainder": _poly_remainder,
    "floor_ceiling": _floor_ceiling,
    "base_conversion": _base_conversion, "divisors": _divisors, "congruence": _congruence,
    "repeating_decimal": _repeating_decimal,
    "counting": _counting, "marbles": _marbles, "coins": _coins,
    "polygon": _polygon, "circle": _circle, "solids": _solids, "triangle": _triangle,
    "percent": _percent, "ratio": _ratio, "units": _units, "statistics": _statistics,
    "fraction_arithmetic": _fraction_arithmetic, "radicals": _radicals, "arithmetic": _arithmetic,
    "determinant": _determinant, "vectors": _vectors, "matrix_product": _matrix_product, "polar": _polar,
    "trig": _trig,
}

#: template name -> MATH's subject (``Calculus`` for ``math_problems``'s two calculus templates, which MATH lacks).
SUBJECTS: dict[str, str] = {
    **dict.fromkeys(["quadratic", "system", "evaluate", "series", "absolute_value", "vieta", "line",
                     "distance_midpoint", "composition", "inverse", "domain", "geometric_series", "logarithm",
                     "rational_equation"], "Algebra"),
    **dict.fromkeys(["inequality", "complex_numbers", "poly_remainder", "floor_ceiling"], "Intermediate Algebra"),
    **dict.fromkeys(["remainder", "gcd_lcm", "base_conversion", "divisors", "congruence", "repeating_decimal"],
                    "Number Theory"),
    **dict.fromkeys(["dice", "counting", "marbles", "coins"], "Counting & Probability"),
    **dict.fromkeys(["geometry", "polygon", "circle", "solids", "triangle"], "Geometry"),
    **dict.fromkeys(["word", "percent", "ratio", "units", "statistics", "fraction_arithmetic", "radicals",
                     "arithmetic"], "Prealgebra"),
    **dict.fromkeys(["determinant", "vectors", "matrix_product", "polar", "trig"], "Precalculus"),
    **dict.fromkeys(["derivative", "integral"], "Calculus"),
}


def draw(count: Optional[int] = None, seed: int = DEFAULT_SEED) -> list[tuple[str, str, str, str]]:
    """``count`` (default ``DEFAULT_COUNT``) synthetic MATH-style problems, the templates in turn, integers from ``random.Random(seed)``.

    Returns:
        ``(id, template, prompt, answer)`` per problem: ``id`` is ``math_problems_v2:<template>:<index>``,
        ``answer`` the computed answer as a string (LaTeX where it is an expression). Equal
        prompts drawn twice are kept once (the first): templates with few distinct problems
        (a regular polygon's angles, a word's arrangements) repeat, so fewer than ``count``
        come back. ``data.prompts`` makes them records of source ``math_problems_v2``.

    Raises:
        ValueError: ``count`` < 1.
    """
    return math_problems.draw(DEFAULT_COUNT if count is None else count, seed, templates=TEMPLATES, source=SOURCE)
