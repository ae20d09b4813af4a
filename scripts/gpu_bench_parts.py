"""The parts of scripts/gpu_bench.py that are not the measurements themselves: ragkv importable
from a bare checkout, the random-weight models, the budget and timing, and the derived figures
(MFU, bandwidth utilisation, ratios) and the printed table.

Imports only the standard library at import time: torch, transformers and ragkv when called.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Dense bf16 peak FLOP/s and HBM bytes/s by a piece of the card's name, the first that matches
# (NVIDIA's data sheets: the SXM cards 989 TFLOP/s, H100 3.35 TB/s, H200 4.8 TB/s).
CARDS = (("H200 NVL", 835e12, 4.8e12), ("H200", 989e12, 4.8e12), ("H100 NVL", 835e12, 3.9e12),
         ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12))

# name -> (config class, real dims, rope parameters)
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": ("Qwen3Config", dict(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643, eos_token_id=151645),
        {"rope_type": "default", "rope_theta": 1000000.0}),
}
# --shape tiny: the same families (Qwen3 keeps its q/k norms), a few layers and small dims
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2)

PREFIX_TOKENS, QUESTION_TOKENS = 32, 32  # the shared prefix (system prompt) and the question
MODES = ("reuse", "blend", "focus")  # the modes that read chunk KV (full reads none)


# ---------------------------------------------------------------- imports without an install


_BOOTSTRAPPED: list[list[str]] = []  # the first call's notes


def bootstrap() -> list[str]:
    """Make `ragkv.*` importable from this checkout without an install, and stand in for the
    modules kvstore imports that the GPU machine lacks (crc32c, boto3): returns what was done
    (once per process; later calls return the same notes)."""
    if _BOOTSTRAPPED:
        return _BOOTSTRAPPED[0]
    notes: list[str] = []
    _BOOTSTRAPPED.append(notes)
    try:
        installed = importlib.util.find_spec("ragkv.engine") is not None
    except ImportError:
        installed = False
    if not installed:  # the folders of this checkout are ragkv.* (pyproject's package-dir)
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        import ragkv

        if importlib.util.find_spec("ragkv.engine") is None:
            ragkv.__path__.append(str(REPO))
        notes.append("ragkv not installed: its folders imported from the checkout")
    if _missing("crc32c"):
        import zlib

        mod = types.ModuleType("crc32c")
        mod.__spec__ = importlib.machinery.ModuleSpec("crc32c", None)  # a stand-in that works: found
        mod.crc32c = lambda data, value=0: zlib.crc32(data, value)  # type: ignore[attr-defined]
        sys.modules["crc32c"] = mod
        notes.append("crc32c missing: the disk tier's checksums are zlib.crc32 (slower: disk reads are a lower bound)")
    if _missing("boto3") or _missing("botocore"):
        # only while kvstore is imported (its s3 tier imports them, and is never used here); then
        # they are missing again, for whatever else looks for them (transformers, accelerate)
        names = ("boto3", "botocore", "botocore.config", "botocore.exceptions")
        before = {name: sys.modules[name] for name in names if name in sys.modules}
        for name in names:
            sys.modules[name] = types.ModuleType(name)
        sys.modules["botocore.config"].Config = object  # type: ignore[attr-defined]
        exc = sys.modules["botocore.exceptions"]
        exc.BotoCoreError = type("BotoCoreError", (Exception,), {})  # type: ignore[attr-defined]
        exc.ClientError = type("ClientError", (Exception,), {})  # type: ignore[attr-defined]
        try:
            import ragkv.kvstore
        finally:
            for name in names:
                if name in before:
                    sys.modules[name] = before[name]
                else:
                    sys.modules.pop(name, None)
        notes.append("boto3 missing: stubbed while kvstore was imported (the s3 tier is not used)")
    return notes


def _missing(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is None
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


# ---------------------------------------------------------------- model


def make_config(name: str, shape: str) -> Any:
    import transformers

    cls_name, dims, rope = MODELS[name]
    kw: dict[str, Any] = dict(dims if shape == "real" else {**TINY, "tie_word_embeddings": False})
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = dict(rope)
    else:
        kw["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            kw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return getattr(transformers, cls_name)(**kw)


def build_model(cfg: Any, device: Any, dtype: Any, seed: int) -> Any:
    """Random weights of `cfg`'s shape, made on `device` in `dtype` (transformers' own init)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # transformers 4: torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return model


