r"""LaTeX in MATH's conventions, for the hand-written templates of ``math_problems_v2``.

Exact values in, MATH's notation out: fractions with the sign in front (``-\frac{3}{4}``),
simplest radical form (``6\sqrt{2}``), multiples of pi, polynomials and sums with their signs
folded (``x^2 - 5x``), matrices, complex numbers, numbers in a base with its subscript, and
the exact sine, cosine and tangent of MATH's angles. Stdlib only (no sympy).

Its text is part of ``math_problems_v2``'s cache stamp (``data.prompts``): an edit here
re-draws that source once.
"""

from __future__ import annotations

from fractions import Fraction


# ---------------------------------------------------------------------------
# LaTeX in MATH's conventions


def _frac(q) -> str:
    """An integer, or ``\\frac{p}{q}`` with the sign in front (``-\\frac{3}{4}``)."""
    q = Fraction(q)
    if q.denominator == 1:
        return str(q.numerator)
    return f"{'-' if q < 0 else ''}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _fraction_note(q) -> str:
    """MATH's instruction for a non-integer answer (an integer answer needs none)."""
    return " Express your answer as a common fraction." if Fraction(q).denominator != 1 else ""


def _decimal(q) -> str:
    """A terminating decimal, exactly (``Fraction(15, 4)`` -> ``3.75``), without trailing zeros.

    Raises:
        ValueError: ``q`` has no decimal of at most 6 places (a template drew badly).
    """
    q = Fraction(q)
    for places in range(7):
        scaled = q * 10**places
        if scaled.denominator == 1:
            digits = str(abs(scaled.numerator)).rjust(places + 1, "0")
            body = digits if places == 0 else f"{digits[:-places]}.{digits[-places:]}"
            return ("-" if q < 0 else "") + body
    raise ValueError(f"{q} has no short terminating decimal")


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


def _sqrt_parts(n: int) -> tuple[int, int]:
    """``(k, m)`` with ``sqrt(n) = k * sqrt(m)`` and ``m`` square-free (``n`` >= 1)."""
    k, m, d = 1, n, 2
    while d * d <= m:
        while m % (d * d) == 0:
            m //= d * d
            k *= d
        d += 1
    return k, m


def _times(coef, symbol: str) -> str:
    """``coef`` times ``symbol`` (``\\pi``, ``\\sqrt{3}``, or empty): ``\\frac{5\\pi}{6}``, ``-3\\sqrt{2}``."""
    coef = Fraction(coef)
    if coef == 0:
        return "0"
    if not symbol:
        return _frac(coef)
    p, q = abs(coef.numerator), coef.denominator
    num = symbol if p == 1 else f"{p}{symbol}"
    body = num if q == 1 else f"\\frac{{{num}}}{{{q}}}"
    return ("-" if coef < 0 else "") + body


def _root(coef, m: int) -> str:
    """``coef * sqrt(m)`` for a square-free ``m`` (1 writes no root)."""
    return _times(coef, "" if m == 1 else f"\\sqrt{{{m}}}")


def _surd(n: int, coef=1) -> str:
    """``coef * sqrt(n)`` in simplest radical form (``_surd(72)`` -> ``6\\sqrt{2}``)."""
    if n == 0:
        return "0"
    k, m = _sqrt_parts(n)
    return _root(Fraction(coef) * k, m)


def _pi(coef) -> str:
    return _times(coef, "\\pi")


def _combo(terms: list[tuple[int, str]]) -> str:
    """A sum of ``(integer coefficient, monomial)`` terms, signs folded: ``x^2 - 6x + y^2 + 4y``."""
    out = ""
    for c, mono in terms:
        if c == 0:
            continue
        mag = abs(c)
        term = str(mag) if not mono else (mono if mag == 1 else f"{mag}{mono}")
        if not out:
            out = ("-" if c < 0 else "") + term
        else:
            out += (" - " if c < 0 else " + ") + term
    return out or "0"


def _poly(coeffs: list[int], var: str = "x") -> str:
    """The polynomial with ``coeffs`` from the highest degree down: ``[2, -5, 3]`` -> ``2x^2 - 5x + 3``."""
    deg = len(coeffs) - 1

    def mono(d: int) -> str:
        return "" if d == 0 else var if d == 1 else f"{var}^{d}" if d < 10 else f"{var}^{{{d}}}"

    return _combo([(c, mono(deg - i)) for i, c in enumerate(coeffs)])


def _signed_sum(values: list) -> str:
    """Fractions joined into a sum: ``3 - \\frac{3}{2} + \\frac{3}{4}``."""
    out = _frac(values[0])
    for v in values[1:]:
        out += f" - {_frac(-v)}" if v < 0 else f" + {_frac(v)}"
    return out


def _matrix(rows: list[list], env: str = "pmatrix") -> str:
    body = " \\\\ ".join(" & ".join(str(e) for e in row) for row in rows)
    return f"\\begin{{{env}}} {body} \\end{{{env}}}"


def _column(entries: list) -> str:
    return _matrix([[e] for e in entries])


def _complex(re, im) -> str:
    """``a + bi`` as MATH writes it: ``3 - i``, ``-2i``, ``\\frac{1}{5} + \\frac{7}{5}i``."""
    re, im = Fraction(re), Fraction(im)
    if im == 0:
        return _frac(re)
    mag = abs(im)
    imag = ("" if mag == 1 else _frac(mag)) + "i"
    if re == 0:
        return ("-" if im < 0 else "") + imag
    return f"{_frac(re)} {'-' if im < 0 else '+'} {imag}"


def _in_base(n: int, base: int) -> str:
    digits = ""
    while True:
        n, d = divmod(n, base)
        digits = "0123456789ABCDEF"[d] + digits
        if n == 0:
            return digits


def _based(n: int, base: int) -> str:
    """``n`` written in ``base`` with its subscript: ``1203_4``."""
    return f"{_in_base(n, base)}_{{{base}}}" if base >= 10 else f"{_in_base(n, base)}_{base}"


# exact values on the unit circle: the cosine of a first-quadrant angle as coef * sqrt(m)
_COS = {0: (Fraction(1), 1), 30: (Fraction(1, 2), 3), 45: (Fraction(1, 2), 2), 60: (Fraction(1, 2), 1),
        90: (Fraction(0), 1)}
#: The angles (degrees) whose sine, cosine and tangent MATH expects exactly.
ANGLES = (0, 30, 45, 60, 90, 120, 135, 150, 180, 210, 225, 240, 270, 300, 315, 330)


def _cos(d: int) -> tuple[Fraction, int]:
    d %= 360
    if d > 180:
        d = 360 - d
    if d > 90:
        c, m = _cos(180 - d)
        return -c, m
    return _COS[d]


def _sin(d: int) -> tuple[Fraction, int]:
    return _cos(90 - d)


def _tan(d: int) -> tuple[Fraction, int]:
    (s, sm), (c, cm) = _sin(d), _cos(d)
    # s sqrt(sm) / (c sqrt(cm)) = s / (c cm) * sqrt(sm cm)
    k, m = _sqrt_parts(sm * cm)
    return s / (c * cm) * k, m
