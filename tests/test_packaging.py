"""The house: one import namespace in the wheel, and the import contract of shared/DESIGN.md.

Both run on the wheel itself (built here, unpacked into a folder): the repository's folders
(engine/, server/, ...) install as ragkv.*, which only a built tree shows as it is installed.
"""

from __future__ import annotations

import os
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
    bad.write_text("from ragkv.engine.kv import ChunkKV  # wrong way\n" + bad.read_text())
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(REPO / ".importlinter"), "--no-cache"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ragkv.kvstore.entry -> ragkv.engine.kv" in proc.stdout