class NoTokenizer:
    """What the engine reads of a tokenizer when every token id is given: no chat template, no BOS."""

    chat_template = None
    bos_token_id = None
    eos_token_id = None

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("gpu_bench synthesizes token ids: there is no tokenizer")


def wrap(model: Any, cfg: Any, name: str, device: Any, dtype: Any, seed: int) -> Any:
    """The model as `load_model` hands it to the engine (loading.py's last steps), minus the tokenizer."""
    from ragkv.engine.family import Adapter
    from ragkv.engine.model_loading import LoadedModel, check_supported

    adapter = Adapter(model, check_supported(cfg))
    fp = hashlib.sha256(f"{json.dumps(cfg.to_dict(), sort_keys=True, default=str)} seed={seed}".encode()).hexdigest()
    return LoadedModel(
        spec=f"random:{name}", model_dir=Path(f"random-{name}"), model=model, tokenizer=NoTokenizer(cfg.vocab_size),
        fingerprint=fp, tokenizer_fingerprint="synthetic-token-ids", device=device, dtype=dtype,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, num_kv_heads=adapter.num_kv_heads,
        head_dim=adapter.head_dim, eos_token_ids=(), adapter=adapter)


def sizes(model: Any, lm: Any) -> dict[str, Any]:
    """Parameter counts and bytes: what the FLOP and bandwidth figures are computed from."""
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    elt = emb.element_size()
    nonembed = params - emb.numel() - (0 if tied else head.numel())
    return {"params": params, "params_nonembedding": nonembed, "param_bytes": params * elt, "tied": tied,
            # one decode step reads every weight but the embedding table (B of its rows)
            "decode_weight_bytes": (params - (0 if tied else emb.numel())) * elt,
            "lm_head_params": head.numel(), "kv_bytes_per_token": 2 * lm.kv_layers * lm.num_kv_heads * lm.head_dim * elt,
            "layers": lm.num_layers, "heads": lm.num_heads, "kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim,
            "hidden": model.config.hidden_size, "vocab": head.shape[0]}


def prefill_flops(sz: dict[str, Any], tokens: int) -> float:
    """2 x non-embedding params x tokens, causal attention (QK^T and PV: 2 L H D T^2), the LM head once."""
    return (2.0 * sz["params_nonembedding"] * tokens + 2.0 * sz["layers"] * sz["heads"] * sz["head_dim"] * tokens ** 2
            + 2.0 * sz["lm_head_params"])


# ---------------------------------------------------------------- timing, budget, results


class Budget:
    def __init__(self, seconds: float, parent: Budget | None = None) -> None:
        self.deadline = time.monotonic() + seconds
        if parent is not None:
            self.deadline = min(self.deadline, parent.deadline)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


