"""ServerSettings: flags > environment > file > defaults, and errors that name the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragkv.engine.focus import FocusOptions
from ragkv.server.settings import CollectionSpec, DType, ServerSettings, load_settings
from ragkv.types import Mode


def test_defaults() -> None:
    s = load_settings({}, env={})
    assert s == ServerSettings()
    assert s.limits().default_mode is Mode.BLEND  # held out, no focus rule beat it (issue 53)
    # the defaults measured on MuSiQue and the needle tasks (docs/quality.md, issues 28 and 39): focus
    # hands over to blend when several chunks matter; the quality guard is off unless asked
    assert s.focus_handover is True and s.quality_guard_mass is None and s.default_recompute_ratio is None
    assert s.fidelity_kl == 0.01
    assert s.limits().default_recompute_ratio == 0.15
    # a lookup reuses the best chunk's KV as stored; more than half the chunks kept hands over (issue 39, stop 47)
    assert s.focus().lookup_ratio == 0.0 and s.focus().lookup_keep == 1.0 and s.focus().several == 3
    assert load_settings({"focus_lookup_ratio": "1", "focus_lookup_keep": "1"}, env={}).focus() == FocusOptions(
        keep=0.5, handover=True, spread=0.66, lookup_ratio=1.0, lookup_keep=1.0)
    with pytest.raises(ValueError, match="focus_lookup_ratio"):
        ServerSettings(focus_lookup_ratio=2.0)
    assert load_settings({"focus_several": "0"}, env={}).focus().several == 0
    with pytest.raises(ValueError, match="focus_several"):
        ServerSettings(focus_several=1)
    assert load_settings({"focus_handover": "off"}, env={}).focus_handover is False
    # a lookup (one chunk far above the others) stays focused: handover waits for the spread
    assert s.focus_spread == 0.66 and s.focus().spread == FocusOptions().spread
    assert load_settings({"focus_spread": "0.5"}, env={}).focus_spread == 0.5
    with pytest.raises(ValueError, match="focus_spread"):
        ServerSettings(focus_spread=-0.1)
    assert load_settings({}, env={"RAGKV_QUALITY_GUARD_MASS": "0.8"}).quality_guard_mass == 0.8
    with pytest.raises(ValueError, match="quality_guard_mass"):
        ServerSettings(quality_guard_mass=1.5)


def test_precedence_flags_env_file(tmp_path: Path) -> None:
    cfg = tmp_path / "ragkv.toml"
    cfg.write_text('[server]\nport = 7000\nmax_queue = 5\ndtype = "bfloat16"\nindexes = ["docs=/data/docs"]\n')
    env = {"RAGKV_MAX_QUEUE": "9", "RAGKV_METRICS_PORT": "off", "RAGKV_DEFAULT_MODE": "REUSE"}
    s = load_settings({"port": 7001, "max_queue": None}, env=env, config_file=cfg)
    assert s.port == 7001  # flag over file
    assert s.max_queue == 9  # env over file; a None flag is "not given"
    assert s.metrics_port is None and s.dtype is DType.BFLOAT16 and s.default_mode is Mode.REUSE
    assert s.indexes == (CollectionSpec("docs", Path("/data/docs")),)


def test_json_file_and_index_specs(tmp_path: Path) -> None:
    cfg = tmp_path / "ragkv.json"
    cfg.write_text(json.dumps({"grace_seconds": 2.5}))
    s = load_settings({"indexes": ("/idx/a", "b=/idx/b")}, env={}, config_file=cfg)
    assert s.grace_seconds == 2.5
    assert [(c.name, str(c.index_dir)) for c in s.indexes] == [("default", "/idx/a"), ("b", "/idx/b")]


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"port": 70000}, {}, "port must be in [0, 65535], got 70000"),
        ({}, {"RAGKV_MAX_QUEUE": "lots"}, "max_queue must be a int, got 'lots'"),
        ({"dtype": "float8"}, {}, "dtype must be one of float32, bfloat16, float16, auto, got 'float8'"),
        ({"indexes": ("a=/x", "a=/y")}, {}, "collection names must be unique"),
        ({"tls_cert": "/c.pem"}, {}, "TLS needs both"),
        ({"nonsense": 1}, {}, "unknown setting 'nonsense'"),
        ({}, {"RAGKV_FOCUS_KEEP": "0"}, "focus_keep must be in (0, 1], got 0.0"),
        ({"prompt_share": 1.0}, {}, "prompt_share must be in (0, 1), got 1.0"),
        ({}, {"RAGKV_PROMPT_STEP_TOKENS": "-1"}, "prompt_step_tokens must be >= 0 (0 = a whole layer per step), got -1"),
        ({}, {"RAGKV_PROMPT_STEP_TOKENS": "many"}, "prompt_step_tokens must be a int or auto, got 'many'"),
        ({}, {"RAGKV_PROMPT_BATCH_ROWS": "-2"}, "prompt_batch_rows must be >= 0 (0 = one pass per step), got -2"),
        ({"prompt_batch_rows": "wide"}, {}, "prompt_batch_rows must be a int, got 'wide'"),
    ],
)
def test_bad_values_are_named(flags: dict, env: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        load_settings(flags, env=env)
    assert needle in str(err.value)


def test_unknown_file_key(tmp_path: Path) -> None:
    cfg = tmp_path / "x.toml"
    cfg.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="unknown settings \\['prot'\\]"):
        load_settings({}, env={}, config_file=cfg)


def test_serve_flags_map_to_settings(tmp_path: Path) -> None:
    from ragkv.cli.main import build_parser
    from ragkv.cli.serve import settings_from_args

    args = build_parser().parse_args([
        "serve", "--index", "/idx/a", "--index", "b=/idx/b", "--port", "0", "--metrics-port", "off",
        "--max-queue", "3", "--default-mode", "reuse", "--focus-keep", "0.5", "--prompt-step-tokens", "512",
        "--prompt-batch-rows", "300",
    ])
    s = settings_from_args(args, env={"RAGKV_MAX_QUEUE": "7", "RAGKV_GRACE_SECONDS": "1.5"})
    assert [c.name for c in s.indexes] == ["default", "b"]
    assert (s.port, s.metrics_port, s.max_queue, s.grace_seconds) == (0, None, 3, 1.5)
    assert s.default_mode is Mode.REUSE and s.focus_keep == 0.5
    assert s.prompt_step_tokens == 512 and ServerSettings().prompt_step_tokens is None  # auto
    assert load_settings({"prompt_step_tokens": "auto"}, env={"RAGKV_PROMPT_STEP_TOKENS": "512"}).prompt_step_tokens \
        is None  # the flag's auto wins over the environment's 512
    assert s.prompt_batch_rows == 300 and s.scheduler().prompt_batch_rows == 300
    assert ServerSettings().scheduler().prompt_batch_rows == 512  # the default, on every device


def test_serve_exits_nonzero_when_the_index_cannot_load(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "ragkv.cli", "serve", "--index", str(tmp_path / "no-such-index"), "--port", "0",
         "--metrics-port", "off", "--host", "127.0.0.1"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "no index at" in out.stderr


def test_kv_layered_reads_on_and_off_words_and_refuses_others() -> None:
    assert ServerSettings().kv_layered is True
    assert load_settings({"kv_layered": "off"}, env={}).kv_layered is False
    assert load_settings({}, env={"RAGKV_KV_LAYERED": "no"}).kv_layered is False
    assert load_settings({"kv_layered": "ON"}, env={"RAGKV_KV_LAYERED": "0"}).kv_layered is True
    with pytest.raises(ValueError, match="kv_layered must be one of 1, true, yes, on, 0, false, no, off, got 'maybe'"):
        load_settings({"kv_layered": "maybe"}, env={})


def test_the_server_keeps_the_cpu_faiss_index_unless_told() -> None:
    from ragkv.cli.main import build_parser
    from ragkv.cli.serve import settings_from_args

    assert ServerSettings().faiss_device == "cpu"
    args = build_parser().parse_args(["serve", "--index", "x", "--faiss-device", "cuda"])
    assert settings_from_args(args, env={}).faiss_device == "cuda"
    with pytest.raises(ValueError, match="faiss_device must be cpu or cuda, got 'gpu'"):
        load_settings({"faiss_device": "gpu"}, env={})


def test_kv_s3_writeback_off_reads_s3_and_writes_only_below_it(tmp_path) -> None:
    import torch

    from ragkv.server.assembly import store_config as _store_config
    from ragkv.server.settings import ServerSettings
    from ragkv.types import Tier

    on = _store_config(ServerSettings(kv_s3_uri="s3://kv-bucket/kv"), tmp_path, (), torch.device("cpu"))
    off = _store_config(ServerSettings(kv_s3_uri="s3://kv-bucket/kv", kv_s3_writeback=False,
                                       kv_disk_dir=tmp_path / "kv"), tmp_path, (),
                        torch.device("cpu"))
    assert Tier.S3 in on.durable_writes and Tier.S3 in {s.tier for s in off.tiers}
    assert Tier.S3 not in off.durable_writes and Tier.DISK in off.durable_writes


def test_stored_responses_stay_in_memory_unless_given_a_directory_and_their_bounds_are_checked(
        tmp_path: Path) -> None:
    from ragkv.cli.main import build_parser
    from ragkv.cli.serve import settings_from_args
    from ragkv.server.response_store import ResponseStore

    s = ServerSettings()
    assert s.responses_dir is None and s.responses_max_age_s == 30 * 86400.0
    args = build_parser().parse_args(["serve", "--index", "x", "--responses-dir", str(tmp_path / "r"),
                                      "--responses-max-age-s", "3600", "--responses-max-count", "5",
                                      "--responses-max-bytes", "65536"])
    s = settings_from_args(args, env={})
    store = ResponseStore.from_settings(s)
    assert (store.directory, store.max_age_s, store.max_entries, store.max_bytes) == (tmp_path / "r", 3600.0, 5, 65536)
    assert (tmp_path / "r").is_dir()
    assert load_settings({}, env={"RAGKV_RESPONSES_DIR": "off"}).responses_dir is None
    for bad in ({"responses_max_age_s": 0}, {"responses_max_age_s": "inf"}, {"responses_max_count": 0}):
        with pytest.raises(ValueError, match="responses_max_count, responses_max_bytes and responses_max_age_s"):
            load_settings(bad, env={})


def test_an_s3_index_does_not_choose_the_served_model(tmp_path) -> None:
    """Issue 71: with no --model the server loaded the model an index's manifest names; an index
    from S3 is written by the indexing job (untrusted documents), so it needs --model."""
    from ragkv.server.settings import CollectionSpec, ServerSettings

    remote = ServerSettings(indexes=(CollectionSpec.parse("s3://bucket/index/latest"),))
    with pytest.raises(ValueError, match="--model is required to serve s3://bucket/index/latest"):
        remote.served_model("attacker/model")
    assert ServerSettings(indexes=remote.indexes, model="smollm2-135m-instruct").served_model("attacker/model") \
        == "smollm2-135m-instruct"
    local = ServerSettings(indexes=(CollectionSpec.parse(str(tmp_path)),))
    assert local.served_model("my-model-dir") == "my-model-dir"  # an index on this machine: the operator's own


def test_ragkv_serve_refuses_an_s3_index_without_model_before_fetching_it(monkeypatch, capsys) -> None:
    from ragkv.cli.main import main

    fetched: list = []
    monkeypatch.setattr("ragkv.server.assembly.fetch_indexes", lambda s: fetched.append(s))
    assert main(["serve", "--index", "s3://bucket/index/latest"]) == 1
    assert "--model is required" in capsys.readouterr().err and fetched == []
