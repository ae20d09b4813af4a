"""The house: one import namespace in the wheel, the import contract of docs/architecture.md,
and no import circle between modules.

Both run on the wheel itself (built here, unpacked into a folder): the repository's folders
(engine/, server/, ...) install as ragkv.*, which only a built tree shows as it is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil

    out = tmp_path_factory.mktemp("wheel")
    # build from a copy of the checkout's files: a stale build/ folder here (setuptools keeps
    # one) could carry modules deleted from the source into the wheel
    src = out / "src"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    for rel in listed:
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(src), "-w", str(out)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("ragkv-*.whl")
    tree = out / "tree"
    with zipfile.ZipFile(whl) as z:
        z.extractall(tree)
    return tree


def test_the_wheel_installs_only_the_ragkv_namespace(wheel_tree: Path) -> None:
    top = {p.name for p in wheel_tree.iterdir()}
    assert top == {"ragkv", "ragkv-0.1.0.dist-info"}, f"site-packages would get {sorted(top)}"
    for name in ("engine", "kvstore", "indexer", "retriever", "server", "cli"):
        assert (wheel_tree / "ragkv" / name / "__init__.py").is_file(), f"ragkv.{name} missing from the wheel"
    assert (wheel_tree / "ragkv" / "kvstore" / "tiers" / "s3.py").is_file()


def test_the_import_contract_holds(wheel_tree: Path, tmp_path: Path) -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    # from a folder outside the checkout, so `ragkv` resolves to the unpacked wheel only
    proc = subprocess.run([str(lint), "--config", str(REPO / ".importlinter"), "--no-cache"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(wheel_tree)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_contract_catches_a_wrong_way_import(wheel_tree: Path, tmp_path: Path) -> None:
    """kvstore importing the engine breaks the layers contract (so the check above can fail)."""
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(wheel_tree, tree)
    bad = tree / "ragkv" / "kvstore" / "entry.py"
    bad.write_text("from ragkv.engine.kv.cache import ChunkKV  # wrong way\n" + bad.read_text())
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(REPO / ".importlinter"), "--no-cache"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ragkv.kvstore.entry -> ragkv.engine.kv.cache" in proc.stdout


def _import_cycles(tree: Path) -> list[list[str]]:
    """Circles of module imports in an installed `ragkv` tree: every import counts, at any
    level (inside functions, under TYPE_CHECKING); `from pkg import sub` counts the submodule."""
    import ast

    mods: dict[str, Path] = {}
    for f in (tree / "ragkv").rglob("*.py"):
        parts = [p for p in f.relative_to(tree).with_suffix("").parts if p != "__init__"]
        mods[".".join(parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                graph[m].update(subs or ([node.module] if node.module in mods else []))
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
        graph[m].discard(m)
    cycles, done = [], set()
    for start in sorted(graph):  # a path back to `start` through modules not yet done
        path, seen, stack = {start: None}, {start}, [start]
        while stack:
            v = stack.pop()
            for w in sorted(graph[v]):
                if w == start:
                    loop, u = [start], v
                    while u != start:
                        loop.insert(1, u)
                        u = path[u]
                    cycles.append(loop)
                    stack.clear()
                    break
                if w not in seen and w not in done:
                    seen.add(w)
                    path[w] = v
                    stack.append(w)
        done.add(start)
    return cycles


def test_no_module_imports_itself_back(wheel_tree: Path) -> None:
    """One way per pair: blend -> focus -> select once named blend back (a type under
    TYPE_CHECKING), indexer.corpus and indexer.documents each other (a lazy import)."""
    assert _import_cycles(wheel_tree) == []


def test_the_circle_check_catches_one(wheel_tree: Path, tmp_path: Path) -> None:
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(wheel_tree, tree)
    select = tree / "ragkv" / "engine" / "select.py"
    select.write_text(select.read_text() + "\n\ndef _back():\n    from ragkv.engine.blend import BlendOptions\n")
    cycles = _import_cycles(tree)
    assert any({"ragkv.engine.blend", "ragkv.engine.select"} <= set(c) for c in cycles), cycles


def test_the_project_docs_never_point_into_shared() -> None:
    """The docs and the files they name must exist in a checkout of the project alone: no
    path into the workplace's shared/ folder (its data is a test and eval input, not ours)."""
    root = Path(__file__).resolve().parents[1]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "terraform").rglob("*.md"))]
    assert len(docs) > 3
    found = [f"{d.relative_to(root)}:{n}" for d in docs for n, line in enumerate(d.read_text().splitlines(), 1)
             if re.search(r"(^|[\s`(/])shared/", line)]
    assert not found, f"docs point into shared/: {found}"
