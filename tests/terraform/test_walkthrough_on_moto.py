"""terraform apply, then destroy, of both examples and of the root module as
terraform/README.md's walk-through runs it, against moto's server on loopback.

The provider's endpoints point at moto from a test-only file written into a
temporary copy of terraform/, so the modules stay as users get them. moto's gaps
are worked around here, never in the modules: it has no Deep Learning AMI SSM
parameter (`ami_id` pins one of its AMIs), its MonitorInstances answers 500
(`detailed_monitoring = false`), it loads AWS managed IAM policies only when asked
(MOTO_IAM_LOAD_MANAGED_POLICIES), and its Batch needs an explicit service role
(`batch_service_role_arn` names one made here), and it reports a launch template's
tags back as a tag specification, so the README's tear-down apply is targeted at what
it changes (else it would write new template versions and start an instance refresh,
which moto answers with 500). moto enforces no NLB deletion protection, so the
tear-down (which turns it off first) is run, not proved.

What the account (or the operator) brings is made here too: an ACM certificate for the TLS
listeners (moto's RequestCertificate; moto checks that a listener's certificate exists), the
API keys (`api_keys_json`, which the README exports as TF_VAR_api_keys_json) and the pushed
image's digest (moto keeps no image: a fixed sha256 stands for the README's $DIGEST).
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.terraform.conftest import TERRAFORM_DIR, copy_terraform_tree, run_tf

boto3 = pytest.importorskip("boto3", reason="boto3 comes with the server extra: pip install -e '.[server,dev]'")
pytest.importorskip("moto.server", reason="moto[server] is a dev dependency: pip install -e '.[dev]'")

REGION = "us-east-1"
DIGEST = "sha256:" + "0123456789abcdef" * 4  # stands for the pushed image's digest ($DIGEST in the README)
API_KEY = "walkthrough-secret-key-not-for-user-data"
API_KEYS_JSON = json.dumps([{"name": "ops", "key": API_KEY}])
# Every service the modules call; each gets the provider's endpoint override.
SERVICES = ("autoscaling", "batch", "ec2", "ecr", "elbv2", "iam", "kms", "s3", "ssm", "sts")
STARTUP_S = 30.0  # seconds moto's server may take to answer
TF_TIMEOUT_S = 300  # seconds per terraform apply or destroy
# What the README's tear-down apply changes: deletion protection and force_destroy.
TEARDOWN_TARGETS = ("module.serving[0].aws_lb.serving[0]", "module.kv_bucket.aws_s3_bucket.kv",
                    "module.registry.aws_ecr_repository.ragkv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's server in its own process on 127.0.0.1 at a free port, stopped at the end."""
    log = tmp_path_factory.mktemp("moto") / "server.log"
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "MOTO_IAM_LOAD_MANAGED_POLICIES": "true"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto's server did not answer on {url} within {STARTUP_S} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _client(url: str, service: str):
    return boto3.client(service, endpoint_url=url, region_name=REGION,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture(scope="module")
def account(moto_url: str) -> dict[str, object]:
    """What a real account already has and the modules take as inputs: a VPC with
    subnets in two zones, an AMI, and (moto's gap) a Batch service role."""
    ec2 = _client(moto_url, "ec2")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    subnets = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]
    by_zone = {s["AvailabilityZone"]: s["SubnetId"] for s in subnets}
    ami = ec2.describe_images(Owners=["amazon"], Filters=[{"Name": "architecture", "Values": ["x86_64"]}])["Images"][0]
    role = _client(moto_url, "iam").create_role(
        RoleName="ragkv-test-batch-service",
        AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"Service": "batch.amazonaws.com"}, "Action": "sts:AssumeRole"}]}),
    )["Role"]["Arn"]
    cert = _client(moto_url, "acm").request_certificate(DomainName="ragkv.internal.example.com")["CertificateArn"]
    return {"vpc_id": vpc, "subnet_ids": sorted(by_zone.values())[:2], "ami_id": ami["ImageId"],
            "batch_service_role_arn": role, "certificate_arn": cert}


