"""Synthetic math prompts in the style of MATH-500: a training source for drafters (``math_problems``).

No math training set ships in a package this project can install offline (the ``mmath``
package holds evaluation sets only), and a drafter trained on chat and code prompts loses
on math (README, drafter scaling: the code mix gained humaneval and lost math500). What the
drafter learns is the target's response style, so the prompts need the evaluation set's
form (a short problem with LaTeX between ``$`` signs, "Express your answer as ..."), not
its difficulty.

Each record comes from one of ``TEMPLATES`` with integers drawn by a seeded
``random.Random``; expressions are written by sympy's LaTeX printer (sympy is already a
dependency, through torch). The answer, where one is computed, is the record's ``answer``.
The records are the same on every machine for the same ``(count, seed)``: nothing depends
on the clock, the locale or a file.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Callable, Optional

#: Records of the ``math_problems`` source and the seed of their draw.
DEFAULT_COUNT = 4000
DEFAULT_SEED = 0
SOURCE = "math_problems"


def _nonzero(rng: random.Random, lo: int, hi: int) -> int:
    v = 0
    while v == 0:
        v = rng.randint(lo, hi)
    return v


def _quadratic(rng: random.Random) -> tuple[str, str]:
    import sympy as sp

    x = sp.Symbol("x")
    a, r1, r2 = rng.choice([1, 1, 2, 3]), rng.randint(-9, 9), rng.randint(-9, 9)
    poly = sp.expand(a * (x - r1) * (x - r2))
    roots = sorted({r1, r2})
    return f"Find all real solutions to ${sp.latex(poly)} = 0$. Enter all the solutions, separated by commas.", \
        ", ".join(map(str, roots))


def _system(rng: random.Random) -> tuple[str, str]:
    x0, y0 = rng.randint(-9, 9), rng.randint(-9, 9)
    while True:
        a, b, c, d = (_nonzero(rng, -6, 6) for _ in range(4))
        if a * d - b * c != 0:
            break

    def eq(p: int, q: int) -> str:
        sign = "+" if q > 0 else "-"
        return f"{p}x {sign} {abs(q)}y = {p * x0 + q * y0}".replace("1x", "x").replace(" 1y", " y")

    return f"Solve the system of equations ${eq(a, b)}$ and ${eq(c, d)}$. Express your answer as an ordered pair $(x, y)$.", \
        f"({x0}, {y0})"


def _remainder(rng: random.Random) -> tuple[str, str]:
    m = rng.randint(3, 19)
    if rng.random() < 0.5:
        base, k = rng.randint(2, 9), rng.randint(10, 99)
        return f"What is the remainder when ${base}^{{{k}}}$ is divided by ${m}$?", str(pow(base, k, m))
    n = rng.randint(10**3, 10**6)
    return f"What is the remainder when ${n}$ is divided by ${m}$?", str(n % m)


def _gcd_lcm(rng: random.Random) -> tuple[str, str]:
    g = rng.randint(2, 30)
    a, b = g * rng.randint(2, 40), g * rng.randint(2, 40)
    if rng.random() < 0.5:
        return f"What is the greatest common divisor of ${a}$ and ${b}$?", str(math.gcd(a, b))
    return f"What is the least common multiple of ${a}$ and ${b}$?", str(a * b // math.gcd(a, b))


def _function(rng: random.Random):
    import sympy as sp

    x = sp.Symbol("x")
    kind = rng.choice(["poly", "trig", "exp", "rational"])
    if kind == "poly":
        f = sum(rng.randint(-7, 7) * x**k for k in range(rng.randint(2, 4) + 1))
    elif kind == "trig":
        f = rng.randint(1, 5) * rng.choice([sp.sin, sp.cos])(rng.randint(1, 4) * x) + rng.randint(-5, 5) * x
    elif kind == "exp":
        f = rng.randint(1, 4) * x ** rng.randint(1, 3) * sp.exp(rng.randint(-3, 3) * x)
    else:
        f = (x + rng.randint(-5, 5)) / (x**2 + rng.randint(1, 9))
    return x, (f if f != 0 else x)


def _derivative(rng: random.Random) -> tuple[str, str]:
    import sympy as sp

    x, f = _function(rng)
    return f"Find the derivative of $f(x) = {sp.latex(f)}$ with respect to $x$.", sp.latex(sp.diff(f, x))


def _integral(rng: random.Random) -> tuple[str, str]:
    import sympy as sp

    x = sp.Symbol("x")
    f = sum(rng.randint(-6, 6) * x**k for k in range(rng.randint(1, 3) + 1)) or x
    lo = rng.randint(-3, 2)
    hi = lo + rng.randint(1, 4)
    return f"Evaluate $\\int_{{{lo}}}^{{{hi}}} \\left({sp.latex(f)}\\right) \\, dx$.", sp.latex(sp.integrate(f, (x, lo, hi)))


def _evaluate(rng: random.Random) -> tuple[str, str]:
    import sympy as sp

    x, f = _function(rng)
    k = rng.randint(-4, 4)
    if f.subs(x, k).has(sp.zoo) or f.subs(x, k).has(sp.nan):
        k = 5
    return f"If $f(x) = {sp.latex(f)}$, what is $f({k})$?", sp.latex(f.subs(x, k))


def _series(rng: random.Random) -> tuple[str, str]:
    a, d, n = rng.randint(-20, 20), _nonzero(rng, -7, 9), rng.randint(5, 60)
    last = a + (n - 1) * d
    return (f"What is the sum of the arithmetic sequence ${a}, {a + d}, {a + 2 * d}, \\ldots, {last}$?",
            str(n * (a + last) // 2))


def _dice(rng: random.Random) -> tuple[str, str]:
    faces = rng.choice([4, 6, 8, 10])
    target = rng.randint(2, 2 * faces)
    ways = sum(1 for i in range(1, faces + 1) for j in range(1, faces + 1) if i + j == target)
    p = Fraction(ways, faces * faces)
    return (f"Two fair {faces}-sided dice, with faces numbered 1 through {faces}, are rolled. What is the probability "
            f"that the sum of the two numbers rolled is {target}? Express your answer as a common fraction.",
            f"\\frac{{{p.numerator}}}{{{p.denominator}}}" if p.denominator != 1 else str(p.numerator))


def _geometry(rng: random.Random) -> tuple[str, str]:
    import sympy as sp

    kind = rng.choice(["hyp", "circle", "rect", "triangle"])
    if kind == "hyp":
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        return (f"A right triangle has legs of length ${a}$ and ${b}$. What is the length of its hypotenuse? "
                "Express your answer in simplest radical form.", sp.latex(sp.sqrt(a * a + b * b)))
    if kind == "circle":
        r = rng.randint(1, 15)
        return (f"A circle has a circumference of ${2 * r}\\pi$ units. What is its area, in square units? "
                "Express your answer in terms of $\\pi$.", f"{r * r}\\pi")
    if kind == "rect":
        w, p = rng.randint(2, 30), rng.randint(1, 20)
        per = 2 * (w + w + p)
        return (f"The length of a rectangle is ${p}$ units more than its width, and its perimeter is ${per}$ units. "
                "What is the area of the rectangle, in square units?", str(w * (w + p)))
    b, h = rng.randint(2, 40), rng.randint(2, 40)
    return (f"A triangle has a base of ${b}$ units and a height of ${h}$ units. What is its area, in square units? "
            "Express your answer as a decimal if necessary.", str(Fraction(b * h, 2)))


def _word(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(["Alice", "Ben", "Carla", "Diego", "Emma", "Farid", "Grace", "Hiro"])
    item = rng.choice(["apples", "stickers", "marbles", "pencils", "cookies", "stamps"])
    per, friends, left = rng.randint(2, 12), rng.randint(2, 9), rng.randint(0, 15)
    total = per * friends + left
    if rng.random() < 0.5:
        return (f"{name} has {total} {item}. {name} gives {per} {item} to each of {friends} friends. How many {item} "
                f"does {name} have left?", str(left))
    price, qty = rng.randint(2, 25), rng.randint(3, 20)
    discount = rng.choice([10, 20, 25, 50])
    cost = Fraction(price * qty * (100 - discount), 100)
    return (f"{name} buys {qty} {item} at \\${price} each, with a {discount}\\% discount on the whole purchase. "
            f"How many dollars does {name} pay?", str(cost) if cost.denominator == 1 else f"{float(cost):.2f}")


#: template name -> draw; each returns (prompt, answer).
TEMPLATES: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "quadratic": _quadratic, "system": _system, "remainder": _remainder, "gcd_lcm": _gcd_lcm,
    "derivative": _derivative, "integral": _integral, "evaluate": _evaluate, "series": _series,
    "dice": _dice, "geometry": _geometry, "word": _word,
}


def draw(count: Optional[int] = None, seed: int = DEFAULT_SEED, *,
         templates: Optional[dict[str, Callable[[random.Random], tuple[str, str]]]] = None,
         source: str = SOURCE) -> list[tuple[str, str, str, str]]:
    """``count`` (default ``DEFAULT_COUNT``) synthetic MATH-style problems, the templates in turn, integers from ``random.Random(seed)``.

    ``templates`` (default ``TEMPLATES``) and ``source`` let another source draw the same
    way from its own templates (``math_problems_v2``).

    Returns:
        ``(id, template, prompt, answer)`` per problem: ``id`` is ``<source>:<template>:<index>``,
        ``answer`` the computed answer as a string (LaTeX where it is an expression). Equal
        prompts drawn twice are kept once (the first), so fewer than ``count`` may come back.
        ``data.prompts`` makes them records of source ``source``.

    Raises:
        ValueError: ``count`` < 1.
    """
    count = DEFAULT_COUNT if count is None else count
    if count < 1:
        raise ValueError(f"{source} count={count}: must be at least 1")
    templates = TEMPLATES if templates is None else templates
    rng = random.Random(seed)
    names = list(templates)
    out, seen = [], set()
    for i in range(count):
        name = names[i % len(names)]
        prompt, answer = templates[name](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append((f"{source}:{name}:{i}", name, prompt, answer))
    return out
