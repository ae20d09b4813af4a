"""Every command line the deploy runs parses with the real `ragkv` parser, and every
RAGKV_ variable the deploy sets is one ragkv reads.

Collected from: the Dockerfile's CMD, the serving user data (systemd ExecStart), the
Batch job definitions' commands (the indexing module's variables), and every `ragkv ...`
step of terraform/README.md's walk-through. The user data and the scripts it writes
pass `bash -n`, and its `docker run` lines mount what the image reads where the
Dockerfile says it reads it. Runs without terraform (python-hcl2 only).
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from ragkv.cli.environment import OTHER_ENV, known_env, unknown_env, warn_unknown_env
from ragkv.cli.main import build_parser, main
from tests.terraform.conftest import REPO_ROOT, TERRAFORM_DIR

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 is a dev dependency: pip install -e '.[dev]'")

USER_DATA = TERRAFORM_DIR / "modules" / "serving" / "templates" / "user_data.sh.tftpl"
# What Terraform and Batch put into the commands, as the modules' defaults would.
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv:0.1.0@sha256:" + "0123456789abcdef" * 4
KEYS_FILE = "/etc/ragkv/api-keys.json"  # where the hosts put the API keys file (and mount it)
TEMPLATE_VARS = {
    "image": IMAGE, "registry": IMAGE.split("/")[0], "grpc_port": "50051", "metrics_port": "9464", "health_port": "8080",
    "region": "us-east-1", "kv_s3_uri": "s3://ragkv-kv/kv", "index_s3_uri": "s3://ragkv-kv/index/latest",
    "model": "smollm2-135m-instruct",
    "health_bridge": "", "environment": "", "api_keys_parameter": "/ragkv/api-keys", "metrics_host": "0.0.0.0",
}
SHELL_ENV = {
    "CORPUS_URI": "s3://ragkv-kv/corpus", "INDEX_OUT_URI": "s3://ragkv-kv/index/latest",
    "RAGKV_KV_S3_URI": "s3://ragkv-kv/kv", "SHARD_COUNT": "4", "AWS_BATCH_JOB_ARRAY_INDEX": "2",
    "IMAGE": IMAGE, "BUCKET": "ragkv-kv",
    "REGION": "us-east-1", "ENDPOINT": "internal-ragkv-123.elb.us-east-1.amazonaws.com:50051",
}
SUBCOMMANDS = {"index", "serve", "query", "eval", "bench", "demo", "check-model"}
_RAGKV_VAR = re.compile(r"\bRAGKV_[A-Z0-9_]*[A-Z0-9]\b")


def _expand(word: str) -> str:
    """Shell parameter expansion of the forms the deploy uses: $X, ${X}, ${X:-default}."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        return SHELL_ENV.get(name, m.group(2) or "") if name in SHELL_ENV or m.group(2) is not None else \
            pytest.fail(f"the deploy uses ${name}, which this test gives no value: add it to SHELL_ENV")
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", lambda m: sub(m) if m.group(1) else
                  SHELL_ENV.get(m.group(3)) or pytest.fail(f"unknown ${m.group(3)}"), word)


def ragkv_argvs(text: str) -> list[list[str]]:
    """The argv (after `ragkv`) of each ragkv invocation in shell text."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0]
        if "ragkv" not in line:
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, w in enumerate(words[:-1]):
            if (w == "ragkv" or w.endswith("/bin/ragkv")) and words[i + 1] in SUBCOMMANDS:
                argv = []
                for a in words[i + 1:]:
                    if a in ("&&", "||", "|", ";", ")"):
                        break
                    argv.append(_expand(a))
                out.append(argv)
    return out


def render_user_data() -> str:
    text = re.sub(r"%\{ for .*?%\{ endfor ~\}\n", "", USER_DATA.read_text(), flags=re.S)  # var.environment: {}
    text = re.sub(r"(?<!\$)\$\{(\w+)\}", lambda m: TEMPLATE_VARS[m.group(1)], text)
    return text.replace("$${", "${")


def batch_commands() -> dict[str, str]:
    """The indexing module's job commands (variables index_command, merge_command), as sh -c gets them."""
    out = {}
    for entry in hcl2.load((TERRAFORM_DIR / "modules" / "indexing" / "variables.tf").open())["variable"]:
        for label, body in entry.items():
            name = label.strip('"')
            if name in ("index_command", "merge_command"):
                out[name] = json.loads(body["default"]).replace("$${", "${")
    return out