def _provider(url: str, region: bool) -> str:
    endpoints = "\n".join(f'    {s} = "{url}"' for s in SERVICES)
    return (
        'provider "aws" {\n'
        + (f'  region = "{REGION}"\n' if region else "")
        + '  access_key                  = "testing"\n'
        '  secret_key                  = "testing"\n'
        "  skip_metadata_api_check     = true\n"
        "  s3_use_path_style           = true\n"
        "  max_retries                 = 3\n"  # a gap in moto fails in seconds, not after minutes of retries
        f"  endpoints {{\n{endpoints}\n  }}\n}}\n"
    )


def _workarounds(account: dict[str, object]) -> dict[str, object]:
    return {"ami_id": account["ami_id"], "detailed_monitoring": False,
            "batch_service_role_arn": account["batch_service_role_arn"]}


def _hcl(value: object) -> str:
    return json.dumps(value)  # strings, bools and lists of strings read the same in HCL


def _managed(env: dict[str, str], cwd: Path) -> list[str]:
    p = run_tf(env, cwd, "state", "list", "-no-color")
    assert p.returncode == 0 or "No state file" in p.stderr, p.stderr
    return [r for r in p.stdout.split() if not re.search(r"(^|\.)data\.", r)]


def _run_step(env: dict[str, str], cwd: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """terraform with argv; an apply that failed on a name moto says is taken is run once more.

    Under load (CI runs this beside the main suite) moto can answer a create so late that the
    provider sends it again, and moto then refuses the name the first call took ("A compute
    environment already exists with the name ragkv-spot-2026..."). The resource is not in the
    state, and its name comes from a name_prefix, so the second apply makes it under a new name.
    A real error in the configuration fails the second apply as it failed the first."""
    p = run_tf(env, cwd, *argv, "-no-color", timeout=TF_TIMEOUT_S)
    if p.returncode != 0 and argv[0] == "apply" and "already exists" in p.stdout + p.stderr:
        print(f"terraform apply in {cwd.name}: moto said a name is taken (a create the provider sent twice); "
              "applying once more")
        p = run_tf(env, cwd, *argv, "-no-color", timeout=TF_TIMEOUT_S)
    return p


def _apply_then_destroy(env: dict[str, str], cwd: Path, steps: list[list[str]],
                        after: dict[int, Callable[[list[str]], None]] | None = None) -> list[str]:
    """Runs terraform with each argv in steps (init, apply..., destroy); returns the resources
    the last apply left in the state, after checking destroy removed every one. after[i], when
    given, is called with the state's resources once step i has run."""
    created: list[str] = []
    for i, argv in enumerate(steps):
        t0 = time.monotonic()
        p = _run_step(env, cwd, argv)
        assert p.returncode == 0, f"terraform {shlex.join(argv)} failed in {cwd.name}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
        print(f"terraform {argv[0]} in {cwd.name}: {time.monotonic() - t0:.1f} s")
        if argv[0] == "apply":
            created = _managed(env, cwd)
            m = re.search(r"Apply complete! Resources: (\d+) added", p.stdout)
            assert m, p.stdout[-2000:]
        if after and i in after:
            after[i](_managed(env, cwd))
    assert steps[-1][0] == "destroy" and _managed(env, cwd) == [], "destroy left resources in the state"
    return created


def _types(resources: list[str]) -> set[str]:
    return {r.split(".")[-2] for r in resources}


def _user_data(url: str) -> str:
    ec2 = _client(url, "ec2")
    (instance,) = [i for r in ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["running"]}])
                   ["Reservations"] for i in r["Instances"]]
    raw = ec2.describe_instance_attribute(InstanceId=instance["InstanceId"], Attribute="userData")
    data = base64.b64decode(raw["UserData"]["Value"])
    return gzip.decompress(data).decode() if data[:2] == b"\x1f\x8b" else data.decode()


