"""Security rules of terraform/ and the Dockerfile, checked on the parsed HCL (python-hcl2).

Each test pins one finding of the security review so it cannot come back:

- no host reads SSM parameters account-wide (AmazonSSMManagedInstanceCore), and only the
  Ray head may write its cluster's token;
- IMDSv2 with hop limit 1 on every instance and launch template (a container never gets
  the instance role);
- credentials reach the hosts by path, from an SSM SecureString under its own rotating KMS
  key, never in user data; secret variables are sensitive;
- the load balancer's listeners are TLS (1.2+) unless plaintext is explicitly opted into;
- the hosts pull the image by digest, and the registry's lifecycle never expires it.

The plan-level behaviour of the same rules is asserted by terraform/tests/*.tftest.hcl.
Needs no terraform binary.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.terraform.conftest import REPO_ROOT, TERRAFORM_DIR
from tests.terraform.test_invariants import _v, blocks, parse, tf_files

SERVING = TERRAFORM_DIR / "modules" / "serving"
TEMPLATES = [SERVING / "templates" / "user_data.sh.tftpl", SERVING / "templates" / "ray_node.sh.tftpl"]


def _resources(rtype: str, files: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """'file:type.name' -> body of every resource of a type."""
    return {f"{p.relative_to(TERRAFORM_DIR)}:{t}.{name}": body for p, (t, name), body in blocks("resource", files)
            if t == rtype}


def _code(value: Any) -> Any:
    """A parsed body without python-hcl2's `__comments__` entries (code only)."""
    if isinstance(value, dict):
        return {k: _code(v) for k, v in value.items() if k != "__comments__"}
    if isinstance(value, list):
        return [_code(v) for v in value]
    return value


def _variable(path: Path, name: str) -> dict[str, Any]:
    for _, (n,), body in blocks("variable", [path]):
        if n == name:
            return body
    raise AssertionError(f"{path.relative_to(TERRAFORM_DIR)} has no variable {name}")


def _blocks_named(body: dict[str, Any], name: str) -> list[dict[str, Any]]:
    v = body.get(name, [])
    return v if isinstance(v, list) else [v]