def readme_steps() -> list[list[str]]:
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", (TERRAFORM_DIR / "README.md").read_text(), re.S)
    return [argv for b in blocks for argv in ragkv_argvs(b)]


RAY_NODE = TERRAFORM_DIR / "modules" / "serving" / "templates" / "ray_node.sh.tftpl"
RAY_VARS = {**TEMPLATE_VARS, "token_parameter": "/ragkv/ray-auth-token",
            "token_key": "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555",
            "ray_port": "6379", "replicas": "2",
            "routing": "chunk", "http_port": "8000", "head_address": "10.0.1.10",
            "object_store_bytes": "4294967296", "peer_tier": "--peer-tier on --peer-tier-bytes 2147483648",
            "ray_ports": "--node-manager-port 6380 --object-manager-port 6381 --min-worker-port 10002 "
                         "--max-worker-port 19999"}


def render_ray_node(role: str) -> str:
    """ray_node.sh.tftpl as Terraform renders it for `role` (head or worker), var.environment empty."""
    text = re.sub(r"%\{ for .*?%\{ endfor ~\}\n", "", RAY_NODE.read_text(), flags=re.S)
    head, worker = re.search(r'%\{ if role == "head" ~\}\n(.*?)%\{ else ~\}\n(.*?)%\{ endif ~\}\n', text, re.S).groups()
    text = re.sub(r'%\{ if role == "head" ~\}\n.*?%\{ endif ~\}\n', lambda _: head if role == "head" else worker,
                  text, flags=re.S)
    text = re.sub(r"(?<!\$)\$\{(\w+)\}", lambda m: {**RAY_VARS, "role": role}[m.group(1)], text)
    return text.replace("$${", "${")


def ray_node_commands(role: str) -> list[list[str]]:
    """The commands the node's container runs (ExecStart's, a `bash -c` split at &&), as argv lists."""
    out = []
    for line in render_ray_node(role).replace("\\\n", " ").splitlines():
        if line.startswith("ExecStart=/usr/bin/docker run "):
            words = shlex.split(line.removeprefix("ExecStart="))
            command = words[words.index(IMAGE) + 1:]
            if command[:2] == ["bash", "-c"]:
                out += [shlex.split(part) for part in command[2].split("&&")]
            else:
                out.append(command)
    return out


def collected() -> dict[str, list[str]]:
    cmd = re.search(r"^CMD (\[.*\])$", (REPO_ROOT / "Dockerfile").read_text(), re.M)
    assert cmd, "the Dockerfile has no CMD [...]"
    found = {"Dockerfile CMD": json.loads(cmd.group(1))[1:]}
    for i, argv in enumerate(ragkv_argvs(render_user_data())):
        found[f"user_data #{i}"] = argv
    for role in ("head", "worker"):
        for i, argv in enumerate(c for c in ray_node_commands(role) if c[0] == "exec" or c[0] == "ragkv"):
            found[f"ray {role} #{i}"] = argv[argv.index("ragkv") + 1:]
    for name, command in batch_commands().items():
        (argv,) = ragkv_argvs(command)
        found[f"Batch {name}"] = argv
    for i, argv in enumerate(readme_steps()):
        found[f"terraform/README.md step {i}: ragkv {' '.join(argv[:2])}"] = argv
    return found


def test_every_surface_has_commands() -> None:
    names = " ".join(collected())
    for where in ("Dockerfile CMD", "user_data", "Batch index_command", "Batch merge_command", "README.md"):
        assert where in names, f"no ragkv command found in {where}"
    readme = [argv[0] for argv in readme_steps()]
    assert {"index", "serve", "query"} <= set(readme), readme


@pytest.mark.parametrize(("where", "argv"), sorted(collected().items()))
def test_deploy_command_parses(where: str, argv: list[str]) -> None:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `ragkv {shlex.join(argv)}` does not parse (see the usage message above)")
    if args.command == "index":  # S3 locations must be well formed, a shard spec valid
        from ragkv.indexer.sharding import resolve_shard
        from ragkv.retriever.remote import S3Location, is_s3_uri

        for uri in (args.corpus, args.out):
            if is_s3_uri(uri):
                S3Location.parse(uri)
        if args.shard:
            assert resolve_shard(args.shard) is not None
    if args.command == "serve":
        from ragkv.cli.serve import settings_from_args

        settings_from_args(args, env={})  # every value converts to its setting


