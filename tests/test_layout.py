"""Package layout rules, checked on the source: the SFT stage's module is imported by the stage alone, and
no two modules import each other at module level."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "specforge_opd"
#: The SFT stage: the modules allowed to import ``specforge_opd.stages.sft``.
SFT_STAGE = {"stages.sft", "stages.sft_features", "stages.sft_train"}
#: The stage's entry point, which the main job's comparison and the fair baselines run for continued SFT, and
#: the ``sft`` verb (which also prints the dry-run plan): the names they may import from ``stages.sft``, or reach
#: through it when they import the module itself.
SFT_ENTRY = {"stages.compare": {"run_sft"}, "stages.baselines": {"run_sft"}, "cli": {"run_sft", "dry_run"}}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path, top_level_only: bool):
    """(module imported, names taken from it) for every import statement of ``path``, relative ones resolved.

    A package's submodule named in ``from specforge_opd.pkg import sub`` is an import of ``specforge_opd.pkg.sub``
    with no names (the module itself is taken); the other names of that statement stay with the package.
    """
    pkg = ["specforge_opd"] + list(path.relative_to(PKG).parent.parts)
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, set()
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:
                for a in node.names:
                    yield f"{mod}.{a.name}", set()
            else:
                names = {a.name for a in node.names}
                subs = {n for n in names if mod.split(".")[0] == "specforge_opd" and _is_module(f"{mod}.{n}")}
                for s in sorted(subs):
                    yield f"{mod}.{s}", set()
                if names - subs:
                    yield mod, names - subs


def _reached_through(path: Path, module: str) -> set[str]:
    """The names ``path`` reaches as ``alias.name`` where ``alias`` is bound to ``module`` by an import."""
    tree = ast.parse(path.read_text())
    aliases = {k for k, v in _module_bindings(tree).items() if v == module}
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases}


def test_nothing_outside_the_sft_stage_imports_sft():
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        me = _module(f)
        if me in SFT_STAGE:
            continue
        for mod, names in _imports(f, top_level_only=False):
            if mod != "specforge_opd.stages.sft":
                continue
            # the module itself imported: what the importer reaches through it counts
            used = names or _reached_through(f, mod)
            if not (used and used <= SFT_ENTRY.get(me, set())):
                offenders.append(f"{me}: {mod} {sorted(used)}")
    assert not offenders, offenders


def test_the_adapter_is_the_one_module_that_imports_specforge():
    importers = sorted({_module(f) for f in PKG.rglob("*.py") for mod, _ in _imports(f, top_level_only=False)
                        if mod == "specforge" or mod.startswith("specforge.")})
    assert importers == ["models.adapter"], importers


def test_no_module_level_import_cycles():
    graph = {}
    for f in PKG.rglob("*.py"):
        graph[f"specforge_opd.{_module(f)}".rstrip(".")] = {m for m, _ in _imports(f, top_level_only=True)
                                                            if m.startswith("specforge_opd")}
    assert "specforge_opd.data.prompts" not in graph["specforge_opd.data.assets"]
    assert "specforge_opd.data.assets" not in graph["specforge_opd.data.prompts"]
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path + [d])
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_benchmarks_and_scripts_import_names_that_exist():
    """The benchmarks and scripts import inside their ``main`` (no test runs them), so a moved or renamed
    name would only fail on the next benchmark run: every ``from specforge_opd... import`` they hold resolves."""
    import importlib
    import re

    root = PKG.parent
    missing = []

    def check(where, module, names):
        mod = importlib.import_module(module)
        for n in names:
            if not hasattr(mod, n):
                try:
                    importlib.import_module(f"{module}.{n}")
                except ImportError:
                    missing.append(f"{where}: {module}.{n}")

    for f in sorted((root / "benchmarks").glob("*.py")) + sorted((root / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specforge_opd"):
                check(f.name, node.module, [a.name for a in node.names])
    # the shell scripts' inline Python
    for f in sorted((root / "scripts").glob("*.sh")):
        for m in re.finditer(r"^\s*from (specforge_opd[\w.]*) import ([\w, ]+)$", f.read_text(), flags=re.M):
            check(f.name, m.group(1), [x.strip().split(" as ")[0] for x in m.group(2).split(",") if x.strip()])
    assert not missing, missing


def _module_bindings(tree: ast.AST) -> dict[str, str]:
    """Names bound to a ``specforge_opd`` module anywhere in ``tree`` -> that module's dotted name."""
    import importlib.util

    def is_module(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("specforge_opd"):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "specforge_opd"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specforge_opd") and not node.level:
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def test_attributes_reached_through_a_module_exist():
    """``sft.feature_path`` after ``from specforge_opd.stages import sft`` is not an import, so the check above
    missed it when the name moved (bench_sft.py failed with AttributeError at once): every ``module.name`` that the
    benchmarks, scripts, tests and the package reach through a specforge_opd module resolves."""
    import importlib

    root = PKG.parent
    missing = []
    files = [*sorted((root / "benchmarks").glob("*.py")), *sorted((root / "scripts").glob("*.py")),
             *sorted((root / "tests").glob("*.py")), *sorted(PKG.rglob("*.py"))]
    for f in files:
        tree = ast.parse(f.read_text())
        # a name also bound to something else in the file (a variable, an argument) is not followed: the
        # check reads the file, not its scopes
        other = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        other |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
        bound = {k: v for k, v in _module_bindings(tree).items() if k not in other}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound):
                continue
            if isinstance(node.ctx, ast.Store):
                continue
            modname = bound[node.value.id]
            mod = importlib.import_module(modname)
            if hasattr(mod, node.attr):
                continue
            try:
                importlib.import_module(f"{modname}.{node.attr}")
            except ImportError:
                missing.append(f"{f.relative_to(root)}:{node.lineno}: {modname}.{node.attr}")
    assert not missing, missing


