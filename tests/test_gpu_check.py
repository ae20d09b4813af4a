"""`make gpu-check`: the GPU path in one command. Without a GPU here, its recipe is parsed:
every ragkv command line in it parses with today's parser, it installs the gpu extra (faiss-gpu,
never beside faiss-cpu), checks every shipped model in bfloat16 on CUDA and runs the gpu tests."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ragkv.cli.main import build_parser
from tests.terraform.test_deploy_commands import ragkv_argvs

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe() -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed: cannot expand the gpu-check recipe (apt-get install make)")
    out = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _extras() -> dict[str, list[str]]:
    if sys.version_info < (3, 11):
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_every_ragkv_command_in_gpu_check_parses(recipe: list[str]) -> None:
    argvs = [a for line in recipe for a in ragkv_argvs(line)]
    assert len(argvs) >= 4, recipe
    for argv in argvs:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"make gpu-check runs `ragkv {' '.join(argv)}`, which does not parse")
        assert getattr(args, "device", "cuda") == "cuda", f"gpu-check runs {argv} off the GPU"


def test_gpu_check_gates_every_shipped_model_in_bfloat16_and_runs_the_gpu_tests(recipe: list[str]) -> None:
    from ragkv.engine.model_loading import SHIPPED

    checked = {a[1] for line in recipe for a in ragkv_argvs(line)
               if a[0] == "check-model" and a[a.index("--dtype") + 1] == "bfloat16"}
    assert checked == set(SHIPPED), f"check-model in bfloat16 on {checked}, shipped: {sorted(SHIPPED)}"
    assert any(re.search(r"-m pytest .*-m gpu\b", line) for line in recipe), recipe
    benches = [a for line in recipe for a in ragkv_argvs(line) if a[0] == "bench"]
    assert any("--concurrency" in a for a in benches) and any("--modes" in a for a in benches), benches


def test_gpu_check_installs_faiss_gpu_in_its_own_venv(recipe: list[str]) -> None:
    extras = _extras()
    names = {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0] for r in extras["gpu"]}
    assert "faiss-gpu" in names and "faiss-cpu" not in names, names  # both install `faiss`
    server = {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0] for r in extras["server"]}
    assert server - {"faiss-cpu"} <= names, f"the gpu extra lacks {server - {'faiss-cpu'} - names}"
    install = [line for line in recipe if "pip install -e" in line]
    assert install and "gpu" in re.search(r"\.\[([\w,]+)\]", install[0]).group(1).split(","), install
    assert not any(line.startswith(".venv/") for line in recipe), "gpu-check must not touch the CPU venv"