def _locals(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for entry in parse(path).get("locals", []):
        out.update(entry)
    return out


# --- IAM ---

def test_no_role_gets_account_wide_ssm_parameter_reads() -> None:
    # AmazonSSMManagedInstanceCore grants ssm:GetParameter(s) on every parameter of the account.
    for path in tf_files():
        code = json.dumps(_code(parse(path).get("resource", [])) + _code(parse(path).get("locals", [])))
        assert "AmazonSSMManagedInstanceCore" not in code, (
            f"{path.relative_to(TERRAFORM_DIR)} attaches AmazonSSMManagedInstanceCore: use the scoped "
            "Session Manager policy")
    for key, body in _resources("aws_iam_role_policy_attachment").items():
        assert "iam::aws:policy" not in str(_v(body, "policy_arn")) or "ContainerServiceforEC2Role" in str(
            _v(body, "policy_arn")), f"{key}: an AWS managed policy beyond the ECS agent's"


def test_session_manager_policies_name_no_parameter_or_data_action() -> None:
    text = "\n".join(p.read_text() for p in (SERVING / "main.tf", TERRAFORM_DIR / "modules" / "indexing" / "main.tf"))
    for block in re.findall(r"Sid\s*=\s*\"SessionManager\w+\"(.*?)\}", text, re.S):
        actions = re.findall(r'"([a-z0-9]+:[A-Za-z*]+)"', block)
        assert actions, block
        assert all(a.split(":")[0] in ("ssm", "ssmmessages", "ec2messages") for a in actions), actions
        assert not [a for a in actions if a.startswith("ssm:") and a != "ssm:UpdateInstanceInformation"], actions


def test_only_the_ray_head_writes_the_ray_token_and_hosts_delete_nothing() -> None:
    text = (SERVING / "main.tf").read_text()
    puts = [m.start() for m in re.finditer(r'"ssm:PutParameter"', text)]
    assert len(puts) == 1, "exactly one statement may grant ssm:PutParameter"
    head = text.index('resource "aws_iam_role_policy" "ray_head"')
    assert head < puts[0] < text.index("}\n}\n", head), "ssm:PutParameter must be in the Ray head's own policy"
    (head_instance,) = [b for k, b in _resources("aws_instance", [SERVING / "main.tf"]).items() if k.endswith(".ray_head")]
    assert "aws_iam_instance_profile.ray_head" in str(_v(head_instance, "iam_instance_profile"))
    assert "s3:DeleteObject" not in text, "a serving host may delete no S3 object"
    writes = re.findall(r'Action\s*=\s*\[[^\]]*"s3:PutObject"[^\]]*\]\s*\n\s*Resource\s*=\s*"([^"]+)"', text)
    assert writes == ["${var.kv_bucket_arn}/${local.writeback_prefix}/*"], writes


# --- IMDS ---

def test_imds_v2_with_hop_limit_one_everywhere() -> None:
    hosts = {**_resources("aws_instance"), **_resources("aws_launch_template")}
    assert len(hosts) >= 4, sorted(hosts)
    for key, body in hosts.items():
        (md,) = _blocks_named(body, "metadata_options") or [None]
        assert md is not None, f"{key} sets no metadata_options"
        assert _v(md, "http_tokens") == "required", key
        assert _v(md, "http_put_response_hop_limit") == 1, f"{key}: a container one hop further could reach IMDS"
    assert "CKV_AWS_341" not in "".join(p.read_text() for p in tf_files())


# --- secrets ---

@pytest.mark.parametrize("path", [TERRAFORM_DIR / "variables.tf", SERVING / "variables.tf",
                                  TERRAFORM_DIR / "examples" / "single-g5" / "main.tf",
                                  TERRAFORM_DIR / "examples" / "ray-cluster" / "main.tf"],
                         ids=lambda p: str(p.relative_to(TERRAFORM_DIR)))
def test_api_keys_variable_is_sensitive(path: Path) -> None:
    assert _v(_variable(path, "api_keys_json"), "sensitive") is True


def test_api_keys_live_in_a_secure_string_under_a_rotating_key() -> None:
    params = {k.split(".")[-1]: b for k, b in _resources("aws_ssm_parameter", [SERVING / "main.tf"]).items()}
    assert set(params) == {"api_keys", "ray_token"}
    param = params["api_keys"]
    assert _v(param, "type") == "SecureString" and _v(param, "value") == "${var.api_keys_json}"
    # the Ray token too: made here under the tier's key (issue 71: a boot script made it under aws/ssm)
    for param in params.values():
        assert _v(param, "type") == "SecureString" and _v(param, "key_id") == "${aws_kms_key.secrets.arn}"
    assert "ignore_changes" in str(params["ray_token"])  # the head writes the token; Terraform never reads it back
    keys = {k.split(".")[-1]: b for k, b in _resources("aws_kms_key", [SERVING / "main.tf"]).items()}
    assert _v(keys["secrets"], "enable_key_rotation") is True


def test_no_secret_reaches_user_data() -> None:
    # The templates get the parameter's name, never its value; the environment map refuses
    # credential-looking names (its validation).
    loc = _locals(SERVING / "main.tf")
    for name in ("user_data", "ray_node"):
        rendered_from = json.dumps(loc[name])
        assert "api_keys_json" not in rendered_from and "aws_ssm_parameter" not in rendered_from, name
        assert "api_keys_parameter" in rendered_from, name
    validations = json.dumps(_v(_variable(SERVING / "variables.tf", "environment"), "validation"))
    assert "TOKEN" in validations and "SECRET" in validations and "API_KEY" in validations
    for t in TEMPLATES:
        text = t.read_text()
        assert "--with-decryption" in text and "--api-keys /etc/ragkv/api-keys.json" in text, t.name
        assert "RAGKV_AUTH_TOKEN" not in text and "--insecure-no-auth" not in text, t.name


def test_serving_hosts_write_no_kv_back_to_the_shared_bucket() -> None:
    """Their IAM lets them write only under serve-writeback, so the server is told to write
    nothing back to the S3 tier it reads (`--kv-s3-writeback off`): no 403 per computed chunk."""
    from ragkv.server.settings import load_settings

    for t in TEMPLATES:
        env = dict(line.split("=", 1) for line in t.read_text().splitlines() if line.startswith("RAGKV_KV_S3"))
        assert "RAGKV_KV_S3_URI" in env and env.get("RAGKV_KV_S3_WRITEBACK") == "off", t.name
        assert load_settings(env={"RAGKV_KV_S3_WRITEBACK": env["RAGKV_KV_S3_WRITEBACK"]}).kv_s3_writeback is False


def test_serve_commands_listen_on_every_interface_only_with_keys() -> None:
    for t in TEMPLATES:
        serve = [line for line in t.read_text().splitlines()
                 if "ragkv serve" in line and "--index" in line and not line.startswith("#")]
        assert serve, t.name
        for line in serve:
            assert "--host 0.0.0.0" in line and "--api-keys " in line and "--metrics-host ${metrics_host}" in line, line
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", (REPO_ROOT / "Dockerfile").read_text(), re.M).group(1))
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--api-keys") + 1] == "/run/secrets/ragkv-api-keys.json"
    assert "--metrics-host" not in cmd and "--insecure-no-auth" not in cmd


def test_metrics_listen_beyond_loopback_only_for_clients_inside_the_vpc() -> None:
    loc = _locals(SERVING / "main.tf")
    assert "local.metrics_in_vpc" in str(loc["metrics_host"]) and "127.0.0.1" in str(loc["metrics_host"])
    assert "!var.allow_public_ingress" in str(loc["metrics_in_vpc"]) and "local.vpc_cidrs" in str(loc["metrics_in_vpc"])
    # the metrics port is opened only when it listens on every interface
    assert "local.metrics_in_vpc ? {metrics = var.metrics_port} : {}" in str(loc["client_ports"])


# --- TLS ---

def test_listeners_are_tls_unless_plaintext_is_opted_into() -> None:
    listeners = _resources("aws_lb_listener")
    assert len(listeners) >= 2, sorted(listeners)
    lb_locals = _locals(SERVING / "lb.tf")
    assert _v(lb_locals, "listener_protocol") == '${var.allow_plaintext_listeners ? "TCP" : "TLS"}'
    for key, body in listeners.items():
        assert _v(body, "protocol") == "${local.listener_protocol}", f"{key}: the protocol must follow listener_protocol"
        assert "var.certificate_arn" in str(_v(body, "certificate_arn")), key
        assert "var.ssl_policy" in str(_v(body, "ssl_policy")), key
    for path in (TERRAFORM_DIR / "variables.tf", SERVING / "variables.tf"):
        assert _v(_variable(path, "allow_plaintext_listeners"), "default") is False, path
    assert str(_v(_variable(SERVING / "variables.tf", "ssl_policy"), "default")).startswith("ELBSecurityPolicy-TLS13-1-2-")
    cert = json.dumps(_v(_variable(SERVING / "variables.tf", "certificate_arn"), "validation"))
    assert "var.allow_plaintext_listeners" in cert and "var.create_load_balancer" in cert


# --- the image ---

def test_hosts_pull_the_image_by_digest() -> None:
    image = _variable(SERVING / "variables.tf", "container_image")
    assert "@sha256:[0-9a-f]{64}$" in json.dumps(_v(image, "validation")).replace("\\\\", "\\")
    root = _locals(TERRAFORM_DIR / "main.tf")
    assert "var.image_digest" in str(root["container_image"])


def test_registry_never_expires_the_deployed_tag() -> None:
    modules = {name: body for _, (name,), body in blocks("module", [TERRAFORM_DIR / "main.tf"])}
    assert "var.image_tag" in str(_v(modules["registry"], "protected_tags") or modules["registry"].get("protected_tags"))
    text = (TERRAFORM_DIR / "modules" / "registry" / "main.tf").read_text()
    protect = text.index("tagPatternList = local.protected_patterns")
    assert re.search(r"rulePriority\s*=\s*1\b", text[:protect][-400:]), "the protection must be the first rule"
    assert "countNumber    = 10000" in text[protect:protect + 200]
    anys = [m.start() for m in re.finditer(r'tagStatus\s*=\s*"any"', text)]
    assert len(anys) == 1 and anys[0] > protect, "a rule over any tag must come after the protection"
    prefixes = _v(_variable(TERRAFORM_DIR / "modules" / "registry" / "variables.tf", "protected_tag_prefixes"), "default")
    assert prefixes in ("release-", ["release-"], '"release-"'), prefixes