def test_the_published_registry_imports_only_the_stdlib():
    """``config`` imports ``models.published`` at module level (a config path may be ``published:NAME``), the
    one import of the ground layer upward: the registry imports nothing else, so config stays the ground layer
    and torch-free. Publishing and its check live in ``stages.publish``."""
    import sys

    f = PKG / "models" / "published.py"
    mods = {m for m, _ in _imports(f, top_level_only=False)}
    assert mods and all(m.split(".")[0] in sys.stdlib_module_names for m in mods), sorted(mods)


# --- layers: every internal import, function-level ones included -------------------------------------------

#: A ratchet toward the layers the README's design section describes: each refactoring step lowers these
#: numbers (never raises them), and the goals are at most 10% function-level imports, no cycle, no module over
#: 600 lines and no function over 120.
#: ``cli``'s own imports are not counted: its verb functions import the modules they run inside the function, so
#: ``--help`` and ``config`` stay torch-free (``test_help_and_config_do_not_load_torch``).
FUNCTION_LEVEL_CAP = 6
#: Today's import cycles when function-level imports count; a cycle may shrink or go, never grow or appear.
KNOWN_CYCLES: list[set[str]] = []
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
#: module -> its line count today: it may shrink, not grow
OVERSIZE_MODULES: dict[str, int] = {}
#: (module, function) -> its line count today (docstring and nested definitions included)
LONG_FUNCTIONS: dict[tuple[str, str], int] = {}


def _is_module(dotted: str) -> bool:
    """Whether ``specforge_opd.a.b`` names a module or package of this source tree (read from disk, not imported)."""
    p = PKG.joinpath(*dotted.split(".")[1:])
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _internal_edges() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, inside a function, line) for every import of a ``specforge_opd`` module.

    One import statement counts once per module it names: ``from specforge_opd.stages import sft, plan`` is two
    imports (of ``stages.sft`` and ``stages.plan``), ``from specforge_opd.x import a, b`` one (of ``x``).
    Module names drop the ``specforge_opd.`` prefix.
    """
    edges = []
    for f in sorted(PKG.rglob("*.py")):
        me = _module(f)
        pkg = ["specforge_opd"] + list(f.relative_to(PKG).parent.parts)

        def walk(node, in_function):
            for ch in ast.iter_child_nodes(node):
                if isinstance(ch, ast.Import):
                    mods = [a.name for a in ch.names if a.name.split(".")[0] == "specforge_opd"]
                elif isinstance(ch, ast.ImportFrom):
                    base = pkg[: len(pkg) - ch.level + 1] if ch.level else []
                    mod = ".".join(base + ([ch.module] if ch.module else []))
                    mods = []
                    if mod.split(".")[0] == "specforge_opd":
                        subs = [f"{mod}.{a.name}" for a in ch.names if _is_module(f"{mod}.{a.name}")]
                        mods = subs + ([mod] if len(subs) < len(ch.names) else [])
                else:
                    walk(ch, in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)))
                    continue
                edges.extend((me, m.removeprefix("specforge_opd").lstrip("."), in_function, ch.lineno) for m in mods)

        walk(ast.parse(f.read_text()), False)
    return edges


def _cycles(edges) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_function_level_imports_only_go_down():
    edges = [e for e in _internal_edges() if e[0] != "cli"]  # the verbs' lazy imports: see FUNCTION_LEVEL_CAP
    inside = [f"{a} -> {b} (line {n})" for a, b, fn, n in edges if fn]
    assert len(inside) <= FUNCTION_LEVEL_CAP, (
        f"{len(inside)} of {len(edges)} internal imports sit inside functions, over the cap of {FUNCTION_LEVEL_CAP}: "
        "import at module level (the layer order allows it) or move the function to the layer it belongs to")
    # the goal itself, whatever the cap: at most one internal import in ten inside a function
    assert len(inside) * 10 <= len(edges), f"{len(inside)} of {len(edges)} internal imports sit inside functions (over 10%)"


def test_no_new_import_cycle_with_function_level_imports():
    grown = [sorted(c) for c in _cycles(_internal_edges()) if not any(c <= k for k in KNOWN_CYCLES)]
    assert not grown, f"import cycles beyond the known ones: {grown}"


def test_only_the_verbs_import_cli_and_preflight():
    """The verbs (flags, config, the checks before the target loads) live in ``cli``, the top layer, and call the
    library's plain functions: no other module of the package imports ``cli``, and ``stages.preflight`` is imported
    by the verbs alone, not by a library module for a verb's sake."""
    edges = _internal_edges()
    to_cli = [f"{a} -> {b} (line {n})" for a, b, _, n in edges if b == "cli" and a != "cli"]
    assert not to_cli, to_cli
    to_preflight = [f"{a} -> {b} (line {n})" for a, b, _, n in edges if b == "stages.preflight" and a != "cli"]
    assert not to_preflight, to_preflight


