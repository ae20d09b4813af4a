"""`checkov -d terraform` passes, and every check it skips is explained in the README."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.terraform.conftest import TERRAFORM_DIR

README = TERRAFORM_DIR / "README.md"
SKIP_COMMENT = re.compile(r"#\s*checkov:skip=([A-Z0-9_]+):(\S.*)")


def checkov_command() -> list[str]:
    """checkov from `$RAGKV_CHECKOV` (its own venv, as `make test` sets it), else this environment.

    checkov lives in a venv of its own because it pins boto3 exactly and its bc-python-hcl2
    installs a top-level `hcl2` package over python-hcl2's.
    """
    if os.environ.get("RAGKV_CHECKOV"):
        return [os.environ["RAGKV_CHECKOV"]]
    exe = Path(sys.executable).parent / ("checkov.cmd" if os.name == "nt" else "checkov")
    if exe.exists():
        return [str(exe)]
    if shutil.which("checkov"):
        return [shutil.which("checkov")]  # type: ignore[list-item]
    return [sys.executable, "-m", "checkov.main"]


def inline_skips() -> dict[str, list[str]]:
    """check id -> reasons given in `#checkov:skip=ID:reason` comments under terraform/."""
    found: dict[str, list[str]] = {}
    for tf in TERRAFORM_DIR.rglob("*.tf"):
        if ".terraform" in tf.parts:
            continue
        for m in SKIP_COMMENT.finditer(tf.read_text()):
            found.setdefault(m.group(1), []).append(m.group(2).strip())
    return found


def test_checkov_passes() -> None:
    cmd = checkov_command() + [
        "-d", str(TERRAFORM_DIR),
        "--framework", "terraform",
        "--skip-download",          # offline: no Prisma Cloud guidelines
        "--skip-path", r"\.terraform",
        "--output", "json",
    ]
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE", CHECKOV_RUN_SCA_PACKAGE_SCAN_V2="false")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except FileNotFoundError as e:  # pragma: no cover - environment problem
        raise AssertionError(f"checkov is not installed ({e}); it is a dev dependency: pip install -e '.[dev]'") from e
    if "No module named checkov" in p.stderr or "cannot import name 'START_LINE'" in p.stderr:
        raise AssertionError(
            "checkov cannot run in this environment: "
            + ("it is not installed (pip install -e '.[dev]')" if "No module" in p.stderr else
               "the `hcl2` module is python-hcl2's, not checkov's bc-python-hcl2 (both install a "
               "top-level `hcl2` package); reinstall bc-python-hcl2 or run checkov in its own venv")
            + f"\n{p.stderr[-2000:]}"
        )
    try:
        report = json.loads(p.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"checkov produced no JSON report (rc={p.returncode}):\n{p.stdout[-2000:]}\n"
                             f"{p.stderr[-3000:]}") from e
    reports = report if isinstance(report, list) else [report]
    failed = [
        f"{c['check_id']} {c['check_name']} -> {c['resource']} ({c['file_path']}:{c['file_line_range']})"
        for r in reports for c in r["results"]["failed_checks"]
    ]
    passed = sum(r["summary"]["passed"] for r in reports)
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert passed > 50, f"checkov ran suspiciously few checks ({passed}); did it parse terraform/?"
    assert p.returncode == 0, p.stderr[-2000:]

    # What checkov actually skipped must be exactly what the code says it skips.
    skipped = {c["check_id"] for r in reports for c in r["results"]["skipped_checks"]}
    assert skipped == set(inline_skips()), (
        f"checkov skipped {sorted(skipped)} but the inline skip comments name {sorted(inline_skips())}"
    )


def test_every_skipped_check_is_documented_with_its_reason() -> None:
    readme = README.read_text()
    section = readme.split("## Checkov", 1)
    assert len(section) == 2, "terraform/README.md needs a '## Checkov' section listing skipped checks"
    table = section[1]
    skips = inline_skips()
    assert skips, "expected at least one documented skip (the test would otherwise be vacuous)"
    for check_id, reasons in skips.items():
        assert all(len(r) > 20 for r in reasons), f"{check_id}: give a real reason in the skip comment"
        row = re.search(rf"^\|\s*`?{check_id}`?\s*\|[^|\n]+\|\s*\S[^|\n]{{20,}}\|", table, re.M)
        assert row, f"{check_id} is skipped in code but has no row (check | where | reason) in terraform/README.md"
    documented = set(re.findall(r"^\|\s*`?(CKV\d?_[A-Z0-9_]+)`?\s*\|", table, re.M))
    assert documented <= set(skips), f"README lists skips the code no longer makes: {sorted(documented - set(skips))}"