def test_single_g5_example_applies_and_destroys(terraform_env, moto_url, account, tmp_path) -> None:
    work = copy_terraform_tree(tmp_path / "terraform") / "examples" / "single-g5"
    overrides = "\n".join(f"  {k} = {_hcl(v)}" for k, v in _workarounds(account).items())
    (work / "moto_override.tf").write_text(_provider(moto_url, region=False) + f'\nmodule "ragkv" {{\n{overrides}\n}}\n')
    args = ["-auto-approve", "-input=false", "-var", f"vpc_id={account['vpc_id']}",
            "-var", f"subnet_id={account['subnet_ids'][0]}", "-var", "client_cidr=10.0.0.0/16",
            "-var", f"image_digest={DIGEST}", "-var", f"api_keys_json={API_KEYS_JSON}"]
    p = run_tf(terraform_env, work, "init", "-input=false", "-no-color")
    assert p.returncode == 0, p.stdout + p.stderr
    p = _run_step(terraform_env, work, ["apply", *args])
    assert p.returncode == 0, f"apply failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    created = _managed(terraform_env, work)
    print(f"single-g5: {len(created)} resources")
    assert {"aws_instance", "aws_ecr_repository", "aws_s3_bucket", "aws_kms_key", "aws_ssm_parameter"} <= _types(created)

    # The host runs the image from the repository this apply made, by digest, and installs nothing by name.
    repo = _client(moto_url, "ecr").describe_repositories()["repositories"]
    (url,) = [r["repositoryUri"] for r in repo if r["repositoryName"] == "ragkv-single"]
    user_data = _user_data(moto_url)
    image = f"{url}:0.1.0@{DIGEST}"
    assert f"docker pull --quiet {image}" in user_data and f"{image} ragkv serve --index s3://" in user_data
    assert "pip install" not in user_data
    # The API keys reach the host through SSM (a SecureString under its own key), never in user data.
    assert API_KEY not in user_data and "--api-keys /etc/ragkv/api-keys.json" in user_data
    param = _client(moto_url, "ssm").get_parameter(Name="/ragkv-single/api-keys", WithDecryption=True)["Parameter"]
    assert param["Type"] == "SecureString" and json.loads(param["Value"]) == json.loads(API_KEYS_JSON)

    _apply_then_destroy(terraform_env, work, [["destroy", *args]])


def test_spot_indexing_example_applies_and_destroys(terraform_env, moto_url, account, tmp_path) -> None:
    work = copy_terraform_tree(tmp_path / "terraform") / "examples" / "spot-indexing"
    overrides = "\n".join(f"  {k} = {_hcl(v)}" for k, v in _workarounds(account).items())
    (work / "moto_override.tf").write_text(_provider(moto_url, region=False) + f'\nmodule "ragkv" {{\n{overrides}\n}}\n')
    args = ["-auto-approve", "-input=false", "-var", f"vpc_id={account['vpc_id']}",
            "-var", f"subnet_ids={_hcl(account['subnet_ids'])}"]
    pinned = [*args, "-var", f"image_digest=sha256:{'ab' * 32}"]
    # as the example's header says: the repository first (no image, so no digest yet), then the jobs by digest
    created = _apply_then_destroy(terraform_env, work, [["init", "-input=false"],
                                                        ["apply", "-target=module.ragkv.module.registry", *args],
                                                        ["apply", *pinned], ["destroy", *pinned]])
    print(f"spot-indexing: {len(created)} resources")
    assert {"aws_batch_compute_environment", "aws_batch_job_queue", "aws_batch_job_definition",
            "aws_ecr_repository"} <= _types(created)
    assert "aws_instance" not in _types(created)


