"""Shared fixtures for the Terraform tests: where the code, the binary and the
offline provider mirror are, and a scratch copy of terraform/ to run in.

Terraform runs in a temporary copy so that `terraform init` never writes
.terraform/ or lock files into the checkout, and two runs cannot collide.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = REPO_ROOT / "terraform"
MIRROR_NAME = "tf-plugins"
# Each directory `terraform validate` must accept: the root module and every example.
CONFIG_DIRS = ["."] + sorted(
    f"examples/{p.name}" for p in (TERRAFORM_DIR / "examples").iterdir() if p.is_dir()
)


def find_terraform() -> str | None:
    """Returns the terraform binary on PATH (or /usr/local/bin), or None."""
    return shutil.which("terraform") or (
        "/usr/local/bin/terraform" if os.access("/usr/local/bin/terraform", os.X_OK) else None
    )


def find_mirror() -> Path | None:
    """Returns the offline provider mirror: $TF_PLUGIN_MIRROR, else a folder named
    tf-plugins at most two levels below / (e.g. /opt/tf-plugins) that holds the
    hashicorp/aws provider."""
    candidates: list[Path] = []
    if os.environ.get("TF_PLUGIN_MIRROR"):
        candidates.append(Path(os.environ["TF_PLUGIN_MIRROR"]))
    candidates.append(Path("/") / MIRROR_NAME)
    try:
        top = sorted(p for p in Path("/").iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        top = []
    candidates.extend(p / MIRROR_NAME for p in top if p.name not in ("proc", "sys", "dev"))
    for c in candidates:
        if (c / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return c
    return None


def copy_terraform_tree(dst: Path) -> Path:
    """Copies terraform/ to dst without local state, caches or lock files."""
    shutil.copytree(
        TERRAFORM_DIR,
        dst,
        ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "*.tfstate*"),
    )
    return dst


@pytest.fixture(scope="session")
def terraform_binary() -> str:
    """Path of the terraform binary; skips (loudly) when there is none."""
    binary = find_terraform()
    if binary is None:
        pytest.skip(
            "TERRAFORM TESTS NOT RUN: no `terraform` binary on PATH or in /usr/local/bin. "
            "fmt/init/validate/test were skipped; install Terraform >= 1.9 to run them."
        )
    return binary


@pytest.fixture(scope="session")
def terraform_env(terraform_binary: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for terraform: CLI config pointing at the offline mirror.

    Skips (loudly) only when the terraform binary or the mirror is missing.
    """
    binary = terraform_binary
    mirror = find_mirror()
    if mirror is None:
        pytest.skip(
            f"TERRAFORM TESTS NOT RUN: no offline provider mirror ('{MIRROR_NAME}' folder with "
            "registry.terraform.io/hashicorp/aws) found under / (max depth 2) or in "
            "$TF_PLUGIN_MIRROR. init/validate/test were skipped."
        )
    cfg_dir = tmp_path_factory.mktemp("tfcli")
    cfg = cfg_dir / "terraformrc"
    cfg.write_text(
        "provider_installation {\n"
        f'  filesystem_mirror {{\n    path    = "{mirror}"\n'
        '    include = ["registry.terraform.io/*/*"]\n  }\n'
        '  direct {\n    exclude = ["registry.terraform.io/*/*"]\n  }\n'
        "}\n"
    )
    env = dict(os.environ)
    env.update(
        TF_CLI_CONFIG_FILE=str(cfg),
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        CHECKPOINT_DISABLE="1",  # no version check over the network
        TF_TERRAFORM_BINARY=binary,
    )
    env.pop("TF_PLUGIN_CACHE_DIR", None)
    return env


def run_tf(env: dict[str, str], cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs terraform with args in cwd and returns the finished process."""
    return subprocess.run(
        [env["TF_TERRAFORM_BINARY"], *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def tf_workdir(terraform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch copy of terraform/ with the root module and every example initialised."""
    work = copy_terraform_tree(tmp_path_factory.mktemp("tf") / "terraform")
    for d in CONFIG_DIRS:
        p = run_tf(terraform_env, work / d, "init", "-backend=false", "-input=false", "-no-color")
        assert p.returncode == 0, f"terraform init failed in {d}:\n{p.stdout}\n{p.stderr}"
    return work
