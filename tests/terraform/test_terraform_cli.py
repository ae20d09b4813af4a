"""terraform fmt, validate and test (mock AWS provider) over terraform/, offline."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.terraform.conftest import CONFIG_DIRS, TERRAFORM_DIR, run_tf


def test_fmt_is_clean(terraform_binary: str) -> None:
    # fmt needs no providers, so it runs even where the mirror is missing.
    env = dict(os.environ, TF_TERRAFORM_BINARY=terraform_binary, CHECKPOINT_DISABLE="1")
    p = run_tf(env, TERRAFORM_DIR, "fmt", "-check", "-recursive", "-diff", "-no-color")
    assert p.returncode == 0, f"terraform fmt -check failed; run `terraform fmt -recursive terraform`:\n{p.stdout}{p.stderr}"


def test_versions_pin_the_mirrored_provider(terraform_env, tf_workdir) -> None:
    # init succeeding offline proves the constraint admits a mirrored version;
    # the lock file it wrote names the one it chose.
    lock = (tf_workdir / ".terraform.lock.hcl").read_text()
    assert re.search(r'provider "registry.terraform.io/hashicorp/aws"', lock), lock


@pytest.mark.parametrize("config_dir", CONFIG_DIRS)
def test_validate(terraform_env: dict[str, str], tf_workdir, config_dir: str) -> None:
    p = run_tf(terraform_env, tf_workdir / config_dir, "validate", "-json", "-no-color")
    report = json.loads(p.stdout)
    problems = [f"{d['severity']}: {d['summary']}: {d.get('detail', '')}" for d in report["diagnostics"]]
    assert p.returncode == 0 and report["valid"], f"terraform validate failed in {config_dir}:\n" + "\n".join(problems)
    # Deprecations are errors-in-waiting: the provider will drop them.
    assert not [x for x in problems if "deprecat" in x.lower()], "\n".join(problems)


def test_terraform_test_suites_pass(terraform_env: dict[str, str], tf_workdir) -> None:
    suites = sorted(p.name for p in (TERRAFORM_DIR / "tests").glob("*.tftest.hcl"))
    assert suites, "terraform/tests holds no *.tftest.hcl"
    p = run_tf(terraform_env, tf_workdir, "test", "-no-color", timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"terraform test failed:\n{out}"
    summary = re.search(r"Success! (\d+) passed, 0 failed\.", out)
    assert summary, out
    # Every suite file ran, and every run block in it passed.
    for suite in suites:
        assert f"tests/{suite}... pass" in out, f"{suite} did not pass:\n{out}"
    expected_runs = sum(
        len(re.findall(r'^run "', (TERRAFORM_DIR / "tests" / s).read_text(), re.M)) for s in suites
    )
    assert int(summary.group(1)) == expected_runs, out
