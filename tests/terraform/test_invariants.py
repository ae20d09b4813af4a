"""The project's own rules for terraform/, checked by parsing the HCL (python-hcl2).

Every variable has a description and a type; every output a description; every
taggable resource carries the caller's tags; every module call passes them on;
the README documents every root input and output. Needs no terraform binary.

Two parsers answer to `import hcl2`: python-hcl2 (>= 5 keeps quotes around
labels and strings) and checkov's bc-python-hcl2 (wraps attribute values in
one-element lists). `_v` and `_label` read both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.terraform.conftest import TERRAFORM_DIR, run_tf

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 is a dev dependency: pip install -e '.[dev]'")

# Resource types used here that the AWS provider gives no `tags` argument.
# test_taggable_list_matches_provider_schema keeps this honest when terraform runs.
NOT_TAGGABLE = {
    "aws_iam_role_policy",
    "aws_iam_role_policy_attachment",
    "aws_ecr_lifecycle_policy",
    "aws_kms_alias",
    "aws_lb_target_group_attachment",
    "aws_s3_bucket_lifecycle_configuration",
    "aws_s3_bucket_logging",
    "aws_s3_bucket_ownership_controls",
    "aws_s3_bucket_policy",
    "aws_s3_bucket_public_access_block",
    "aws_s3_bucket_server_side_encryption_configuration",
    "aws_s3_bucket_versioning",
}
# Resource types tagged through repeated `tag { key value propagate_at_launch }` blocks.
TAG_BLOCK = {"aws_autoscaling_group"}
STANDARD_FILES = ("main.tf", "variables.tf", "outputs.tf", "versions.tf")


def _label(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s


def _v(body: dict[str, Any], key: str) -> Any:
    """Attribute value in either parser's dialect (None when absent)."""
    v = body.get(key)
    if isinstance(v, list) and len(v) == 1 and not isinstance(v[0], dict):
        v = v[0]
    if isinstance(v, str):
        v = _label(v)
    return v


def tf_files() -> list[Path]:
    return sorted(p for p in TERRAFORM_DIR.rglob("*.tf") if ".terraform" not in p.parts)


