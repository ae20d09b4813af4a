"""scripts/gpu_bench.py, the GPU path measured, run here at a tiny shape on the CPU: every section
of its JSON is there with finite positive times and the ratios, blend at ratio 1.0 equals full
prefill, and it runs as on the lent GPU machine (no ragkv install; no llguidance, faiss, bm25s,
crc32c or boto3)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_bench.py"
TINY = ["--shape", "tiny", "--device", "cpu", "--chunks", "2", "--chunk-tokens", "32", "--threads", "1"]
MODES = ("reuse", "blend", "focus")


def _script():
    spec = importlib.util.spec_from_file_location("gpu_bench_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gpu_bench():
    return _script()


@pytest.fixture(scope="module")
def tiny_run(gpu_bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench")
    threads = torch.get_num_threads()
    data = gpu_bench.main([*TINY, "--models", "llama3.1-8b", "--repeats", "1", "--decode-steps", "2",
                           "--batches", "1,2", "--step-tokens", "24", "--out", str(out)])  # 128-token prompts in pieces
    assert torch.get_num_threads() == threads  # main leaves the process's threads as they were
    return data, json.loads((out / "gpu_bench.json").read_text())


def _times(node, path=""):
    """Every (path, value) of a *_s timing under node."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("args", "section_s", "elapsed_s", "env", "read_estimate"):  # (the store's own estimate)
                continue
            if k.endswith("_s") and isinstance(v, (int, float)):
                yield f"{path}/{k}", v
            elif k == "times_s":
                for t in v:
                    yield f"{path}/{k}", t
            else:
                yield from _times(v, f"{path}/{k}")


