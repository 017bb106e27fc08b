"""Prompt sources: packaged counts, truncated ShareGPT decoding, dedupe against eval sets, slices, local files."""

from __future__ import annotations

import gzip
import json

import pytest

from specforge_opd.config import DataConfig
from specforge_opd.data import prompts
from specforge_opd.data.prompts import PromptRecord, PromptsError


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # a private cache: the parse-then-cache path runs here, not a stale shared cache
    return tmp_path_factory.mktemp("prompt_cache")


@pytest.mark.parametrize(
    "name,count",
    [("humaneval", 164), ("mmath_math500", 311), ("mmath_aime24", 30), ("mmath_aime25", 15), ("mtbench", 80)],
)
def test_packaged_eval_counts(cache, name, count):
    recs = prompts.eval_prompts(name, cache=cache)
    assert len(recs) == count
    assert all(r.source == name and r.text().strip() for r in recs)
    assert len({r.id for r in recs}) == count


def test_eval_record_contents(cache):
    mt = prompts.eval_prompts("mtbench", limit=3, cache=cache)
    assert len(mt) == 3 and mt[0].id == "81" and len(mt[0].meta["turns"]) == 2
    assert mt[0].chat_messages() == [{"role": "user", "content": mt[0].meta["turns"][0]}]
    aime = prompts.eval_prompts("mmath_aime24", cache=cache)
    assert aime[0].answer == "204" and "Aya" in aime[0].text()
    he = prompts.eval_prompts("humaneval", limit=1, cache=cache)[0]
    assert he.id == "HumanEval/0" and "def has_close_elements" in he.text() and he.meta["entry_point"] == "has_close_elements"


def test_sharegpt_whole_conversations(cache):
    recs = prompts.load_source("sharegpt", cache=cache)
    # 17671 whole conversations in the truncated file; 11168 start with a non-empty user turn
    assert len(recs) == 11168
    assert recs[0].id == "QWJhYvA_0" and recs[0].text().startswith("Summarize the main ideas of Jeff Walker")
    assert all(r.chat_messages()[-1]["role"] == "user" for r in recs)
    # 41 start with a system turn; 29 of those have a user turn next (12 have nothing after it)
    assert sum(r.messages is not None for r in recs) == 29
    again = prompts.load_source("sharegpt", cache=cache)  # from the JSONL cache
    assert [r.id for r in again[:50]] == [r.id for r in recs[:50]] and again[7] == recs[7]


def test_truncated_array_decoding():
    full = [{"id": "a", "x": [1, 2]}, {"id": "b", "s": "} ] ,"}, {"id": "c"}]
    text = json.dumps(full, indent=2)
    assert list(prompts.iter_truncated_json_array(text)) == full
    cut = text[: text.index('"c"') + 2]  # inside the third object
    assert list(prompts.iter_truncated_json_array(cut)) == full[:2]
    assert list(prompts.iter_truncated_json_array(text[:5])) == []
    with pytest.raises(PromptsError, match="JSON array"):
        list(prompts.iter_truncated_json_array('{"a": 1}'))


def test_sharegpt_first_user_turn_rules():
    f = prompts._sharegpt_record
    assert f({"id": "1", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "go on"}]}) is None
    assert f({"id": "2", "conversations": []}) is None
    assert f({"id": "3", "conversations": [{"from": "human", "value": "  "}]}) is None
    r = f({"id": "4", "conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A"}]})
    assert r.prompt == "Q?" and r.messages is None
    r = f({"id": "5", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q?"}]})
    assert r.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}] and r.text() == "Q?"


def test_record_schema():
    with pytest.raises(PromptsError, match="exactly one"):
        PromptRecord(id="x", source="s")
    with pytest.raises(PromptsError, match="exactly one"):
        PromptRecord(id="x", source="s", prompt="p", messages=[{"role": "user", "content": "p"}])
    r = PromptRecord(id="x", source="s", prompt="p", answer="1", meta={"k": [1]})
    assert PromptRecord.from_dict(json.loads(r.to_json())) == r