def test_nothing_outside_testing_imports_it():
    """``specforge_opd.testing`` (the SGLang stand-in server) is for tests alone: no other module of the package
    imports it, at module level or inside a function."""
    offenders = [f"{a} -> {b} (line {n})" for a, b, _, n in _internal_edges()
                 if (b == "testing" or b.startswith("testing.")) and not (a == "testing" or a.startswith("testing."))]
    assert not offenders, offenders


def test_module_and_function_sizes():
    over = []
    for f in sorted(PKG.rglob("*.py")):
        me = _module(f)
        text = f.read_text()
        n = len(text.splitlines())
        if n > OVERSIZE_MODULES.get(me, MAX_MODULE_LINES):
            over.append(f"{me}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTIONS.get((me, node.name), MAX_FUNCTION_LINES):
                    over.append(f"{me}.{node.name}: {length} lines")
    assert not over, over


def test_help_and_config_do_not_load_torch(tmp_path):
    """``specforge-opd --help`` and ``config`` answer without importing torch (seconds, not the torch import)."""
    import subprocess
    import sys

    (tmp_path / "c.yaml").write_text("name: t\n")
    code = ("import sys\nfrom specforge_opd.cli import main\nmain(['--help'])\n"
            f"main(['config', '-c', {str(tmp_path / 'c.yaml')!r}])\n"
            "bad = sorted(m for m in ('torch', 'transformers', 'specforge') if m in sys.modules)\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr[-2000:]


#: The layers, lowest first. A module may import its own layer or a lower one; sglang, train and eval are peers
#: that do not import each other except through LAYER_EXCEPTIONS. ``testing`` (the stand-in server) may import
#: anything and nothing imports it. The README's design section shows the same order.
LAYERS = [
    ("core", ("errors", "atomic", "progress", "config", "stepkeys", "teacher_form")),
    ("data", ("data",)),
    ("models", ("models", "precision", "run_fingerprint")),
    ("rollout", ("rollout",)),
    ("peers", ("sglang", "train", "eval")),
    ("stages", ("stages",)),
    ("cli", ("cli",)),
    ("testing", ("testing",)),
]
#: (importer, imported) edges allowed against the order, each with its reason
LAYER_EXCEPTIONS = {
    # a config path may be published:NAME; the registry imports only the stdlib (test_the_published_registry...)
    ("config", "models.published"),
    # the OPD replay ledger: eval.flops is a leaf (no internal imports) that counts FLOPs for every stage
    ("train.trainer", "eval.flops"),
}
#: Edges against the order that the remaining refactoring steps remove: this list only shrinks.
LAYER_DEBT: set[tuple[str, str]] = set()


def _layer(module: str) -> tuple[int, str]:
    """(rank, name) of a module's layer, from LAYERS; the name tells the peers apart."""
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                return rank, module.split(".")[0]
    raise AssertionError(f"{module}: in no layer of LAYERS; add it where it belongs")


def test_imports_follow_the_layer_order():
    against = set()
    for a, b, _, line in _internal_edges():
        if not b:  # the package itself
            continue
        (ra, na), (rb, nb) = _layer(a), _layer(b)
        if rb > ra or (ra == rb and LAYERS[ra][0] == "peers" and na != nb):
            against.add((a, b))
    unexplained = sorted(against - LAYER_EXCEPTIONS - LAYER_DEBT)
    assert not unexplained, f"imports against the layer order (README, design section): {unexplained}"
    paid = sorted(LAYER_DEBT - against)
    assert not paid, f"these edges are gone: remove them from LAYER_DEBT: {paid}"
