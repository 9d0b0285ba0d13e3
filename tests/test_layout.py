"""The package layout of README.md, layout, checked statically (ast, nothing is imported): no import
cycles among our modules, imports only in the allowed directions, short functions.

Every import statement counts, wherever it is (module level, inside a function, under
TYPE_CHECKING): a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "scheduler", "worker", "kv_transfer", "server", "benchmarks")

# The modules of engine/ that the lower layers may use: plain data and configuration, which
# import nothing of ours but each other.
ENGINE_LEAVES = ("engine.types", "engine.config", "engine.request", "engine.sockets", "engine.settings",
                 "engine.cluster_key")
LEAF_IMPORTS = {"engine.types": set(), "engine.config": {"engine.settings", "engine.types"},
                "engine.request": {"engine.types"}, "engine.sockets": set(), "engine.settings": set(),
                "engine.cluster_key": {"engine.settings"}}

# What each package may import of ours (a name allows that module and everything under it).
MAY_IMPORT = {
    "engine": ("engine", "scheduler", "worker", "kv_transfer"),                # never server/ (HTTP) or benchmarks/
    "scheduler": ("scheduler", *ENGINE_LEAVES, "kv_transfer.connector"),       # the connector is typing only
    "worker": ("worker", "engine.types", "engine.config", "engine.settings", "scheduler.output"),  # the step contract
    "kv_transfer": ("kv_transfer", *ENGINE_LEAVES),
    "server": ("server", "engine"),
}


# Folders whose functions must stay short; add a folder here to hold it to the same limit.
SHORT_FUNCTION_FOLDERS = ("engine", "scheduler", "kv_transfer", "server", "worker")
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Our modules that `path` imports (`from pkg import sub` counts as importing pkg.sub)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    known = set(modules)
    return {name: imports_of(path, known) - {name} for name, path in modules.items()}


def allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_imports_go_in_the_allowed_directions():
    bad = [f"{mod} imports {dep}" for mod, deps in import_graph().items() if mod.split(".")[0] in MAY_IMPORT
           for dep in sorted(deps) if not allowed(dep, MAY_IMPORT[mod.split(".")[0]])]
    assert not bad, "imports against README.md, layout:\n" + "\n".join(bad)


def test_engine_leaf_modules_import_nothing_else_of_ours():
    graph = import_graph()
    bad = {leaf: graph[leaf] - ok for leaf, ok in LEAF_IMPORTS.items() if graph[leaf] - ok}
    assert not bad, f"leaf modules importing more of ours: {bad}"


def test_tests_do_not_import_benchmarks_for_helpers():
    """Only the benchmarks' own tests (test_bench*.py) import benchmarks/, to test them."""
    known = set(our_modules())
    bad = [
        f"{p.name} imports {dep}"
        for p in sorted((REPO / "tests").glob("*.py"))
        if not p.name.startswith("test_bench")
        for dep in sorted(imports_of(p, known))
        if dep.split(".")[0] == "benchmarks"
    ]
    assert not bad, "\n".join(bad)


def test_functions_are_short():
    long = []
    for folder in SHORT_FUNCTION_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


PRODUCT = ("engine", "scheduler", "worker", "kv_transfer", "server")
ENTRY_POINTS = {"server.cli"}  # pyproject's `pdserve` script


def test_no_product_module_is_there_only_for_the_tests():
    """Every product module is imported by another product module or a benchmark (or is an entry
    point): what only tests use lives in tests/."""
    graph = import_graph()
    used = {dep for name, deps in graph.items() for dep in deps if name.split(".")[0] in PACKAGES}
    # `from pkg import sub` of a package's own __init__ counts for the package too
    used |= {dep.rsplit(".", 1)[0] for dep in used}
    unused = [name for name in graph if name.split(".")[0] in PRODUCT and name not in used
              and name not in ENTRY_POINTS and name not in PRODUCT]
    assert not unused, f"product modules nothing of the product imports: {unused}"


SETTINGS_MODULE = "engine/settings.py"
PDSERVE_NAME = re.compile(r"^PDSERVE_[A-Z0-9_]*$")


def test_only_the_settings_module_names_pdserve_variables():
    """Every PDSERVE_* variable is declared once, in engine/settings.py; other product modules read
    it through that module (a string constant naming one, or a prefix to build one, anywhere else
    means a second, undeclared reader)."""
    bad = []
    for pkg in PRODUCT:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path.relative_to(REPO).as_posix() == SETTINGS_MODULE:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and PDSERVE_NAME.match(node.value):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not bad, "PDSERVE_* names outside engine/settings.py:\n" + "\n".join(bad)


