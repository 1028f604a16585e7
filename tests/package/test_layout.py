"""The package keeps the layout docs/design/architecture.md draws: its packages import one way
(the page's layer block, read here), no module imports itself back through others (imports inside
functions count), the page's package table names every module and nothing else, no module outside
the kernel files is over the page's line limit, every class over the class limit is one the page
names with its reason, and ``tests/`` mirrors the package. Static: the source is parsed, nothing is
imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from factories import REPO, TESTS

PACKAGE = REPO / "oscar_calib"
PAGE = (REPO / "docs" / "design" / "architecture.md").read_text()
MODULE_LINES, CLASS_LINES = 450, 80


def page_block(name: str) -> str:
    """The fenced block of the page that follows the HTML comment ``<!-- name -->``."""
    m = re.search(rf"<!-- {name} -->\s*```[a-z]*\n(.*?)```", PAGE, re.S)
    assert m, f"docs/design/architecture.md has no block marked <!-- {name} -->"
    return m.group(1)


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (a ``from X import y``
    counts as ``X.y`` where that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(name: str, layers: list[list[str]]) -> int | None:
    top = name.split(".")[1] if "." in name else None
    return next((i for i, names in enumerate(layers) if top in names), None)


def test_packages_import_only_the_layers_below_them():
    layers = [line.split() for line in page_block("layers").splitlines() if line.strip()][::-1]   # bottom first
    tops = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem not in ("__init__",
                                                                                                      "__main__"))}
    drawn = {n for names in layers for n in names}
    assert tops == drawn, (f"packages the page's layers miss: {sorted(tops - drawn)}; "
                           f"name no package: {sorted(drawn - tops)}")
    upward = []
    for src, targets in graph().items():
        a = layer_of(src, layers)
        for dst in targets:
            b = layer_of(dst, layers)
            if a is not None and b is not None and b >= a and src.split(".")[1] != dst.split(".")[1]:
                upward.append(f"{src} -> {dst}")
    assert not upward, f"imports that do not run downwards: {upward}"


def test_no_module_imports_itself_back():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                circles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    assert not circles, f"modules that import each other in a circle: {[' -> '.join(c) for c in circles]}"


def test_the_package_table_names_every_module():
    """Each row of the page's package table (``| `contract/` | `config` (...), ... |``, the top level
    as ``top level``) names, in backticks, every module and subpackage of its folder and nothing
    else (the top level: its modules); every folder of the package has a row."""
    rows = dict(re.findall(r"^\| (top level|`[\w/]+/`) \| (.*?) \|", PAGE, re.M))
    drawn = {("" if k == "top level" else k.strip("`")): set(re.findall(r"`([\w/]+)`", v)) for k, v in rows.items()}
    folders = {d for d in [PACKAGE, *PACKAGE.rglob("*")] if d.is_dir() and (d / "__init__.py").exists()}
    actual = {}
    for d in folders:
        rel = d.relative_to(PACKAGE).as_posix()
        names = {f.stem for f in d.glob("*.py") if f.stem != "__init__" or d == PACKAGE}
        subpackages = {f"{c.name}/" for c in d.iterdir() if c in folders and d != PACKAGE}
        actual["" if rel == "." else rel + "/"] = names | subpackages
    assert set(drawn) == set(actual), (f"folders without a row: {sorted(set(actual) - set(drawn))}; "
                                       f"rows for no folder: {sorted(set(drawn) - set(actual))}")
    wrong = {k: (sorted(actual[k] - drawn[k]), sorted(drawn[k] - actual[k])) for k in actual if actual[k] != drawn[k]}
    assert not wrong, f"rows that miss modules, or name what is not there (folder: (missed, extra)): {wrong}"


def test_modules_and_classes_keep_the_size_rule():
    long_modules, long_classes = [], {}
    for name, path in modules().items():
        text = path.read_text()
        if ".kernels." not in name and len(text.splitlines()) > MODULE_LINES:
            long_modules.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                long_classes[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long_modules, f"modules over {MODULE_LINES} lines outside the kernel files: {long_modules}"
    named = set(re.findall(r"^\| `([\w.]+)` \|", PAGE, re.M))
    unexplained = sorted(c for c in long_classes if c.removeprefix("oscar_calib.") not in named)
    assert not unexplained, (f"classes over {CLASS_LINES} lines the architecture page does not name with its reason: "
                             f"{[(c, long_classes[c]) for c in unexplained]}")
    stale = sorted(c for c in named if f"oscar_calib.{c}" not in long_classes and "." in c and c[0].islower())
    assert not stale, f"the page names classes that are no longer over {CLASS_LINES} lines: {stale}"


def test_tests_mirror_the_package():
    """Test files live in a folder named for the package's part they test (or scripts/, docs/,
    package/ for the package's top level); the root holds only conftest, factories and the worker
    processes the tests start."""
    assert not sorted(p.name for p in TESTS.glob("test_*.py"))
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and list(p.glob("test_*.py"))}
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - parts <= {"scripts", "docs", "package"}, sorted(folders - parts - {"scripts", "docs", "package"})
    assert {p.name for p in TESTS.iterdir() if p.suffix == ".py"} == {"conftest.py", "factories.py", "dist_worker.py",
                                                                       "fault_worker.py"}