def test_batch_jobs_run_sharded_s3_index_and_merge() -> None:
    cmds = {k: ragkv_argvs(v)[0] for k, v in batch_commands().items()}
    index = build_parser().parse_args(cmds["index_command"])
    merge = build_parser().parse_args(cmds["merge_command"])
    assert index.out == merge.out == SHELL_ENV["INDEX_OUT_URI"] and merge.corpus == "merge"
    assert index.corpus == SHELL_ENV["CORPUS_URI"] and index.shard == "2/4"
    assert index.device == "auto"  # the GPU host's CUDA is found, not named


def test_serving_unit_serves_the_s3_index_on_the_one_metrics_port() -> None:
    (argv,) = ragkv_argvs(render_user_data())
    args = build_parser().parse_args(argv)
    assert args.indexes == [TEMPLATE_VARS["index_s3_uri"]] and args.metrics_port == "9464"
    assert args.model == TEMPLATE_VARS["model"]
    docker = collected()["Dockerfile CMD"]
    assert docker[docker.index("--metrics-port") + 1] == "9464"
    assert "EXPOSE 50051 9464" in (REPO_ROOT / "Dockerfile").read_text()


def test_every_served_command_listens_with_credentials() -> None:
    """`ragkv serve` refuses a non-loopback --host without credentials: every deployed serve
    command listens on 0.0.0.0 with the API keys file (by path, never a token in the
    environment), and /metrics binds where Terraform decided (${metrics_host})."""
    serves = {where: argv for where, argv in collected().items() if argv[0] == "serve" and "README" not in where}
    assert {"Dockerfile CMD", "user_data #0", "ray head #0"} <= set(serves), sorted(serves)
    for where, argv in serves.items():
        args = build_parser().parse_args(argv)
        assert args.host == "0.0.0.0", where
        # an s3:// index's manifest does not choose the served model (issue 71): `ragkv serve` refuses it
        assert not any(i.startswith("s3://") for i in args.indexes) or args.model, f"{where}: an s3:// index needs --model"
        assert args.api_keys is not None and not getattr(args, "insecure_no_auth", False), where
        assert args.auth_token_file is None, f"{where}: credentials come from the named keys file"
    docker = build_parser().parse_args(serves["Dockerfile CMD"])
    assert str(docker.api_keys) == "/run/secrets/ragkv-api-keys.json" and docker.metrics_host is None
    assert "mounted as a secret at\n# /run/secrets/ragkv-api-keys.json" in (REPO_ROOT / "Dockerfile").read_text()
    for where in ("user_data #0", "ray head #0"):
        args = build_parser().parse_args(serves[where])
        assert str(args.api_keys) == KEYS_FILE and args.metrics_host == TEMPLATE_VARS["metrics_host"], where
    # The template takes the bind address from Terraform, which chooses 0.0.0.0 only when the
    # security group admits the metrics port from inside the VPC alone.
    for template in (USER_DATA, RAY_NODE):
        assert "--metrics-host ${metrics_host}" in template.read_text(), template.name


@pytest.mark.parametrize("template", ["user_data", "ray_node"])
def test_api_keys_come_from_ssm_into_a_file_only_the_service_user_reads(template: str) -> None:
    text = render_user_data() if template == "user_data" else render_ray_node("worker")
    script = _scripts(text)["/usr/local/sbin/ragkv-api-keys"]
    assert "aws ssm get-parameter --region us-east-1 --name /ragkv/api-keys --with-decryption" in script.replace("\\\n  ", "")
    assert "umask 077" in script and "chown 10001" in script and "chmod 0400" in script
    assert f'mv -f "$tmp" {KEYS_FILE}' in script
    assert "ExecStartPre=/usr/local/sbin/ragkv-api-keys" in text
    assert f"--volume {KEYS_FILE}:{KEYS_FILE}:ro" in text
    # No credential in the environment the container or the host gets.
    env_file = re.search(r"cat > /etc/ragkv/ragkv.env <<'ENV'\n(.*?)^ENV$", text, re.S | re.M).group(1)
    assert "TOKEN" not in env_file.replace("RAY_AUTH_MODE=token", "") and "API_KEY" not in env_file


def _scripts(user_data: str) -> dict[str, str]:
    """The scripts the user data writes with `cat > PATH <<'SH'`, by path."""
    return dict(re.findall(r"^cat > (\S+) <<'SH'\n(.*?)^SH$", user_data, re.S | re.M))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash to check the user data's syntax")