def _write_jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def test_local_file_loaders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    gsm = _write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Tom has 3 apples. How many?", "answer": "3 apples\n#### 3"}])
    (r,) = prompts.load_source("gsm8k", local_files={"gsm8k": gsm})
    assert (r.source, r.prompt, r.answer, r.id) == ("gsm8k", "Tom has 3 apples. How many?", "3", "0")

    ca = tmp_path / "ca.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"instruction": "Write a loop.", "input": "n=3", "output": "for i in range(3): pass"},
             {"instruction": "Reverse a string.", "input": "", "output": "s[::-1]"}]
        ),
        ca,
    )  # fmt: skip
    recs = prompts.load_source("codealpaca", local_files={"codealpaca": str(ca)})
    assert [r.prompt for r in recs] == ["Write a loop.\n\nn=3", "Reverse a string."]

    mbpp = _write_jsonl(tmp_path / "mbpp.jsonl.gz", [{"task_id": 11, "text": "Remove chars.", "code": "def f(): pass"}], gz=True)
    (r,) = prompts.eval_prompts("mbpp", local_files={"mbpp": mbpp})
    assert (r.id, r.prompt, r.answer) == ("11", "Remove chars.", "def f(): pass")

    # messages as a JSON string in one row and a native list in another; a row with no prompt is skipped
    aops = _write_jsonl(
        tmp_path / "aops.jsonl",
        [{"messages": json.dumps([{"role": "user", "content": "Prove x."}, {"role": "assistant", "content": "ok"}])},
         {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Find y."}]},
         {"unrelated": 1}],
    )  # fmt: skip
    recs = prompts.load_source("aops", local_files={"aops": aops})
    assert [r.text() for r in recs] == ["Prove x.", "Find y."] and recs[1].messages[0]["role"] == "system"

    m500 = tmp_path / "m500.json"
    m500.write_text(json.dumps([{"problem": "Compute 1+1.", "answer": "2", "unique_id": "test/a.json"}]))
    (r,) = prompts.eval_prompts("math500", local_files={"math500": str(m500)})
    assert (r.id, r.answer) == ("test/a.json", "2")


def test_hub_only_source_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(PromptsError, match=r"data\.local_files\.gsm8k"):
        prompts.load_source("gsm8k")
    with pytest.raises(PromptsError, match=r"data\.local_files\.math: .* does not exist"):
        prompts.load_source("math", local_files={"math": str(tmp_path / "missing.jsonl")})


def test_unknown_and_empty_sets(tmp_path):
    with pytest.raises(PromptsError, match="known: mtbench, humaneval"):
        prompts.eval_prompts("mt-bench")
    with pytest.raises(PromptsError, match="unknown prompt source `sharegtp`"):
        prompts.load_source("sharegtp")
    empty = _write_jsonl(tmp_path / "e.jsonl", [])
    with pytest.raises(PromptsError, match="`aime25` is empty"):
        prompts.eval_prompts("aime25", local_files={"aime25": empty})


def test_overlap_index():
    long_eval = "Let ABC be a triangle inscribed in circle omega and let the tangents at B and C meet at D"
    idx = prompts.OverlapIndex([long_eval, "Write a haiku about the sea now", "hi"])
    assert idx.overlaps("  LET abc be a TRIANGLE inscribed in circle omega and let the tangents at b and c meet at d ")
    assert idx.overlaps("Please solve: " + long_eval[:80] + " ... thanks")  # shares a 13-word run
    assert idx.overlaps("Could you write a haiku about the sea now? Thanks")  # contains a short eval prompt
    assert idx.overlaps("Hi")  # exact match of a very short one
    assert not idx.overlaps("Hi there, how are you")  # too short to match inside
    assert not idx.overlaps("Let ABC be a triangle inscribed in a square")


def _pool_cfg(tmp_path, rows, **kw):
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    return DataConfig(train_sources=["codealpaca"], local_files={"codealpaca": path}, **kw)


def test_training_pool_drops_eval_overlap_and_duplicates(tmp_path, cache):
    mt = prompts.eval_prompts("mtbench", cache=cache)
    aime = prompts.eval_prompts("mmath_aime24", cache=cache)
    rows = [{"instruction": f"Unrelated task number {i}: sort a list of {i} integers."} for i in range(40)]
    rows += [
        {"instruction": mt[0].text()},  # verbatim MT-Bench
        {"instruction": "  " + mt[5].text().upper() + " "},  # same after normalization
        {"instruction": "Solve this: " + aime[3].text()},  # contains an AIME problem
        {"instruction": mt[2].meta["turns"][1]},  # an MT-Bench second turn
        {"instruction": "Unrelated task number 3: sort a list of 3 integers."},  # duplicate
        {"instruction": ""},
    ]
    cfg = _pool_cfg(tmp_path, rows, exclude_eval=["mtbench", "mmath_aime24"])
    pool, stats = prompts.training_pool_with_stats(cfg, cache=cache)
    assert stats.loaded == {"codealpaca": 45}  # the empty row has no prompt and is skipped at load
    assert (stats.eval_overlap, stats.duplicates, stats.kept) == (4, 1, 40)
    assert {r.text() for r in pool} == {r["instruction"] for r in rows[:40]}
    # without exclusion the overlapping ones stay
    cfg2 = _pool_cfg(tmp_path, rows, exclude_eval=[])
    assert prompts.training_pool_with_stats(cfg2, cache=cache)[1].kept == 44


def test_training_pool_slices_disjoint_and_seeded(tmp_path, cache):
    rows = [{"instruction": f"Prompt {i} about topic {i * 7}"} for i in range(200)]
    a = prompts.training_pool(_pool_cfg(tmp_path, rows, exclude_eval=[], num_slices=3, slices=[0]), cache=cache)
    b = prompts.training_pool(_pool_cfg(tmp_path, rows, exclude_eval=[], num_slices=3, slices=[1, 2]), cache=cache)
    ta, tb = {r.text() for r in a}, {r.text() for r in b}
    assert not ta & tb and len(ta) + len(tb) == 200 and 40 < len(ta) < 95
    assert all(prompts.slice_of(t, 3) == 0 for t in ta)
    again = prompts.training_pool(_pool_cfg(tmp_path, rows, exclude_eval=[], num_slices=3, slices=[0]), cache=cache)
    assert [r.id for r in again] == [r.id for r in a]  # same seed, same order
    other = prompts.training_pool(_pool_cfg(tmp_path, rows, exclude_eval=[], num_slices=3, slices=[0], seed=1), cache=cache)
    assert [r.id for r in other] != [r.id for r in a] and {r.id for r in other} == {r.id for r in a}
    capped = prompts.training_pool(_pool_cfg(tmp_path, rows, exclude_eval=[], num_prompts=7), cache=cache)
    assert len(capped) == 7
    with pytest.raises(PromptsError, match=r"data\.slices=\[3\]"):
        prompts.training_pool(_pool_cfg(tmp_path, rows, num_slices=3, slices=[3]), cache=cache)


def test_source_limits_cap_one_source_and_leave_the_others(tmp_path, cache, monkeypatch):
    """``data.source_limits`` caps a source at a seeded random subset of its survivors; an
    unlimited source keeps every prompt; a limit on a source not trained on is refused."""
    monkeypatch.setattr(prompts, "_POOL_MEMO", {})
    code = _write_jsonl(tmp_path / "code.jsonl", [{"instruction": f"Write function number {i} in Python."} for i in range(60)])
    math = _write_jsonl(tmp_path / "math.jsonl", [{"question": f"What is {i} plus {i * 3}?"} for i in range(30)])

    def pool(**kw):
        data = DataConfig(train_sources=["codealpaca", "gsm8k"], local_files={"codealpaca": code, "gsm8k": math},
                          exclude_eval=[], **kw)
        return prompts.training_pool_with_stats(data, cache=cache)

    free, _ = pool()
    capped, stats = pool(source_limits={"codealpaca": 10})
    src = lambda recs, word: {r.text() for r in recs if word in r.text()}  # noqa: E731
    assert len(src(free, "function")) == 60 and len(src(capped, "function")) == 10
    assert src(capped, "plus") == src(free, "plus")  # the other source is untouched
    assert stats.over_limit == {"codealpaca": 50} and stats.kept == 40 and "50 codealpaca over its data.source_limits" in stats.summary()
    kept = sorted(int(t.split()[3]) for t in src(capped, "function"))
    assert kept != list(range(10))  # a random subset, not the file's first rows
    assert src(pool(source_limits={"codealpaca": 10})[0], "function") == src(capped, "function")  # seeded
    assert src(pool(source_limits={"codealpaca": 10}, seed=5)[0], "function") != src(capped, "function")
    assert len(pool(source_limits={"codealpaca": 100})[0]) == 90  # a limit above the source's size keeps it all
    with pytest.raises(PromptsError, match=r"data.source_limits names \['mbpp'\].*not in data.train_sources"):
        pool(source_limits={"mbpp": 5})


def test_training_pool_too_long_with_tokenizer(tmp_path, cache):
    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": text.split()})()

    rows = [{"instruction": "short one"}, {"instruction": "word " * 600}]
    pool, stats = prompts.training_pool_with_stats(
        _pool_cfg(tmp_path, rows, exclude_eval=[], max_prompt_tokens=512), cache=cache, tokenizer=WordTokenizer()
    )
    assert [r.text() for r in pool] == ["short one"] and stats.too_long == 1


def test_sharegpt_later_turns_rules():
    f = prompts._sharegpt_later_turns
    conv = {"id": "c", "conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}, {"from": "human", "value": "Q3"},
        {"from": "human", "value": "Q3 again"}, {"from": "gpt", "value": "A3"}, {"from": "human", "value": "Q4"}]}
    recs = f(conv)
    # a record per later user turn, the original replies as context; two user turns in a row end it
    assert [r.id for r in recs] == ["c#t2", "c#t3"]
    assert recs[1].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                                {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}]
    assert recs[1].text() == "Q1" and recs[1].user_texts() == ["Q1", "Q2", "Q3"]
    assert recs[1].context_text() == "S\nQ1\nA1\nQ2\nA2\nQ3"
    # a continuation piece (the model speaks first) and an empty reply give nothing after the break
    assert f({"id": "d", "conversations": [{"from": "gpt", "value": "A"}, {"from": "human", "value": "Q"}]}) == []
    assert f({"id": "e", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": " "},
                                           {"from": "human", "value": "Q2"}]}) == []
    # a first-turn record keeps judging duplicates and length on its first user turn alone
    first = PromptRecord(id="x", source="sharegpt", messages=[{"role": "system", "content": "S"},
                                                              {"role": "user", "content": "Q"}])
    assert first.context_text() == "Q" and first.user_texts() == ["Q"]