def test_tiny_run_writes_every_section(tiny_run):
    data, written = tiny_run
    assert written["models"].keys() == data["models"].keys() == {"llama3.1-8b"}
    assert written["errors"] == [], written["errors"]
    m = written["models"]["llama3.1-8b"]
    assert m["shape"] == "tiny" and m["config"]["params"] > 0 and m["config"]["kv_bytes_per_token"] > 0
    assert m["chunk_prefill"]["tokens_per_s"] > 0
    t = m["ttft"]["2"]
    assert t["prompt_tokens"] == 32 + 2 * 32 + 32
    for key in ("ragkv_full", "hf_sdpa"):
        assert t[key]["median_s"] > 0, key
    variants = {"device_held", "cpu_whole_controller_off", "cpu_whole_controller_on", "disk_layered_controller_off",
                "disk_layered_controller_on", "disk_whole_controller_off", "disk_int4_layered_controller_off",
                "disk_int4_layered_controller_on", "disk_int4_layered_controller_on_page_cache"}
    assert variants <= t.keys(), t.keys()
    for v in variants:
        for mode in MODES:
            assert t[v][mode]["median_s"] > 0, (v, mode)
    assert t["device_held"]["blend"]["recompute_fraction"] == pytest.approx(0.15, abs=0.02)
    assert t["device_held"]["reuse"]["recompute_fraction"] == 0.0
    assert "used_chunks" in t["device_held"]["focus"]
    assert t["disk_layered_controller_off"]["filesystem"] is not None
    # int4 files (KIVI) read layer by layer: cold, and through the page cache the warm-up filled
    assert t["disk_int4_layered_controller_on"]["compression"] == "int4"
    assert t["disk_int4_layered_controller_on"]["page_cache"].startswith("dropped")
    assert t["disk_int4_layered_controller_on_page_cache"]["page_cache"].startswith("warm")
    assert m["store_put_s"].keys() >= {"cpu", "disk", "disk_int4"}
    # KV loads, decode at every batch, generate with a static cache
    tr = m["kv_transfer"]["2"]
    for key in ("cpu_to_device", "disk_to_device_cold", "disk_to_device_page_cache"):
        assert tr[key]["GB_per_s"] > 0, key
    for b in ("1", "2"):
        d = m["decode"]["2"][b]
        assert d["tokens_per_s"] > 0 and d["bytes_per_step"] > m["config"]["decode_weight_bytes"] > 0
        pooled = d["pooled"]  # the same decode over one KV pool: eager on a CPU, graphs on CUDA
        assert pooled["greedy_tokens_equal_ragged"] is True and pooled["speedup_vs_ragged"] > 0
        assert pooled["graphs"] is False and pooled["eager_steps"] == 4 and pooled["captures"] == 0
        assert pooled["ragged_steps"] == 0  # every step over the pool: its time is the pooled step's
    g = m["generate_static"]["2"]
    assert g["decode_tokens_per_s"] > 0 and g["ttft_s"] > 0 and g["compile"] == "disabled"
    assert m["generate_static_batches"]["2"]["32"]["batch"] == 32  # generate at a batch, as decode runs one
    # the compiled baseline is transformers' own torch.compile, which it does on CUDA only: skipped, saying so
    assert "generate_compiled" not in m
    assert any(s["what"].endswith("generate compiled") and "CUDA only" in s["why"] for s in written["skipped"])
    # where a decode step goes: a batch of 32 makes more host calls than a batch of 1 (attention per sequence)
    prof = m["decode_profile"]["2"]
    assert prof["32"]["aten_calls_per_step"] > prof["1"]["aten_calls_per_step"] > 0 and prof["1"]["top_host"]
    assert prof["1"]["device_busy_step_s"] is None  # no device on the CPU
    # the derived figures: ratios and limits (no peak figures for a CPU: MFU is None, TFLOP/s is not)
    r = m["ratios"]["2"]
    for v in variants:
        assert set(r[v]) == {"blend/full", "reuse/full", "focus/full"}, v
    for key in ("ragkv_full/hf_sdpa", "ragkv_decode/generate_static@b1", "ragkv_pooled/generate_static@b1"):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert m["limits"]["mfu"]["ragkv_full@2"]["tflops"] > 0
    assert {"cpu_to_device", "disk_to_device_cold"} <= m["limits"]["kv_GB_per_s"]["2"].keys()
    # every time anywhere is finite and positive
    times = list(_times(m))
    assert len(times) > 40
    bad = [(p, v) for p, v in times if not (math.isfinite(v) and v > 0)]
    assert not bad, bad
    # flash-attention is skipped, and says why
    assert any("flash_attention_2" in s["what"] and s["why"] for s in written["skipped"])


def test_blend_at_ratio_one_equals_full_prefill(tiny_run, gpu_bench):
    _, written = tiny_run
    check = written["models"]["llama3.1-8b"]["check"]
    assert check["ok"] and check["max_abs_diff"] <= 1e-4 and check["argmax_equal"], check
    pieces = written["models"]["llama3.1-8b"]["check_pieces"]  # chunked prefill against whole layers
    assert pieces["ok"] and pieces["max_abs_diff"] <= 1e-4 and pieces["argmax_equal"], pieces
    # and independently, on the same tiny weights the script builds
    from ragkv.engine import BlendOptions, Engine, Prompt
    from ragkv.types import Mode

    parts = sys.modules["gpu_bench_parts"]
    cfg = parts.make_config("qwen3-8b", "tiny")  # the other family: q/k norms
    dev = torch.device("cpu")
    lm = parts.wrap(parts.build_model(cfg, dev, torch.float32, 0), cfg, "qwen3-8b", dev, torch.float32, 0)
    eng = Engine(lm)
    g = torch.Generator().manual_seed(1)
    prefix, q = torch.randint(3, 500, (8,), generator=g).tolist(), torch.randint(3, 500, (6,), generator=g).tolist()
    chunks = [torch.randint(3, 500, (20,), generator=g).tolist() for _ in range(3)]
    kvs = [eng.prefill(prefix, ids) for ids in chunks]
    full = eng.run(Prompt([*prefix, *(t for ids in chunks for t in ids), *q]), Mode.FULL).logits
    blend = eng.run(Prompt(q, prefix, chunks, kvs), Mode.BLEND, BlendOptions(recompute_ratio=1.0)).logits
    assert (blend - full).abs().max().item() <= 1e-4