class Run:
    """Results, skips and errors of one run, written to DIR/gpu_bench.json as they come."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.path = out / "gpu_bench.json"
        self.data: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "env": {}, "models": {},
                                     "skipped": [], "errors": []}
        self.t0 = time.monotonic()

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append({"what": what, "why": why})
        print(f"  skipped {what}: {why}", flush=True)

    def error(self, what: str, exc: BaseException) -> None:
        self.data["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc(limit=8)})
        print(f"  ERROR in {what}: {type(exc).__name__}: {exc}", flush=True)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any) -> tuple[float, float | None, Any]:
    """(wall seconds with the device synchronized at both ends, CUDA-event seconds or None, fn's result)."""
    import torch

    sync(device)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
    t = time.perf_counter()
    if ev:
        ev[0].record()
    res = fn()
    if ev:
        ev[1].record()
    sync(device)
    wall = time.perf_counter() - t
    return wall, (ev[0].elapsed_time(ev[1]) / 1e3 if ev else None), res


class Section:
    """Runs measurements of one model under a budget: warm-up, then the median of repeats."""

    def __init__(self, run: Run, budget: Budget, device: Any, repeats: int, warmup: int = 1) -> None:
        self.run, self.budget, self.device, self.repeats, self.warmup = run, budget, device, repeats, warmup

    def measure(self, what: str, fn: Callable[[], Any], setup: Callable[[], Any] | None = None,
                est_s: float | None = None, note: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """Median of `repeats` timed calls of `fn` after `warmup` ones (`setup` runs untimed before
        each); None when it does not fit the budget (recorded). `note(result)` adds fields."""
        n = self.warmup + self.repeats
        if est_s is not None and not self.budget.fits(est_s * n):
            self.run.skip(what, f"needs ~{est_s * n:.1f} s, {max(0.0, self.budget.left()):.1f} s of the budget left")
            return None
        times: list[float] = []
        gpu: list[float] = []
        res = None
        for i in range(n):
            if setup is not None:
                setup()
            wall, ev, res = timed(fn, self.device)
            if i >= self.warmup:
                times.append(wall)
                if ev is not None:
                    gpu.append(ev)
            if i + 1 < n and not self.budget.fits(wall * (n - i - 1)):
                if not times:
                    times.append(wall)  # the warm-up's time is all there is
                self.run.skip(f"{what} (repeats after {i + 1})", "budget")
                break
        out: dict[str, Any] = {"median_s": statistics.median(times), "times_s": [round(t, 6) for t in times]}
        if gpu:
            out["gpu_event_median_s"] = statistics.median(gpu)
        if note is not None and res is not None:
            out.update(note(res))
        return out

    def guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one section; an error or out-of-memory is recorded and the run goes on."""
        import torch

        if self.budget.left() <= 0:
            self.run.skip(what, "the budget is spent")
            return None
        t = time.monotonic()
        print(f"  {what} ({self.budget.left():.0f} s left)", flush=True)
        try:
            return fn()
        except torch.cuda.OutOfMemoryError as exc:
            self.run.skip(what, f"out of GPU memory: {str(exc).splitlines()[0][:200]}")
        except Exception as exc:  # one lent run: record it, measure the rest
            self.run.error(what, exc)
        finally:
            self.run.data.setdefault("section_s", {})[what] = round(time.monotonic() - t, 3)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return None


class Stamps:
    """A transformers streamer (`put` for the prompt, then per new token; `end`) that notes when each came."""

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = stamps

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_forward(model: Any, x: Any) -> Any:
    import torch

    with torch.inference_mode():
        try:
            return model(input_ids=x, use_cache=True, logits_to_keep=1).logits
        except TypeError:  # older transformers
            return model(input_ids=x, use_cache=True).logits[:, -1]


def set_attn(model: Any, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def filesystem_of(path: str) -> dict[str, str]:
    """The mount point and filesystem type `path` is on (from /proc/mounts; empty where there is none):
    a tmpfs "disk" would be memory."""
    best: tuple[str, str] = ("", "")
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")) \
                        and len(fields[1]) >= len(best[0]):
                    best = (fields[1], fields[2])
    except OSError:
        pass
    return {"mount": best[0], "fstype": best[1]} if best[0] else {}


def drop_page_cache(root: str) -> None:
    """Evict the tier's files from the page cache, so the next read comes from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    for p in Path(root).rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- limits, ratios, table


def card_of(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {"name": platform.processor() or "cpu", "bf16_peak_flops": None, "hbm_bytes_per_s": None}
    name = torch.cuda.get_device_name(device)
    for key, flops, bw in CARDS:
        if key in name:
            return {"name": name, "matched": key, "bf16_peak_flops": flops, "hbm_bytes_per_s": bw}
    return {"name": name, "bf16_peak_flops": None, "hbm_bytes_per_s": None, "note": "unknown card: no peak figures"}


def derive(m: dict[str, Any], card: dict[str, Any]) -> None:
    """MFU, bandwidth utilisation and the ratios, from what was measured."""
    sz, peak, bw = m.get("config", {}), card["bf16_peak_flops"], card["hbm_bytes_per_s"]
    ratios: dict[str, Any] = {}
    limits: dict[str, Any] = {"mfu": {}, "decode_bandwidth_util": {}}
    for c, t in m.get("ttft", {}).items():
        full = t.get("ragkv_full", {}).get("median_s")
        if not full:
            continue
        flops = prefill_flops(sz, t["prompt_tokens"])
        r: dict[str, Any] = {}
        for key, v in t.items():
            if isinstance(v, dict) and "median_s" in v and key.startswith(("ragkv_", "hf_")):
                tf = flops / v["median_s"]
                limits["mfu"][f"{key}@{c}"] = {"tflops": tf / 1e12, "mfu": tf / peak if peak else None}
        for tier, modes in t.items():
            if isinstance(modes, dict) and any(mo in modes for mo in MODES):
                r[tier] = {f"{mo}/full": modes[mo]["median_s"] / full for mo in MODES if mo in modes}
        for key in ("hf_sdpa", "hf_flash_attention_2"):
            if key in t:
                r[f"ragkv_full/{key}"] = full / t[key]["median_s"]
        ratios[c] = r
    for c, d in m.get("decode", {}).items():
        for b, v in d.items():
            if isinstance(v, dict):
                limits["decode_bandwidth_util"][f"{c}/b{b}"] = v["bytes_per_s"] / bw if bw else None
    # ours (ragged decode_batch, and the pool's step: graphs on CUDA) over transformers' generate,
    # eager and compiled, at each batch both ran
    for label in ("static", "compiled"):
        gens = {c: {"1": g} for c, g in m.get(f"generate_{label}", {}).items()}
        for c, gs in m.get(f"generate_{label}_batches", {}).items():
            gens.setdefault(c, {}).update(gs)
        for c, gs in gens.items():
            for b, g in gs.items():
                ours = m.get("decode", {}).get(c, {}).get(b)
                if not ours:
                    continue
                r = ratios.setdefault(c, {})
                r[f"ragkv_decode/generate_{label}@b{b}"] = ours["tokens_per_s"] / g["decode_tokens_per_s"]
                pooled = ours.get("pooled", {})
                if "tokens_per_s" in pooled:
                    r[f"ragkv_pooled/generate_{label}@b{b}"] = pooled["tokens_per_s"] / g["decode_tokens_per_s"]
    for c, tr in m.get("kv_transfer", {}).items():
        limits.setdefault("kv_GB_per_s", {})[c] = {k: v["GB_per_s"] for k, v in tr.items() if isinstance(v, dict)}
    m["ratios"], m["limits"] = ratios, limits


def table(data: dict[str, Any]) -> str:
    lines = [f"device: {data['env'].get('card', {}).get('name')}  dtype {data['args']['dtype']}"]
    for name, m in data["models"].items():
        for c, t in m.get("ttft", {}).items():
            full = t.get("ragkv_full", {}).get("median_s")
            if not full:
                continue
            lines.append(f"\n{name} ({m.get('shape')}) {c} chunks x {data['args']['chunk_tokens']} tokens, "
                         f"prompt {t['prompt_tokens']}: TTFT ms (x of ragkv full {full * 1e3:.1f} ms)")
            tiers = [k for k, v in t.items() if isinstance(v, dict) and any(mo in v for mo in MODES)]
            heads = [k.replace("_controller_", " ctl ").replace("_page_cache", " warm")[:26] for k in tiers]
            lines.append("  " + "mode".ljust(7) + "".join(h.rjust(28) for h in heads))
            for mo in MODES:
                cells = [f"{t[k][mo]['median_s'] * 1e3:9.1f} ({t[k][mo]['median_s'] / full:5.2f})" if mo in t[k] else "-"
                         for k in tiers]
                lines.append("  " + mo.ljust(7) + "".join(x.rjust(28) for x in cells))
            for key in ("hf_sdpa", "hf_flash_attention_2"):
                if key in t:
                    lines.append(f"  transformers {key[3:]} prefill {t[key]['median_s'] * 1e3:.1f} ms: "
                                 f"ragkv full / transformers = {full / t[key]['median_s']:.2f}")
            for k, v in m.get("limits", {}).get("mfu", {}).items():
                if k.endswith(f"@{c}") and v["mfu"] is not None:
                    lines.append(f"  MFU {k}: {v['mfu'] * 100:.1f}% ({v['tflops']:.0f} TFLOP/s)")
            for k, v in m.get("limits", {}).get("kv_GB_per_s", {}).get(c, {}).items():
                lines.append(f"  KV to device {k}: {v:.2f} GB/s")
        for c, d in m.get("decode", {}).items():
            row = [f"b{b} {v['tokens_per_s']:.0f} tok/s ({v['step_s'] * 1e3:.1f} ms/step"
                   + (f", {m['limits']['decode_bandwidth_util'][f'{c}/b{b}'] * 100:.0f}% HBM"
                      if m.get("limits", {}).get("decode_bandwidth_util", {}).get(f"{c}/b{b}") else "") + ")"
                   for b, v in d.items() if isinstance(v, dict)]
            lines.append(f"{name} decode over {d['prompt_tokens']} tokens: " + "; ".join(row))
        for c, r in m.get("ratios", {}).items():
            for label in ("static", "compiled"):
                gens = {"1": m[f"generate_{label}"][c]} if c in m.get(f"generate_{label}", {}) else {}
                gens |= m.get(f"generate_{label}_batches", {}).get(c, {})
                for b, g in gens.items():
                    if f"ragkv_decode/generate_{label}@b{b}" not in r:
                        continue
                    pooled = r.get(f"ragkv_pooled/generate_{label}@b{b}")
                    lines.append(f"{name} generate {label} b{b} {g['decode_tokens_per_s']:.1f} tok/s (its TTFT "
                                 f"{g['ttft_s'] * 1e3:.1f} ms): ragkv decode / generate {label} = "
                                 f"{r[f'ragkv_decode/generate_{label}@b{b}']:.2f}"
                                 + (f", pooled {pooled:.2f}" if pooled is not None else ""))
            held = r.get("device_held", {})
            parts = [f"{k} {v:.2f}" for k, v in held.items()] + [
                f"{k} {v:.2f}" for k, v in r.items() if k.startswith(("ragkv_full/", "ragkv_decode/", "ragkv_pooled/"))]
            if parts:
                lines.append(f"{name} ratios at {c} chunks (KV held on the device): " + ", ".join(parts))
        if "check" in m:
            ck = m["check"]
            lines.append(f"{name} check blend@1.0 vs full: max|d| {ck['max_abs_diff']:.3g} "
                         f"{'OK' if ck['ok'] else 'MISMATCH'}")
        if "check_pieces" in m:
            ck = m["check_pieces"]
            lines.append(f"{name} check full in pieces of {m.get('step_tokens')} rows vs whole layers: "
                         f"max|d| {ck['max_abs_diff']:.3g} {'OK' if ck['ok'] else 'MISMATCH'}")
    if data["skipped"]:
        lines.append(f"\nskipped {len(data['skipped'])}: " + "; ".join(s["what"] for s in data["skipped"][:12]))
    if data["errors"]:
        lines.append(f"errors {len(data['errors'])}: " + "; ".join(e["what"] for e in data["errors"]))
    return "\n".join(lines)


# ---------------------------------------------------------------- results and arguments


def describe(res: Any) -> dict[str, Any]:
    out = {"recompute_fraction": round(float(res.recompute_fraction), 4), "prompt_tokens": res.n_prompt_tokens,
           "phases_s": {k: round(v, 6) for k, v in res.timings.items()}}
    if res.used_chunks is not None:
        out["used_chunks"] = len(res.used_chunks)
        out["handed_over"] = res.handed_over
    return out


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


SECTIONS = ("hf", "decode", "generate", "profile", "side", "tiers", "transfers")


def sections(s: str) -> list[str]:
    got = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in got if x not in SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(bad)}; of {', '.join(SECTIONS)}")
    return got


def generate_modes(s: str) -> list[str]:
    got = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in got if x not in ("eager", "compiled")]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"generate modes are eager and compiled, got {s!r}")
    return got


def ints_or_none(s: str) -> list[int]:
    return [] if s.strip().lower() == "none" else ints(s)