# A measured figure in a comment or docstring: a number followed by a time (ms, us, µs), a ratio
# (%, x) or a rate (GB/s, MB/s, tok/s). Such numbers belong in benchmarks/results/; a comment says
# why the code is as it is and points there. Design constants ("a 256-row chunk") carry no unit and pass.
MEASUREMENT = re.compile(r"(?<![\w.])\d+(\.\d+)?\s?(ms|us|µs|%|x|GB/s|MB/s|tok/s)(?![\w/])")


def python_comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every `#` comment and every docstring line (module, class, function)."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                yield from ((first + i, line) for i, line in enumerate(doc.splitlines()))


def cpp_comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every `//` comment of a C++ source."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if "//" in line:
            yield number, line[line.index("//"):]


def comments_of(path: Path) -> Iterator[tuple[int, str]]:
    if path.suffix == ".py":
        return python_comments(path)
    if path.suffix in (".cpp", ".h"):
        return cpp_comments(path)
    return iter(())


def test_measurement_pattern_tells_measurements_from_constants():
    for measured in ("~0.3 ms a layer", "1.8-3.1x faster", "costs 54%", "25 us a row", "10-25 GB/s",
                     "2 µs", "1500 tok/s"):
        assert MEASUREMENT.search(measured), measured
    for constant in ("a 256-row chunk", "MAX_FUNCTION_LINES = 60", "PDSERVE_X=1", "0x1F", "v1.2 ops",
                     "see https://example.org/2x/"):
        assert not MEASUREMENT.search(constant), constant


def test_product_comments_carry_no_measurements():
    found = [f"{path.relative_to(REPO)}:{number}: {text.strip()}"
             for pkg in PRODUCT for path in sorted((REPO / pkg).rglob("*"))
             for number, text in comments_of(path) if MEASUREMENT.search(text)]
    assert not found, ("comments or docstrings with a measured time or ratio (say why, and point to "
                       "benchmarks/results/ for the numbers):\n" + "\n".join(found))


# Choosing a token happens in worker/sample/ alone (issue 47): a call below, anywhere else in the
# product, is a second place that samples. worker/fused_ops.py defines the kernels (and their torch
# references) that the sampling package calls.
SAMPLING_PACKAGE = "worker/sample/"
SAMPLING_KERNELS = "worker/fused_ops.py"
SAMPLING_METHODS = {"argmax", "multinomial", "rejection_verify", "sample_from_probs", "uniform_", "exponential_",
                    "default_generator"}


def sampling_calls(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) of every call in `tree` that picks a token or draws noise for one: an argmax, a
    draw, the rejection kernel, a call given a generator, a Sampler constructed."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in SAMPLING_METHODS:
            yield node.lineno, f".{func.attr}("
        elif isinstance(func, ast.Name) and func.id in ("Sampler", "argmax", "multinomial"):
            yield node.lineno, f"{func.id}("
        elif any(kw.arg == "generator" for kw in node.keywords):
            yield node.lineno, "a call with generator="


def test_sampling_calls_are_recognised():
    source = ("x.argmax(-1)\nfused_ops.argmax(l)\nfused_ops.rejection_verify(a)\ntorch.multinomial(p, 1)\n"
              "torch.rand(3, generator=g)\nSampler(seed=1)\nq.uniform_(generator=g)\ns.sample_from_probs(p, m)\n")
    assert len(list(sampling_calls(ast.parse(source)))) == len(source.splitlines())
    assert not list(sampling_calls(ast.parse("x.max(-1)\ntorch.softmax(l, -1)\nmodel.compute_logits(h)\n")))


def test_only_the_sampling_package_samples_tokens():
    """No product module outside worker/sample/ picks a token: the verifier owns every way a target
    token is chosen, and the drafters pick theirs through worker/sample/draft.py."""
    bad = []
    for pkg in PRODUCT:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(SAMPLING_PACKAGE) or rel == SAMPLING_KERNELS:
                continue
            bad += [f"{rel}:{line} {what}" for line, what in sampling_calls(ast.parse(path.read_text(), rel))]
    assert not bad, "token sampling outside worker/sample/:\n" + "\n".join(bad)