def test_runs_as_on_the_lent_gpu_machine(tmp_path):
    """In a fresh interpreter where ragkv is not installed (its editable finder removed) and the
    modules the lent machine lacks cannot be imported: the script bootstraps and runs clean."""
    blocked = ("llguidance", "faiss", "bm25s", "crc32c", "boto3", "botocore", "grpc", "google.protobuf",
               "sentence_transformers", "gguf", "flash_attn")
    argv = ["gpu_bench.py", *TINY, "--models", "qwen3-8b", "--quick", "--batches", "1", "--out", str(tmp_path)]
    code = (
        "import sys, runpy\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in (getattr(f, '__module__', '') or '')]\n"
        "sys.modules.pop('ragkv', None)\n"
        f"sys.argv = {argv!r}\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert data["errors"] == []
    notes = " ".join(data["env"]["notes"])
    assert "crc32c" in notes and "boto3" in notes
    for name in ("llguidance", "faiss", "bm25s"):
        assert name not in notes
    m = data["models"]["qwen3-8b"]
    assert m["check"]["ok"] and m["ttft"]["2"]["disk_layered_controller_on"]["blend"]["median_s"] > 0
    assert "ratios at 2 chunks" in proc.stdout and "blend/full" in proc.stdout


def test_a_spent_budget_skips_everything_and_says_so(gpu_bench, tmp_path):
    data = gpu_bench.main([*TINY, "--budget-s", "1", "--out", str(tmp_path)])
    assert {s["what"] for s in data["skipped"]} == {"llama3.1-8b build", "qwen3-8b build"}
    assert all("budget" in s["why"] for s in data["skipped"])
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["skipped"] == data["skipped"]


def test_arguments(gpu_bench, tmp_path):
    with pytest.raises(SystemExit):
        gpu_bench.parse(["--out", str(tmp_path), "--models", "gpt-5"])
    with pytest.raises(SystemExit, match="need a GPU"):
        gpu_bench.main(["--device", "cpu", "--out", str(tmp_path)])  # real 8B shapes
    args = gpu_bench.parse(["--out", str(tmp_path)])
    assert (args.models, args.chunks, args.chunk_tokens, args.batches, args.budget_s, args.ratio) == (
        ["llama3.1-8b", "qwen3-8b"], [8, 16], 512, [1, 8, 32, 64], 480.0, 0.15)


def test_real_shapes_are_the_published_configs(gpu_bench):
    parts = sys.modules["gpu_bench_parts"]  # the script's helper module, beside it
    llama = parts.make_config("llama3.1-8b", "real")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    qwen = parts.make_config("qwen3-8b", "real")
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim, qwen.intermediate_size, qwen.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    rope = getattr(llama, "rope_parameters", None) or {"rope_theta": llama.rope_theta}
    assert rope["rope_theta"] == 500000.0
    # prefill FLOPs: 2 x non-embedding params x tokens, causal attention 2 L H D T^2, the LM head once
    sz = {"params_nonembedding": 6.98e9, "layers": 32, "heads": 32, "head_dim": 128, "lm_head_params": 4096 * 128256}
    assert parts.prefill_flops(sz, 4096) == pytest.approx(
        2 * 6.98e9 * 4096 + 2 * 32 * 32 * 128 * 4096 ** 2 + 2 * 4096 * 128256)


def test_make_gpu_bench_runs_the_script():
    if shutil.which("make") is None:
        pytest.skip("GNU make is not installed")
    out = subprocess.run(["make", "-n", "gpu-bench"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "scripts/gpu_bench.py --out gpu-bench-results" in out


def test_limits_against_the_card(gpu_bench, monkeypatch):
    """What the GPU run derives, on made-up timings: the card by name, MFU, HBM use, the ratios."""
    parts = sys.modules["gpu_bench_parts"]
    for name, peak, bw in (("NVIDIA H100 80GB HBM3", 989e12, 3.35e12), ("NVIDIA H200", 989e12, 4.8e12),
                           ("NVIDIA H100 PCIe", 756e12, 2.0e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        card = parts.card_of(torch.device("cuda"))
        assert (card["bf16_peak_flops"], card["hbm_bytes_per_s"]) == (peak, bw), name
    card = {"bf16_peak_flops": 1e15, "hbm_bytes_per_s": 4e12}
    sz = {"params_nonembedding": 7e9, "layers": 32, "heads": 32, "head_dim": 128, "lm_head_params": 5e8}
    m = {"config": sz,
         "ttft": {"8": {"prompt_tokens": 4160, "ragkv_full": {"median_s": 0.5}, "hf_sdpa": {"median_s": 0.4},
                        "device_held": {"reuse": {"median_s": 0.05}, "blend": {"median_s": 0.1}}}},
         "decode": {"8": {"prompt_tokens": 4160, "1": {"tokens_per_s": 50.0, "bytes_per_s": 2e12,
                                                       "pooled": {"tokens_per_s": 150.0}},
                          "32": {"tokens_per_s": 800.0, "bytes_per_s": 3e12}}},
         "generate_static": {"8": {"decode_tokens_per_s": 25.0}},
         "generate_compiled": {"8": {"decode_tokens_per_s": 100.0}},
         "generate_compiled_batches": {"8": {"32": {"decode_tokens_per_s": 1600.0}}}}
    parts.derive(m, card)
    flops = parts.prefill_flops(sz, 4160)
    assert m["limits"]["mfu"]["ragkv_full@8"]["mfu"] == pytest.approx(flops / 0.5 / 1e15)
    assert m["limits"]["mfu"]["hf_sdpa@8"]["mfu"] == pytest.approx(flops / 0.4 / 1e15)
    assert m["limits"]["decode_bandwidth_util"]["8/b1"] == pytest.approx(0.5)
    r = m["ratios"]["8"]
    assert r["device_held"] == {"reuse/full": pytest.approx(0.1), "blend/full": pytest.approx(0.2)}
    assert r["ragkv_full/hf_sdpa"] == pytest.approx(1.25) and r["ragkv_decode/generate_static@b1"] == 2.0
    # the pool's step, and the compiled generate baseline (issue 70's "1.0x compiled generate")
    assert r["ragkv_pooled/generate_static@b1"] == 6.0 and r["ragkv_pooled/generate_compiled@b1"] == 1.5
    assert r["ragkv_decode/generate_compiled@b1"] == 0.5 and r["ragkv_decode/generate_compiled@b32"] == 0.5
    assert "ragkv_pooled/generate_compiled@b32" not in r  # no pooled figure at 32: no ratio made up


def test_sections_choose_what_runs_and_name_what_is_wrong(gpu_bench, capsys) -> None:
    assert gpu_bench.parse(["--out", "x", "--sections", "decode,profile"]).sections == ["decode", "profile"]
    assert gpu_bench.parse(["--out", "x"]).sections == list(gpu_bench.SECTIONS)
    with pytest.raises(SystemExit):
        gpu_bench.parse(["--out", "x", "--sections", "decode,tier"])
    assert "unknown section(s) tier" in capsys.readouterr().err


def test_every_gpu_bench_command_in_the_docs_parses(gpu_bench) -> None:
    """The `python scripts/gpu_bench.py ...` lines of README.md and docs/*.md, as the docs give
    them (continuation lines joined), parse with the script's own parser."""
    import re
    import shlex

    found = []
    for doc in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))):
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("python scripts/gpu_bench.py"):
                    found.append((doc.name, shlex.split(line)[2:]))
    assert found, "the docs give no gpu_bench command"
    for name, argv in found:
        try:
            gpu_bench.parse([a.replace("$OUT", "/tmp/out") for a in argv])
        except SystemExit:
            pytest.fail(f"{name}: python scripts/gpu_bench.py {' '.join(argv)} does not parse")
