"""data/math_problems.py: the synthetic MATH-style training source."""

import re

import pytest

from specforge_opd.data import math_problems
from specforge_opd.data.prompts import KNOWN_SOURCES, load_source


def test_the_draw_is_seeded_covers_every_template_and_its_answers_hold():
    first = math_problems.draw(66, seed=3)
    assert first == math_problems.draw(66, seed=3)
    assert first != math_problems.draw(66, seed=4)
    assert {t for _, t, _, _ in first} == set(math_problems.TEMPLATES)
    assert len({p for _, _, p, _ in first}) == len(first)
    import sympy as sp

    x = sp.Symbol("x")
    for rid, template, prompt, answer in first:
        assert rid.startswith(f"math_problems:{template}:")
        if template == "quadratic":
            from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

            latex = re.search(r"\$(.*) = 0\$", prompt).group(1)
            poly = parse_expr(latex.replace("^{", "**(").replace("}", ")"),
                              transformations=standard_transformations + (implicit_multiplication,))
            assert all(poly.subs(x, int(r)) == 0 for r in answer.split(", "))
        if template == "remainder":
            m = int(re.search(r"divided by \$(\d+)\$", prompt).group(1))
            if "^" in prompt:
                base, k = map(int, re.search(r"\$(\d+)\^\{(\d+)\}\$", prompt).groups())
                assert pow(base, k, m) == int(answer)
            else:
                assert int(re.search(r"when \$(\d+)\$", prompt).group(1)) % m == int(answer)
        if template == "system":
            x0, y0 = map(int, answer.strip("()").split(", "))
            for a, sign, b, c in re.findall(r"(-?\d*)x ([+-]) (\d*)y = (-?\d+)", prompt):
                a = int(a) if a not in ("", "-") else (1 if a == "" else -1)
                b = int(b or 1) * (1 if sign == "+" else -1)
                assert a * x0 + b * y0 == int(c)
    with pytest.raises(ValueError, match="count=0"):
        math_problems.draw(0)


def test_the_source_loads_as_records_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(math_problems, "DEFAULT_COUNT", 22)
    assert "math_problems" in KNOWN_SOURCES
    recs = load_source("math_problems", cache=tmp_path)
    assert len(recs) == 22 and all(r.source == "math_problems" and r.prompt and r.answer for r in recs)
    assert recs[0].meta["template"] == "quadratic"
    monkeypatch.setattr(math_problems, "draw", lambda *a, **k: pytest.fail("drawn again instead of read back"))
    assert load_source("math_problems", cache=tmp_path) == recs


def test_the_records_and_the_cache_stamp_are_pinned(monkeypatch):
    """Shipped drafters were trained on these records: new templates go in a new source
    (``math_problems_v2``). The cache is keyed by this module's text, so an edit re-parses
    the source once and must not change a record."""
    import hashlib
    import json
    from pathlib import Path

    import sympy

    from specforge_opd.data import prompts

    text_digest = hashlib.sha1(Path(math_problems.__file__).read_bytes()).hexdigest()
    # the draw is sequential: its first 110 records are those of the default draw
    first = math_problems.draw(110)
    assert hashlib.sha1(json.dumps(first).encode()).hexdigest() == "1296d12046e23845281283f946e01099f52a72cc"
    assert (math_problems.DEFAULT_COUNT, math_problems.DEFAULT_SEED, len(math_problems.TEMPLATES)) == (4000, 0, 11)
    stamps = {}
    monkeypatch.setattr(prompts, "_cached", lambda name, src, parse, cache, stamp=None: stamps.setdefault(name, stamp))
    load_source("math_problems")
    assert stamps["math_problems"] == f"{text_digest}|{sympy.__version__}"