def test_user_data_and_its_scripts_are_valid_bash() -> None:
    user_data = render_user_data()
    scripts = _scripts(user_data)
    assert set(scripts) == {"/usr/local/sbin/ragkv-pull", "/usr/local/sbin/ragkv-ssd-setup",
                            "/usr/local/sbin/ragkv-api-keys"}, sorted(scripts)
    for name, text in {"user data": user_data, **scripts}.items():
        p = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, f"{name} is not valid bash:\n{p.stderr}"


def _docker_runs(user_data: str) -> dict[str, tuple[list[str], list[str]]]:
    """container name -> (docker run options, command after the image) of each unit's ExecStart."""
    out = {}
    for line in user_data.replace("\\\n", " ").splitlines():
        if line.startswith("ExecStart=/usr/bin/docker run "):
            words = shlex.split(line.removeprefix("ExecStart="))
            at = words.index(IMAGE)
            opts = words[2:at]
            out[opts[opts.index("--name") + 1]] = (opts, words[at + 1:])
    return out


def _dockerfile_env() -> dict[str, str]:
    text = (REPO_ROOT / "Dockerfile").read_text()
    block = re.search(r"^ENV (.*?)(?<!\\)\n", text, re.S | re.M).group(1)
    return dict(w.split("=", 1) for w in shlex.split(block.replace("\\\n", " ")))


def test_units_run_the_image_with_its_own_paths_and_user() -> None:
    user_data = render_user_data()
    runs = _docker_runs(user_data)
    assert set(runs) == {"ragkv", "ragkv-health"}, runs
    opts, command = runs["ragkv"]
    assert command[:2] == ["ragkv", "serve"]
    volumes = dict(v.split(":")[1::-1] for v in (opts[i + 1] for i, o in enumerate(opts) if o == "--volume"))
    env = _dockerfile_env()
    # The SSD tier and the cache land where the image's ragkv looks for them.
    assert volumes[env["RAGKV_KV_DISK_DIR"]] == "/mnt/ragkv-ssd/kv"
    assert volumes[env["RAGKV_CACHE_DIR"]] == "/var/lib/ragkv/cache"
    assert f"RAGKV_KV_DISK_DIR={env['RAGKV_KV_DISK_DIR']}" in user_data
    uid = re.search(r"useradd .*--uid (\d+)", (REPO_ROOT / "Dockerfile").read_text()).group(1)
    for name, (o, _) in runs.items():
        # The image's own user, and the host's network: one hop to IMDSv2 (hop limit 1).
        assert o[o.index("--user") + 1] == uid and o[o.index("--network") + 1] == "host", name
    assert "--gpus" in opts and f"install -d -o {uid} -m 0750 /mnt/ragkv-ssd/kv" in user_data
    # The API keys file the command names is the one the host wrote, mounted read-only.
    assert volumes[command[command.index("--api-keys") + 1]] == KEYS_FILE
    assert f"{KEYS_FILE}:{KEYS_FILE}:ro" in opts
    health_opts, health_cmd = runs["ragkv-health"]
    assert health_cmd[:2] == ["python", "/opt/ragkv/grpc_health_http.py"]
    assert "/opt/ragkv/grpc_health_http.py:/opt/ragkv/grpc_health_http.py:ro" in health_opts


def _set_vars() -> dict[str, set[str]]:
    files = [REPO_ROOT / "Dockerfile", USER_DATA, RAY_NODE, TERRAFORM_DIR / "README.md",
             *TERRAFORM_DIR.rglob("*.tf"), *TERRAFORM_DIR.rglob("*.hcl")]
    return {str(p.relative_to(REPO_ROOT)): set(_RAGKV_VAR.findall(p.read_text())) for p in files}


def test_every_ragkv_variable_the_deploy_names_is_read() -> None:
    known = known_env()
    bad = {f: sorted(v - known) for f, v in _set_vars().items() if v - known}
    assert not bad, f"RAGKV_ variables that nothing reads: {bad} (known: {sorted(known)})"
    assert "RAGKV_KV_DISK_DIR" in _set_vars()["Dockerfile"]


def test_other_env_names_are_read_in_the_source() -> None:
    sources = "".join(p.read_text() for d in ("engine", "server", "cli", "ragkv", "indexer")
                      for p in (REPO_ROOT / d).rglob("*.py") if p.name != "environment.py")
    for name in OTHER_ENV:
        assert f'"{name}"' in sources, f"{name} is listed as read but no module reads it"