def parse(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return hcl2.load(f)


def blocks(kind: str, files: list[Path] | None = None) -> Iterator[tuple[Path, list[str], dict[str, Any]]]:
    """(file, labels, body) of each top-level block of a kind (variable, output, resource, module)."""
    for path in files or tf_files():
        for entry in parse(path).get(kind, []):
            for l1, body in entry.items():
                if kind == "resource":
                    for l2, inner in body.items():
                        yield path, [_label(l1), _label(l2)], inner
                else:
                    yield path, [_label(l1)], body


def _rel(p: Path) -> str:
    return str(p.relative_to(TERRAFORM_DIR))


def test_parser_sees_the_code() -> None:
    # Guards the other tests against passing vacuously on an empty parse.
    kinds = {"variable": 0, "output": 0, "resource": 0, "module": 0}
    for k in kinds:
        kinds[k] = sum(1 for _ in blocks(k))
    assert kinds["variable"] > 40 and kinds["output"] > 20 and kinds["resource"] > 30 and kinds["module"] >= 3, kinds


def test_variables_have_descriptions_and_types() -> None:
    bad = []
    for path, (name,), body in blocks("variable"):
        desc = _v(body, "description")
        if not isinstance(desc, str) or len(desc.strip()) < 10:
            bad.append(f"{_rel(path)}: variable {name} has no real description")
        if _v(body, "type") in (None, ""):
            bad.append(f"{_rel(path)}: variable {name} has no type")
    assert not bad, "\n".join(bad)


def test_outputs_have_descriptions() -> None:
    bad = [
        f"{_rel(path)}: output {name}"
        for path, (name,), body in blocks("output")
        if not isinstance(_v(body, "description"), str) or len(_v(body, "description").strip()) < 10
    ]
    assert not bad, "outputs without a description:\n" + "\n".join(bad)


def test_every_taggable_resource_is_tagged() -> None:
    bad = []
    for path, (rtype, name), body in blocks("resource"):
        if rtype in NOT_TAGGABLE:
            continue
        if rtype in TAG_BLOCK:
            dyn = [d for d in body.get("dynamic", []) for k in d if _label(k) == "tag"]
            ok = any("var.tags" in str(_v(d[k], "for_each")) for d in dyn for k in d) or "tag" in body
        else:
            ok = "var.tags" in str(_v(body, "tags"))
        if not ok:
            bad.append(f"{_rel(path)}: {rtype}.{name} does not carry var.tags")
    assert not bad, "\n".join(bad)


def test_every_module_call_passes_tags() -> None:
    bad = [
        f"{_rel(path)}: module {name}"
        for path, (name,), body in blocks("module")
        if _v(body, "tags") is None
    ]
    assert not bad, "module calls without tags:\n" + "\n".join(bad)


def test_module_layout() -> None:
    dirs = [TERRAFORM_DIR] + sorted(p for p in (TERRAFORM_DIR / "modules").iterdir() if p.is_dir())
    missing = [f"{_rel(d / f) if d != TERRAFORM_DIR else f}" for d in dirs for f in STANDARD_FILES if not (d / f).is_file()]
    assert not missing, f"missing standard files: {missing}"
    assert {p.name for p in (TERRAFORM_DIR / "modules").iterdir()} >= {"kv-bucket", "serving", "indexing"}
    assert {p.name for p in (TERRAFORM_DIR / "examples").iterdir()} >= {"single-g5", "spot-indexing"}
    assert list((TERRAFORM_DIR / "tests").glob("*.tftest.hcl")), "terraform/tests has no terraform test files"


def _readme_table(section: str) -> set[str]:
    readme = (TERRAFORM_DIR / "README.md").read_text()
    m = re.search(rf"^## {section}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert m, f"terraform/README.md has no '## {section}' section"
    return set(re.findall(r"^\|\s*`([a-z0-9_]+)`\s*\|", m.group(1), re.M))


def test_readme_documents_root_inputs_and_outputs() -> None:
    root = [TERRAFORM_DIR / "variables.tf", TERRAFORM_DIR / "outputs.tf"]
    variables = {name for _, (name,), _ in blocks("variable", root[:1])}
    outputs = {name for _, (name,), _ in blocks("output", root[1:])}
    assert _readme_table("Inputs") == variables, (
        f"README Inputs vs variables.tf: missing {sorted(variables - _readme_table('Inputs'))}, "
        f"stale {sorted(_readme_table('Inputs') - variables)}"
    )
    assert _readme_table("Outputs") == outputs, (
        f"README Outputs vs outputs.tf: missing {sorted(outputs - _readme_table('Outputs'))}, "
        f"stale {sorted(_readme_table('Outputs') - outputs)}"
    )


def test_taggable_list_matches_provider_schema(terraform_env, tf_workdir) -> None:
    # Runs only where terraform and the mirror are (the fixtures skip otherwise).
    p = run_tf(terraform_env, tf_workdir, "providers", "schema", "-json")
    assert p.returncode == 0, p.stderr
    schemas = json.loads(p.stdout)["provider_schemas"]["registry.terraform.io/hashicorp/aws"]["resource_schemas"]
    used = {rtype for _, (rtype, _), _ in blocks("resource")}
    wrong = []
    for rtype in sorted(used):
        has_tags = "tags" in schemas[rtype]["block"].get("attributes", {})
        if has_tags == (rtype in NOT_TAGGABLE | TAG_BLOCK):
            wrong.append(f"{rtype}: provider {'has' if has_tags else 'lacks'} `tags`")
    assert not wrong, "fix NOT_TAGGABLE / TAG_BLOCK:\n" + "\n".join(wrong)