def test_training_pool_later_turns_share_the_first_turns_slice(cache):
    """Every later turn lands in its conversation's slice, is judged on its whole context for
    duplicates and length, and is dropped when any of its user turns overlaps an eval set."""
    cfg = DataConfig(train_sources=["sharegpt", "sharegpt_turns"], num_prompts=None, num_slices=4, slices=[0],
                     exclude_eval=["mtbench"], max_prompt_tokens=512)
    pool, stats = prompts.training_pool_with_stats(cfg, cache=cache)
    turns = [r for r in pool if r.source == "sharegpt_turns"]
    assert len(turns) > 1000 and stats.loaded["sharegpt_turns"] > len(turns)
    assert all(prompts.slice_of(prompts.normalize_text(r.text()), 4) == 0 for r in turns)
    assert len({prompts.normalize_text(r.context_text()) for r in pool}) == len(pool)
    # the first-turn records are exactly the pool without the new source
    alone = prompts.training_pool(cfg.model_copy(update={"train_sources": ["sharegpt"]}), cache=cache)
    assert {r.id for r in pool if r.source == "sharegpt"} == {r.id for r in alone}


def test_training_pool_drops_a_later_turn_overlapping_an_eval_set(cache, monkeypatch):
    mt = prompts.eval_prompts("mtbench", cache=cache)

    def conv(i, last):
        return PromptRecord(id=f"p{i}#t2", source="sharegpt_turns", messages=[
            {"role": "user", "content": f"hello there number {i}"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": last}])

    planted = [conv(0, mt[3].text()), conv(1, "tell me more"), conv(2, "tell me more")]
    real = prompts.load_source
    monkeypatch.setattr(prompts, "load_source", lambda name, **kw: planted if name == "sharegpt_turns" else real(name, **kw))
    cfg = DataConfig(train_sources=["sharegpt_turns"], num_prompts=None, exclude_eval=["mtbench"])
    pool, stats = prompts.training_pool_with_stats(cfg, cache=cache)
    # the first user turn alone overlaps nothing: the check reads every user turn
    assert [r.id for r in pool] == ["p1#t2", "p2#t2"] and stats.eval_overlap == 1


def test_pool_is_built_once_for_the_trained_and_the_held_out_prompts(tmp_path, cache, monkeypatch):
    rows = [{"instruction": f"Prompt {i} about topic {i * 7}"} for i in range(50)]
    cfg = _pool_cfg(tmp_path, rows, exclude_eval=[], num_prompts=10)
    calls = []
    real = prompts._uncapped_pool
    monkeypatch.setattr(prompts, "_uncapped_pool", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts._POOL_MEMO.clear()
    trained = prompts.training_pool(cfg, cache=cache)
    held = prompts.held_out_prompts(cfg, 5, field="x", cache=cache)
    assert len(calls) == 1 and len(trained) == 10 and len(held) == 5
    assert not {r.id for r in trained} & {r.id for r in held}
    # a changed file is read again, never served from the memo
    _write_jsonl(tmp_path / "train.jsonl", rows[:20])
    assert len(prompts.training_pool(cfg.model_copy(update={"num_prompts": None}), cache=cache)) == 20 and len(calls) == 2
    # with no cache given, the cache follows the environment: another one is another memo entry
    from specforge_opd.data.locations import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env1"))
    prompts.training_pool(cfg, cache=None)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env2"))
    prompts.training_pool(cfg, cache=None)
    assert len(calls) == 4


# ---------------------------------------------------------------------------
# python_functions: code-completion prompts from a package's source tree

_FAKE_CORE = '''\
"""Core module of the fake package."""
import functools


@functools.lru_cache(maxsize=None)
@some.other(decorator=True)
def add_numbers(a: int,
                b: int = 2) -> int:
    """Return the sum of a and b, both integers, as an integer value."""
    body_marker = a + b
    return body_marker


def _private_helper(x):
    """A private helper whose docstring is long enough to be kept otherwise."""
    return x


def undocumented(x):
    return x


def short_doc(x):
    """Too short."""
    return x


class Shape:
    """A shape."""

    @property
    def area(self):
        """The area of the shape in square units, computed from its sides.

        Raises ValueError for a degenerate shape.
"""
        return body_marker

    def _hidden(self):
        """A private method with a docstring long enough to be kept otherwise."""

    class Inner:
        def describe(self): r"""Describe the inner part of the shape; a \\n stays raw."""; return body_marker


class _PrivateClass:
    def method(self):
        """A public method of a private class, so it is private as well."""


def one_liner(x): """A one-line function whose docstring shares the def line."""; return x
'''

_FAKE_ALPHA = '''\
raise SystemExit("fakepkg.sub.alpha was executed")


async def fetch(url, *, timeout=10.0):
    """Fetch the page at url, waiting at most timeout seconds for an answer."""
    return body_marker
'''


def _fake_package(site, version="0.3"):
    """A package ``fakepkg`` under ``site`` with dist-info metadata; importing any module of it raises."""
    pkg = site / "fakepkg"
    docstring_fn = 'def kept_if_visited(x):\n    """A documented function in a place the parser must not visit."""\n'
    files = {
        "__init__.py": 'raise RuntimeError("fakepkg was executed")\n',
        "core.py": _FAKE_CORE,
        "broken.py": "def oops(:\n",
        "test_core_extra.py": docstring_fn,
        "tests/__init__.py": "",
        "tests/test_core.py": docstring_fn,
        "data/helper.py": docstring_fn,  # not a subpackage: no __init__.py
        "sub/__init__.py": "",
        "sub/alpha.py": _FAKE_ALPHA,
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    info = site / f"fakepkg-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakepkg\nVersion: {version}\n")
    return pkg


_FAKE_IDS = ["fakepkg:fakepkg.core:add_numbers", "fakepkg:fakepkg.core:Shape.area",
             "fakepkg:fakepkg.core:Shape.Inner.describe", "fakepkg:fakepkg.core:one_liner",
             "fakepkg:fakepkg.sub.alpha:fetch"]


def _code(record):
    """The code inside a python_functions prompt (what HUMANEVAL_INSTRUCTION wraps)."""
    head, _, tail = prompts.HUMANEVAL_INSTRUCTION.partition("{prompt}")
    assert record.prompt.startswith(head) and record.prompt.endswith(tail)
    return record.prompt[len(head): len(record.prompt) - len(tail)]


def test_python_functions_records_from_a_fake_package(tmp_path):
    pkg = _fake_package(tmp_path)
    recs = prompts.parse_python_functions(pkg, "0.3")
    assert [r.id for r in recs] == _FAKE_IDS
    assert all(r.source == "python_functions" and r.messages is None for r in recs)
    assert recs[0].meta == {"package": "fakepkg", "version": "0.3", "path": "fakepkg/core.py"}
    assert recs[-1].meta["path"] == "fakepkg/sub/alpha.py"
    code = {r.id.rsplit(":", 1)[1]: _code(r) for r in recs}
    # signature as written (two lines), docstring, no decorator, no body; ends with a newline
    assert code["add_numbers"] == (
        'def add_numbers(a: int,\n'
        '                b: int = 2) -> int:\n'
        '    """Return the sum of a and b, both integers, as an integer value."""\n'
    )
    # a method is dedented to column 0; a docstring line indented less than the def keeps its place
    assert code["Shape.area"] == (
        'def area(self):\n'
        '    """The area of the shape in square units, computed from its sides.\n'
        '\n'
        '    Raises ValueError for a degenerate shape.\n'
        '"""\n'
    )
    # a one-line def stops at the docstring's closing quotes
    assert code["Shape.Inner.describe"] == 'def describe(self): r"""Describe the inner part of the shape; a \\n stays raw."""\n'
    assert code["one_liner"].endswith('shares the def line."""\n')
    assert code["fetch"].startswith("async def fetch(url, *, timeout=10.0):\n")
    assert not any("body_marker" in r.prompt or "@" in r.prompt or "return" in r.prompt for r in recs)
    # deterministic: a second parse gives the same records
    assert [r.to_json() for r in prompts.parse_python_functions(pkg, "0.3")] == [r.to_json() for r in recs]
    with pytest.raises(PromptsError, match="no __init__.py"):
        prompts.parse_python_functions(pkg / "data", "0.3")


def test_python_functions_load_source_pins_the_version_and_imports_nothing(tmp_path, monkeypatch):
    import sys

    site = tmp_path / "site"
    _fake_package(site, version="0.3")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(prompts._OFFLINE, "python_functions",
                        (("fakepkg", "", "fakepkg==0.3"), prompts.parse_python_functions))
    cache = tmp_path / "cache"
    recs = prompts.load_source("python_functions", cache=cache)
    assert [r.id for r in recs] == _FAKE_IDS and recs[0].meta["version"] == "0.3"
    assert not any(m == "fakepkg" or m.startswith("fakepkg.") for m in sys.modules)  # found, never imported
    (cached,) = (cache / "prompts").glob("python_functions-*.jsonl")
    assert prompts.load_source("python_functions", cache=cache) == recs  # read back from the cache
    # a change to what selects the records is a new cache entry, not the stale one
    monkeypatch.setattr(prompts, "PYFUNC_MAX_DOC_CHARS", 45)
    fewer = prompts.load_source("python_functions", cache=cache)
    assert len(fewer) < len(recs) and len(list((cache / "prompts").glob("python_functions-*.jsonl"))) == 2
    monkeypatch.setattr(prompts, "PYFUNC_MAX_DOC_CHARS", 1500)
    # another version of the package is refused, naming the pinned install
    monkeypatch.setitem(prompts._OFFLINE, "python_functions",
                        (("fakepkg", "", "fakepkg==0.4"), prompts.parse_python_functions))
    with pytest.raises(PromptsError, match=r"fakepkg` is 0\.3, not the pinned 0\.4: pip install fakepkg==0\.4"):
        prompts.load_source("python_functions", cache=cache)
    monkeypatch.setitem(prompts._OFFLINE, "python_functions",
                        (("nopkg_missing", "", "nopkg-missing==1.0"), prompts.parse_python_functions))
    with pytest.raises(PromptsError, match=r"`nopkg_missing` is not installed: pip install nopkg-missing==1\.0"):
        prompts.load_source("python_functions", cache=cache)


def test_python_functions_in_a_config_and_the_training_pool(tmp_path, monkeypatch, cache):
    from specforge_opd.config import load_config
    from specforge_opd.stages.preflight import check_prompt_sources

    cfg = load_config(None, overrides=["data.train_sources=[sharegpt, sharegpt_turns, python_functions]"])
    assert cfg.data.train_sources == ["sharegpt", "sharegpt_turns", "python_functions"]
    check_prompt_sources(cfg)  # a known offline source
    assert "python_functions" in prompts.KNOWN_SOURCES and "python_functions" in prompts.OFFLINE_SOURCES

    site = tmp_path / "site"
    pkg = _fake_package(site)
    # a sixth function that duplicates another's code after normalization, and one equal to a HumanEval prompt
    he = prompts.eval_prompts("humaneval", limit=1, cache=cache)[0]
    (pkg / "sub" / "beta.py").write_text(he.meta["code_prompt"] + "    pass\n\n\n" + _FAKE_ALPHA.split("\n", 2)[2])
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(prompts._OFFLINE, "python_functions",
                        (("fakepkg", "", "fakepkg==0.3"), prompts.parse_python_functions))
    monkeypatch.setattr(prompts, "_POOL_MEMO", {})
    data = DataConfig(train_sources=["python_functions"], exclude_eval=["humaneval"], num_prompts=None)
    pool, stats = prompts.training_pool_with_stats(data, cache=tmp_path / "c")
    assert stats.loaded == {"python_functions": 7}
    assert (stats.eval_overlap, stats.duplicates, stats.kept) == (1, 1, 5)
    assert sorted(r.id for r in pool) == sorted(_FAKE_IDS)


def test_python_functions_from_installed_sympy(cache):
    recs = prompts.load_source("python_functions", cache=cache)
    assert len(recs) > 1000 and len({r.id for r in recs}) == len(recs)
    assert all(r.id.startswith("sympy:sympy.") and r.meta["version"] == "1.14.0" for r in recs)
    assert not any(".tests." in r.id or "/tests/" in r.meta["path"] for r in recs)
    assert all(_code(r).lstrip().startswith(("def ", "async def ")) for r in recs)


def test_python_functions_records_and_stamp_are_pinned(cache, monkeypatch):
    """Shipped drafters were trained on these records: more packages go in a new source
    (``python_functions_more``), and this one's records and cache key stay as they are."""
    import hashlib

    recs = prompts.load_source("python_functions", cache=cache)
    assert len(recs) == 5303
    digest = hashlib.sha1("".join(r.to_json() + "\n" for r in recs).encode()).hexdigest()
    assert digest == "234f277a4d817a54957ffdc309ddc8b1e858048b"
    stamps = {}
    monkeypatch.setattr(prompts, "_cached", lambda name, src, parse, cache, stamp=None: stamps.setdefault(name, stamp))
    prompts.load_source("python_functions")
    assert stamps["python_functions"] == ("1.14.0|40|1500|['__pycache__', 'benchmarks', 'test', 'tests']|"
                                          "Complete the following Python function.\n\n```python\n{prompt}```")


# ---------------------------------------------------------------------------
# python_functions_more: the same prompts from the source trees of several packages


def _other_package(site, version="1.0", extra=""):
    """A package ``otherpkg`` under ``site`` with one documented function (and ``extra`` in another module)."""
    pkg = site / "otherpkg"
    (pkg / "graphs").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('raise RuntimeError("otherpkg was executed")\n')
    (pkg / "graphs" / "__init__.py").write_text("")
    (pkg / "graphs" / "paths.py").write_text(
        'def shortest_path(graph, source, target):\n'
        '    """Return the list of nodes on a shortest path from source to target in graph."""\n'
        '    raise SystemExit("otherpkg.graphs.paths was executed")\n')
    if extra:
        (pkg / "extra.py").write_text(extra)
    info = site / f"otherpkg-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: otherpkg\nVersion: {version}\n")
    return pkg


_MORE = (("fakepkg", "fakepkg==0.3"), ("otherpkg", "otherpkg==1.0"))


def test_python_functions_more_reads_every_tree_imports_nothing_and_is_keyed_by_each_version(tmp_path, monkeypatch):
    import sys

    site = tmp_path / "site"
    _fake_package(site)
    _other_package(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(prompts._TREE_SOURCES, "python_functions_more", _MORE)
    cache = tmp_path / "cache"
    recs = prompts.load_source("python_functions_more", cache=cache)
    assert [r.id for r in recs] == _FAKE_IDS + ["otherpkg:otherpkg.graphs.paths:shortest_path"]
    assert all(r.source == "python_functions_more" for r in recs)
    assert recs[-1].meta == {"package": "otherpkg", "version": "1.0", "path": "otherpkg/graphs/paths.py"}
    # each tree's records are python_functions's, under this source's name
    assert [r.prompt for r in recs[:5]] == [r.prompt for r in prompts.parse_python_functions(site / "fakepkg", "0.3")]
    assert not any(m.split(".")[0] in ("fakepkg", "otherpkg") for m in sys.modules)  # found, never imported

    real_parse = prompts.parse_python_functions
    monkeypatch.setattr(prompts, "parse_python_functions", lambda *a, **k: pytest.fail("parsed again, not read back"))
    assert prompts.load_source("python_functions_more", cache=cache) == recs
    monkeypatch.setattr(prompts, "parse_python_functions", real_parse)
    stamps = {}
    monkeypatch.setattr(prompts, "_cached", lambda name, src, parse, cache, stamp=None: stamps.setdefault(name, stamp))
    prompts.load_source("python_functions_more")
    assert stamps["python_functions_more"].startswith("fakepkg=0.3,otherpkg=1.0|40|1500|")

    # any tree at another version than its pin, or missing, is refused with the install that fixes it
    monkeypatch.setitem(prompts._TREE_SOURCES, "python_functions_more", (_MORE[0], ("otherpkg", "otherpkg==2.0")))
    with pytest.raises(PromptsError, match=r"otherpkg` is 1\.0, not the pinned 2\.0: pip install otherpkg==2\.0"):
        prompts.load_source("python_functions_more", cache=cache)
    monkeypatch.setitem(prompts._TREE_SOURCES, "python_functions_more", _MORE + (("nopkg_missing", "nopkg-missing==1.0"),))
    with pytest.raises(PromptsError, match=r"`nopkg_missing` is not installed: pip install nopkg-missing==1\.0"):
        prompts.load_source("python_functions_more", cache=cache)


def test_python_functions_more_in_a_config_and_the_training_pool(tmp_path, monkeypatch, cache):
    from specforge_opd.config import load_config
    from specforge_opd.stages.preflight import check_prompt_sources

    new = ["python_functions_more", "math_problems_v2"]
    cfg = load_config(None, overrides=[f"data.train_sources=[python_functions, math_problems, {', '.join(new)}]"])
    check_prompt_sources(cfg)  # known sources
    assert all(n in prompts.KNOWN_SOURCES and n not in prompts.OFFLINE_SOURCES for n in new)

    # a copy of fakepkg's one_liner in the other package, and a function equal to a HumanEval prompt
    he = prompts.eval_prompts("humaneval", limit=1, cache=cache)[0]
    copy = 'def one_liner(x): """A one-line function whose docstring shares the def line."""; return x\n'
    site = tmp_path / "site"
    _fake_package(site)
    _other_package(site, extra=he.meta["code_prompt"] + "    pass\n\n\n" + copy)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(prompts._TREE_SOURCES, "python_functions_more", _MORE)
    monkeypatch.setattr(prompts, "_POOL_MEMO", {})
    data = DataConfig(train_sources=["python_functions_more"], exclude_eval=["humaneval"], num_prompts=None)
    pool, stats = prompts.training_pool_with_stats(data, cache=tmp_path / "c")
    assert stats.loaded == {"python_functions_more": 8}
    assert (stats.eval_overlap, stats.duplicates, stats.kept) == (1, 1, 6)


def test_python_functions_more_from_the_installed_packages(cache):
    import hashlib
    from collections import Counter

    recs = prompts.load_source("python_functions_more", cache=cache)
    pins = dict(prompts.MORE_PYTHON_TREES)
    per_package = Counter(r.meta["package"] for r in recs)
    assert set(per_package) == set(pins) and min(per_package.values()) >= 100, per_package
    assert len({r.id for r in recs}) == len(recs)
    assert all(pins[r.meta["package"]].endswith("==" + r.meta["version"]) for r in recs)
    assert not any("/tests/" in r.meta["path"] for r in recs)
    assert all(_code(r).lstrip().startswith(("def ", "async def ")) for r in recs)
    # pinned trees give the same records everywhere
    assert len(recs) == 2385
    digest = hashlib.sha1("".join(r.to_json() + "\n" for r in recs).encode()).hexdigest()
    assert digest == "c47142b5ce71e0b8f949014e84460b77e483ab22"