def test_unknown_variables_warn_with_the_right_name(caplog: pytest.LogCaptureFixture) -> None:
    env = {"RAGKV_DISK_DIR": "/x", "RAGKV_KV_DISK_DIR": "/y", "RAGKV_MAX_QUEUE": "4", "HOME": "/h"}
    assert unknown_env(env) == ["RAGKV_DISK_DIR"]
    with caplog.at_level(logging.WARNING, logger="ragkv.cli"):
        assert warn_unknown_env(env) == ["RAGKV_DISK_DIR"]
    assert "RAGKV_DISK_DIR is not a ragkv setting" in caplog.text and "did you mean RAGKV_KV_DISK_DIR" in caplog.text


def test_index_command_warns_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("RAGKV_DISK_DIR", "/mnt/kv")
    with caplog.at_level(logging.WARNING, logger="ragkv.cli"):
        assert main(["index", "merge", "--out", str(tmp_path)]) == 1  # no shards there: an error, after the warning
    assert "RAGKV_DISK_DIR is not a ragkv setting" in caplog.text


@pytest.mark.parametrize("role", ["head", "worker"])
def test_ray_nodes_run_ray_start_as_ray_parses_it_and_are_valid_bash(role: str) -> None:
    pytest.importorskip("ray.scripts.scripts", reason="the ray extra is not installed: pip install 'ragkv[ray]'")
    from ray.scripts.scripts import start

    commands = ray_node_commands(role)
    starts = [c for c in commands if c[:2] == ["ray", "start"]]
    assert len(starts) == 1, commands
    ctx = start.make_context("start", starts[0][2:])  # parses, runs nothing
    assert ctx.params["object_store_memory"] == 4294967296  # the peer tier's room, on every node
    if role == "head":
        assert ctx.params["head"] and ctx.params["port"] == 6379 and ctx.params["node_manager_port"] == 6380
        (serve,) = [c[c.index("ragkv") + 1:] for c in commands if "ragkv" in c]
        args = build_parser().parse_args(serve)
        assert args.replicas == 2 and args.ray_address == "auto" and args.gpus_per_replica == 1.0
        assert args.port == 50051 and args.http_port == "8000" and args.routing == "chunk"
        assert args.peer_tier == "on" and args.peer_tier_bytes == 2147483648
    else:
        assert ctx.params["address"] == "10.0.1.10:6379" and ctx.params["num_gpus"] == 1 and ctx.params["block"]
        assert ctx.params["max_worker_port"] == 19999
        assert not [c for c in commands if "ragkv" in c]
    user_data = render_ray_node(role)
    scripts = _scripts(user_data)
    assert set(scripts) == {"/usr/local/sbin/ragkv-pull", "/usr/local/sbin/ragkv-ray-token",
                            "/usr/local/sbin/ragkv-api-keys"}, sorted(scripts)
    for name, text in {"user data": user_data, **scripts}.items():
        p = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, f"{role} {name} is not valid bash:\n{p.stderr}"
    assert "RAY_AUTH_MODE=token" in user_data  # the nodes share a token; Ray's ports see no client


def test_the_peer_tier_fits_the_object_store_and_only_the_cluster_reaches_its_port() -> None:
    """ray_peer_tier_bytes is bounded by the object store it lives in (a cross-variable validation),
    0 turns it off, and the object manager's port (the peer tier's bytes between nodes) is among
    the ports the security group admits from itself alone."""
    variables = (TERRAFORM_DIR / "modules" / "serving" / "variables.tf").read_text()
    block = variables[variables.index('variable "ray_peer_tier_bytes"'):]
    block = block[:block.index("\n}\n")]
    assert "var.ray_peer_tier_bytes <= var.ray_object_store_bytes" in block
    main_tf = (TERRAFORM_DIR / "modules" / "serving" / "main.tf").read_text()
    assert '"--peer-tier off"' in main_tf and "--peer-tier-bytes ${var.ray_peer_tier_bytes}" in main_tf
    assert "object_manager = var.ray_port + 2" in main_tf
    assert "gcs_and_agents = { from = var.ray_port, to = var.ray_port + 6 }" in main_tf
    rule = main_tf[main_tf.index('resource "aws_vpc_security_group_ingress_rule" "ray_internal"'):]
    rule = rule[:rule.index("\n}\n")]
    assert "for_each = var.ray_cluster ? local.ray_port_ranges : {}" in rule
    assert "referenced_security_group_id = aws_security_group.serving.id" in rule and "cidr" not in rule
    off = build_parser().parse_args(["serve", "--index", "x", "--replicas", "2", "--peer-tier", "off"])
    assert off.peer_tier == "off"