def readme_terraform_steps() -> tuple[str, list[list[str]]]:
    """terraform/README.md's walk-through as it runs the root module: the tfvars file it
    writes, and the argv of each `terraform -chdir=terraform` init/apply/destroy, in order."""
    readme = (TERRAFORM_DIR / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    tfvars = [m for b in blocks for m in re.findall(r"cat > terraform/ragkv\.auto\.tfvars <<'EOF'\n(.*?)^EOF$", b, re.S | re.M)]
    assert len(tfvars) == 1, "terraform/README.md writes terraform/ragkv.auto.tfvars once in its walk-through"
    steps = []
    for b in blocks:
        for line in b.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["terraform", "-chdir=terraform"] and words[2] in ("init", "apply", "destroy"):
                steps.append(words[2:])
    return tfvars[0], steps


def test_readme_walkthrough_applies_and_tears_down_the_root_module(terraform_env, moto_url, account, tmp_path) -> None:
    tfvars, steps = readme_terraform_steps()
    # init; the repository alone (the image is pushed before any host exists); everything,
    # pinned by the pushed digest; the tear-down apply; destroy.
    assert [s[0] for s in steps] == ["init", "apply", "apply", "apply", "destroy"], steps
    assert steps[1][1:] == ["-target=module.registry"], steps[1]
    assert all("image_digest=$DIGEST" in s for s in steps[2:]), steps
    work = copy_terraform_tree(tmp_path / "terraform")
    (work / "ragkv.auto.tfvars").write_text(tfvars)
    (work / "moto_provider.tf").write_text(_provider(moto_url, region=True))
    # The account's own network, certificate and the workarounds; -var outranks the tfvars file.
    # The keys stand for the README's TF_VAR_api_keys_json.
    test_vars = {"vpc_id": account["vpc_id"], "subnet_ids": account["subnet_ids"],
                 "certificate_arn": account["certificate_arn"], "api_keys_json": API_KEYS_JSON, **_workarounds(account)}
    extra = [a for k, v in test_vars.items() for a in ("-var", f"{k}={v if isinstance(v, str) else _hcl(v)}")]
    runs = [s if s[0] == "init" else [a.replace("$DIGEST", DIGEST) for a in s] + ["-auto-approve", "-input=false", *extra]
            for s in steps]
    runs[3] += [f"-target={t}" for t in TEARDOWN_TARGETS]

    def registry_only(resources: list[str]) -> None:
        assert resources and all(r.startswith("module.registry.") for r in resources), resources

    def served_with_keys_and_tls(resources: list[str]) -> None:
        assert {"aws_ssm_parameter", "aws_kms_key", "aws_lb_listener"} <= _types(resources)
        elbv2 = _client(moto_url, "elbv2")
        (lb,) = elbv2.describe_load_balancers()["LoadBalancers"]
        listeners = elbv2.describe_listeners(LoadBalancerArn=lb["LoadBalancerArn"])["Listeners"]
        assert listeners and all(
            x["Protocol"] == "TLS" and x["SslPolicy"].startswith("ELBSecurityPolicy-TLS13-1-2-")
            and [c["CertificateArn"] for c in x["Certificates"]] == [account["certificate_arn"]] for x in listeners
        ), listeners
        ec2 = _client(moto_url, "ec2")
        (template,) = [t for t in ec2.describe_launch_templates()["LaunchTemplates"]
                       if t["LaunchTemplateName"].startswith("ragkv-serving-")]
        data = ec2.describe_launch_template_versions(LaunchTemplateId=template["LaunchTemplateId"], Versions=["$Latest"])
        user_data = gzip.decompress(base64.b64decode(data["LaunchTemplateVersions"][0]["LaunchTemplateData"]["UserData"]))
        assert API_KEY.encode() not in user_data and f"@{DIGEST} ragkv serve".encode() in user_data

    t0 = time.monotonic()
    created = _apply_then_destroy(terraform_env, work, runs, after={1: registry_only, 2: served_with_keys_and_tls})
    print(f"root module (README): {len(created)} resources, {time.monotonic() - t0:.1f} s")
    assert {"aws_autoscaling_group", "aws_lb", "aws_lb_listener", "aws_batch_compute_environment",
            "aws_ecr_repository", "aws_s3_bucket", "aws_ssm_parameter"} <= _types(created)
    # The tear-down turns the load balancer's deletion protection off before destroy.
    assert "load_balancer_deletion_protection=false" in steps[3] and "load_balancer_deletion_protection=false" in steps[4]
