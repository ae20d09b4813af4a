"""The GPU path, measured: ragkv's TTFT, decode and KV loads on random weights of a real shape.

One run (at most `--budget-s`, 480 s by default) per model of `--models` (Llama 3.1 8B, Qwen3 8B):
- builds the model from a transformers config with random weights, on the device, in bfloat16
  (nothing downloaded, no tokenizer: token ids are synthesized);
- checks that blend at recompute ratio 1.0 gives full prefill's logits (printed, in the JSON);
- TTFT of full, reuse, blend 0.15 and focus (default FocusOptions) at each `--chunks` count of
  `--chunk-tokens` tokens, the chunks' KV held in the GPU, in pinned CPU memory (kvstore's cpu
  tier) and on local disk (kvstore's disk tier, page cache dropped before each read: layered and
  whole reads, the loading controller on and off); warm-up first, median of `--repeats`;
- decode tokens/s at batch 1, 8, 32, 64 over those prompts (`decode_batch`, one step for all), and the
  same over one KV pool with a CUDA graph per batch bucket (`engine.decode_graphs`, `--cuda-graphs`);
- baselines on the same weights: transformers' prefill (`model(input_ids)`, sdpa, and
  flash_attention_2 when importable) and `model.generate(cache_implementation="static")`, eager
  and compiled (transformers' own torch.compile over the static cache, last: it takes a while);
- 4 and 8 requests' reuse and blend passes side by side (each layer run once for all of them,
  the scheduler's --prompt-batch-rows) against one after another;
- int4 KV files (KIVI) on the disk tier, read layer by layer, cold and through the page cache;
- physical limits: MFU of full prefill against the card's dense bf16 peak, decode bandwidth
  utilisation against its HBM bandwidth, KV bytes per second CPU->GPU and disk->GPU.
Everything goes to DIR/gpu_bench.json (rewritten after each section, so a run cut short
keeps what it measured); a table of the ratios goes to stdout. What did not fit the budget
or the memory is listed under "skipped", with why.

On the lent GPU machine (torch, transformers and safetensors; ragkv need not be installed,
no faiss, bm25s, llguidance, crc32c or boto3 needed), from the repository root:
    python scripts/gpu_bench.py --out $OUT/gpu-bench
(helpers in scripts/gpu_bench_parts.py). On this CPU, in well under a minute:
    python scripts/gpu_bench.py --shape tiny --device cpu --chunks 2 --chunk-tokens 32 --out /tmp/gb
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESERVE_S = 10.0  # of --budget-s, kept for the ratios, the table and cleaning up
COMPILE_EST_S = 90.0  # what generate()'s torch.compile of an 8B model is budgeted for, on its warm-up run
_STARTED = time.monotonic()
if str(Path(__file__).resolve().parent) not in sys.path:  # gpu_bench_parts, beside this file
    sys.path.append(str(Path(__file__).resolve().parent))
from gpu_bench_parts import (  # noqa: E402 - after sys.path names this folder (run as a script)
    MODELS,
    MODES,
    PREFIX_TOKENS,
    QUESTION_TOKENS,
    SECTIONS,
    Budget,
    Run,
    Section,
    Stamps,
    bootstrap,
    build_model,
    card_of,
    derive,
    describe,
    drop_page_cache,
    filesystem_of,
    generate_modes,
    hf_forward,
    ints,
    ints_or_none,
    make_config,
    sections,
    set_attn,
    sizes,
    sync,
    table,
    timed,
    wrap,
)

# ---------------------------------------------------------------- the bench of one model


class ModelBench:
    def __init__(self, run: Run, args: argparse.Namespace, name: str, budget: Budget) -> None:
        import torch

        self.run, self.args, self.name = run, args, name
        self.device = torch.device(args.device)
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
        self.sec = Section(run, budget, self.device, args.repeats)
        self.out: dict[str, Any] = run.data["models"].setdefault(name, {"shape": args.shape})
        self.full_s: dict[int, float] = {}  # ragkv full TTFT per chunk count: the scale of estimates
        self.stores: list[Any] = []
        self.tmp: list[str] = []

    # ---- setup
    def build(self) -> None:
        from ragkv.engine import Engine

        cfg = make_config(self.name, self.args.shape)
        t, _, model = timed(lambda: build_model(cfg, self.device, self.dtype, self.args.seed), self.device)
        self.lm = wrap(model, cfg, self.name, self.device, self.dtype, self.args.seed)
        self.eng, self.model = Engine(self.lm), model
        if self.args.step_tokens is not None:
            self.eng.step_tokens = self.args.step_tokens
        self.sz = sizes(model, self.lm)
        self.out.update(build_s=round(t, 3), config={"class": type(cfg).__name__, **self.sz})
        print(f"[{self.name}] {self.sz['params'] / 1e9:.2f} B params built on {self.device} in {t:.1f} s", flush=True)
        import torch

        g = torch.Generator().manual_seed(self.args.seed)
        v = self.sz["vocab"]
        rand = lambda n: torch.randint(3, v, (n,), generator=g).tolist()  # noqa: E731 - a one-line sampler beside its use
        self.prefix_ids, self.question_ids = rand(PREFIX_TOKENS), rand(QUESTION_TOKENS)
        self.chunk_ids = [rand(self.args.chunk_tokens) for _ in range(max(self.args.chunks))]

    def full_ids(self, c: int) -> list[int]:
        return [*self.prefix_ids, *(t for ids in self.chunk_ids[:c] for t in ids), *self.question_ids]

    def precompute(self) -> None:
        """Every chunk's KV after the prefix (the indexer's work), timed: the engine's prefill rate."""
        eng, n = self.eng, self.args.chunk_tokens
        eng.prefix_kv(self.prefix_ids)
        times, self.kvs = [], []
        for i, ids in enumerate(self.chunk_ids):
            t, _, kv = timed(lambda ids=ids: eng.prefill(self.prefix_ids, ids), self.device)
            self.kvs.append(kv)
            if i:  # the first is the warm-up
                times.append(t)
                eng.speed.observe(n, t)  # what the server's warm-up seeds the loading controller with
        med = statistics.median(times) if times else t
        self.out["chunk_prefill"] = {"chunk_tokens": n, "median_s": med, "tokens_per_s": n / med}

    # ---- correctness
    def check(self) -> None:
        import torch

        from ragkv.engine import BlendOptions, Prompt
        from ragkv.types import Mode

        c = min(self.args.chunks)
        full = self.eng.run(Prompt(self.full_ids(c)), Mode.FULL).logits.float()
        blend = self.eng.run(self._prompt(c, self.kvs[:c]), Mode.BLEND, BlendOptions(recompute_ratio=1.0)).logits.float()
        step, given = self.eng.step_rows(), self.eng.step_tokens  # (sized from the chunks' prefill rate)
        self.out["step_tokens"] = step
        self.eng.step_tokens = 0  # full prefill a whole layer per step
        whole = self.eng.run(Prompt(self.full_ids(c)), Mode.FULL).logits.float()
        self.eng.step_tokens = given
        scale = float(full.abs().max())
        tol = 1e-4 if self.dtype == torch.float32 else 2e-2 * max(1.0, scale)
        self.out["check"] = self._compare("blend at recompute ratio 1.0 vs full prefill, next-token logits",
                                          c, blend, full, scale, tol)
        # another kernel's sums of the same math (transformers' forward): the noise floor of this dtype
        hf = self.model(torch.tensor([self.full_ids(c)], device=self.device)).logits[0, -1].float()
        self.out["check_hf"] = self._compare("transformers' forward vs full prefill in whole layers, next-token "
                                             "logits", c, hf.to(whole.device), whole, scale, float("inf"))
        floor = self.out["check_hf"]["max_abs_diff"]
        # pieces multiply matrices of other row counts than whole layers: other rounding, which random
        # weights carry through every layer (H200, Llama 3.1 8B shape, 8 chunks: 1.5e-4 of |logit| 5.6
        # in float32, 0.26 of 5.8 in bfloat16, argmax equal; the kernels themselves agree with a masked call)
        piece_tol = max(2 * floor, (1e-4 if self.dtype == torch.float32 else 5e-2) * max(1.0, scale))
        self.out["check_pieces"] = self._compare(
            f"full prefill in pieces of {step} rows vs whole layers, next-token logits", c, full, whole, scale,
            piece_tol)

    def _compare(self, what: str, c: int, a: Any, b: Any, scale: float, tol: float) -> dict[str, Any]:
        import torch

        diff = float((a - b).abs().max())
        finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
        ok = finite and diff <= tol
        print(f"[{self.name}] check: {what}: max|d| {diff:.3g} (|logit| max {scale:.3g}, tol {tol:.3g}"
              f"{'' if finite else ', NOT FINITE'}) {'OK' if ok else 'MISMATCH'}", flush=True)
        return {"what": what, "chunks": c, "max_abs_diff": diff, "max_abs_logit": scale, "tolerance": tol,
                "finite": finite, "argmax_equal": bool(int(a.argmax()) == int(b.argmax())), "ok": ok}

    def _prompt(self, c: int, kvs: list[Any]) -> Any:
        from ragkv.engine import Prompt

        return Prompt(self.question_ids, self.prefix_ids, self.chunk_ids[:c], kvs)

    def _options(self, mode: str) -> Any:
        from ragkv.engine import BlendOptions, FocusOptions

        return BlendOptions(recompute_ratio=self.args.ratio, focus=FocusOptions())

    # ---- TTFT
    def ttft(self, c: int) -> None:
        from ragkv.types import Mode

        t = self.out.setdefault("ttft", {}).setdefault(str(c), {})
        t["prompt_tokens"] = len(self.full_ids(c))
        t["chunk_kv_bytes"] = sum(kv.nbytes for kv in self.kvs[:c])
        ids = self.full_ids(c)
        full = self.sec.measure(f"{self.name} c{c} ragkv full",
                                lambda: self.eng.run(self._full_prompt(ids), Mode.FULL).logits.float().cpu())
        if full is None:
            return
        t["ragkv_full"] = full
        self.full_s[c] = full["median_s"]
        self.eng.speed.observe_prompt(Mode.FULL, len(ids), full["median_s"])  # as the scheduler learns it
        # the chunks' KV in device memory: on CUDA read from kvstore's gpu tier (a hit hands over the
        # tensors as they are); without CUDA there is no gpu tier, and the engine gets them directly
        held: dict[str, Any] = {"via": "kvstore gpu tier" if self.device.type == "cuda" else "ChunkKV on the device"}
        if self.device.type == "cuda":
            from ragkv.server.loading_controller import ControllerConfig, LoadingController

            store, keys = self.store("gpu")
            off = LoadingController(ControllerConfig(enabled=False), self.eng.speed)
            one = lambda mode: self._tier_pass(store, keys[:c], c, mode, False, off)[0]  # noqa: E731 - the pass timed, named for the timer
        else:
            one = lambda mode: self.eng.run(self._prompt(c, self.kvs[:c]), Mode(mode), self._options(mode))  # noqa: E731 - the pass timed, named for the timer
        for mode in MODES:
            m = self.sec.measure(f"{self.name} c{c} {mode} device-held KV", lambda mode=mode: one(mode),
                                 est_s=full["median_s"], note=describe)
            if m is not None:
                held[mode] = m
                self.eng.speed.observe_prompt(Mode(mode), len(ids), m["median_s"])  # the pass over KV at hand
        t["device_held"] = held
        self.run.save()

    def side_by_side(self, c: int, passes: tuple[int, ...] = (4, 8)) -> None:
        """N requests' prompt passes (reuse, blend) over the same c chunks with other questions, one
        after another against side by side (each layer they stand at together run as one forward:
        `drain_together`, the scheduler's --prompt-batch-rows): the seconds until all N are done."""
        import torch

        from ragkv.engine import Prompt
        from ragkv.engine.forward import drain_together
        from ragkv.engine.work import drain
        from ragkv.types import Mode

        g = torch.Generator().manual_seed(self.args.seed + 1)
        out = self.out.setdefault("side_by_side", {}).setdefault(str(c), {})
        for mode in ("reuse", "blend"):
            for n in passes:
                qs = [torch.randint(3, self.sz["vocab"], (QUESTION_TOKENS,), generator=g).tolist() for _ in range(n)]
                steps = lambda qs=qs, mode=mode: [  # noqa: E731 - the passes, built afresh for each timed call
                    self.eng.run_steps(Prompt(q, self.prefix_ids, self.chunk_ids[:c], self.kvs[:c]), Mode(mode),
                                       self._options(mode)) for q in qs]
                est = n * self.full_s.get(c, 1.0)
                one = self.sec.measure(f"{self.name} c{c} {mode} x{n} one by one",
                                       lambda steps=steps: [drain(p) for p in steps()], est_s=est)
                both = self.sec.measure(f"{self.name} c{c} {mode} x{n} side by side",
                                        lambda steps=steps: drain_together(steps()), est_s=est)
                if one is not None and both is not None:
                    out[f"{mode}_x{n}"] = {"one_by_one": one, "side_by_side": both,
                                           "speedup": one["median_s"] / both["median_s"]}
                    print(f"[{self.name}] c{c} {mode} x{n}: side by side {out[f'{mode}_x{n}']['speedup']:.2f}x "
                          f"one by one", flush=True)
        self.run.save()

    def _full_prompt(self, ids: list[int]) -> Any:
        from ragkv.engine import Prompt

        return Prompt(ids)

    def hf_prefill(self, c: int) -> None:
        import torch

        t = self.out["ttft"][str(c)]
        x = torch.tensor([self.full_ids(c)], device=self.device)
        impls = ["sdpa"]
        if importlib.util.find_spec("flash_attn") is not None and self.device.type == "cuda":
            impls.append("flash_attention_2")
        else:
            self.run.skip(f"{self.name} c{c} transformers flash_attention_2", "flash_attn is not importable here")
        built = getattr(self.model.config, "_attn_implementation", "sdpa")  # what build_model asked for
        for impl in impls:
            try:
                if impl != built:
                    set_attn(self.model, impl)
            except Exception as exc:
                self.run.skip(f"{self.name} c{c} transformers {impl}", f"cannot switch to it: {exc}")
                continue
            try:
                m = self.sec.measure(f"{self.name} c{c} transformers {impl} prefill", lambda: hf_forward(self.model, x),
                                     est_s=2 * self.full_s.get(c, 1.0))
            finally:
                if impl != built:
                    set_attn(self.model, built)
            if m is not None:
                t[f"hf_{impl}"] = m

    def tiers(self, c: int) -> None:
        """TTFT with the chunks' KV read from kvstore's cpu (pinned) and disk tiers, loads included:
        bf16 files, and int4 ones (KIVI, 0.31 of the bytes) read layer by layer, cold (page cache
        dropped) and through the page cache, the loading controller choosing read or recompute."""
        from ragkv.kvstore import Tier
        from ragkv.server.loading_controller import ControllerConfig, LoadingController

        t = self.out["ttft"][str(c)]
        est = self.full_s.get(c, 1.0) + t["chunk_kv_bytes"] / 2e9  # a pass and a read at 2 GB/s
        # (tier, compression, load, controller, page cache dropped before each read)
        variants = [("cpu", "none", "whole", False, False), ("cpu", "none", "whole", True, False),
                    ("disk", "none", "layered", False, True), ("disk", "none", "layered", True, True),
                    ("disk", "none", "whole", False, True),
                    ("disk", "int4", "layered", False, True), ("disk", "int4", "layered", True, True),
                    ("disk", "int4", "layered", True, False)]
        if self.args.quick:
            variants = [v for v in variants if not v[3]][:2] + [("disk", "none", "layered", True, True),
                                                               ("disk", "int4", "layered", True, False)]
        for tier, compression, load, ctl, cold in variants:
            store, keys = self.store(tier, compression)
            label = (f"{tier}{'' if compression == 'none' else '_' + compression}_{load}_controller_"
                     f"{'on' if ctl else 'off'}{'_page_cache' if tier == 'disk' and not cold else ''}")
            controller = LoadingController(ControllerConfig(enabled=ctl), self.eng.speed)
            root = getattr(self, f"_root_{compression}", None)
            setup = (lambda root=root: drop_page_cache(root)) if cold and root else None
            res: dict[str, Any] = {"tier": tier, "compression": compression, "load": load, "controller": ctl,
                                   "pinned": bool(tier == "cpu" and self.device.type == "cuda")}
            for mode in MODES:
                m = self.sec.measure(
                    f"{self.name} c{c} {mode} {label}",
                    lambda mode=mode, store=store, keys=keys, load=load, controller=controller: self._tier_pass(
                        store, keys[:c], c, mode, load == "layered", controller),
                    setup=setup, est_s=est, note=lambda r: {**describe(r[0]), "chunks_computed_not_read": r[1]})
                if m is not None:
                    res[mode] = m
            if tier == "disk":
                res["page_cache"] = ("dropped before each read (posix_fadvise DONTNEED)" if cold
                                     else "warm (the warm-up read it in)")
                res["filesystem"] = filesystem_of(root)
            est_read = store.read_estimate(Tier(tier))
            if est_read is not None:
                res["read_estimate"] = {"latency_s": est_read.latency_s, "bytes_per_s": est_read.bytes_per_s}
            t[label] = res
            self.run.save()

    def _tier_pass(self, store: Any, keys: list[Any], c: int, mode: str, layered: bool, controller: Any) -> Any:
        """One request as the server serves it: the controller decides, reads run while the chunks
        it chose to compute are prefilled, then the prompt pass; until the logits are on the host."""
        from ragkv.engine import ChunkKV
        from ragkv.types import Mode

        lm = self.lm
        decisions = controller.decide(store, keys, [len(ids) for ids in self.chunk_ids[:c]])
        if controller.prefers_full(decisions, Mode(mode), len(self.full_ids(c)), store.prefetch_workers, layered):
            res = self.eng.run(self._full_prompt(self.full_ids(c)), Mode.FULL)  # the controller's whole pass
            res.logits.float().cpu()
            return res, c
        handles = iter(store.prefetch([k for k, d in zip(keys, decisions) if d.load], layered=layered))
        computed = {i: self.eng.prefill(self.prefix_ids, self.chunk_ids[i]) for i, d in enumerate(decisions) if not d.load}
        kvs = []
        for i, d in enumerate(decisions):
            if d.load:
                hit = next(handles).hit()
                kvs.append(ChunkKV.from_stored(hit.entry, lm.device, lm.dtype, hit.layers))
            else:
                kvs.append(computed[i])
        res = self.eng.run(self._prompt(c, kvs), Mode(mode), self._options(mode))
        res.logits.float().cpu()
        return res, len(computed)

    def store(self, tier: str, compression: str = "none") -> tuple[Any, list[Any]]:
        """The store of one tier holding every chunk's KV (made once per model and compression:
        the disk tier's files are written `compression`-coded)."""
        from ragkv.kvstore import ChunkKey, KVEntry, StoreConfig, TieredStore, hash_prefix

        cached = getattr(self, f"_store_{tier}_{compression}", None)
        if cached is not None:
            return cached
        lm = self.lm
        uri = tier
        if tier == "disk":
            root = tempfile.mkdtemp(prefix="ragkv-gpu-bench-", dir=self.args.disk_dir)
            setattr(self, f"_root_{compression}", root)
            self.tmp.append(root)
            uri = f"disk:{root}"
        store = TieredStore(StoreConfig.from_uris([uri], compression=compression), lm.fingerprint,
                            lm.tokenizer_fingerprint)
        self.stores.append(store)
        keys = []
        t0 = time.perf_counter()
        for ids, kv in zip(self.chunk_ids, self.kvs):
            key = ChunkKey.build(lm.fingerprint, lm.tokenizer_fingerprint, self.prefix_ids, ids)
            held = kv if tier == "gpu" else kv.to("cpu")
            store.put(KVEntry.of(held, key, lm.fingerprint, lm.tokenizer_fingerprint, hash_prefix(self.prefix_ids)))
            keys.append(key)
        self.out.setdefault("store_put_s", {})[tier if compression == "none" else f"{tier}_{compression}"] = round(
            time.perf_counter() - t0, 3)
        setattr(self, f"_store_{tier}_{compression}", (store, keys))
        return store, keys

    def transfers(self, c: int) -> None:
        """KV bytes per second into the device: a raw pinned copy, the cpu tier and the disk tier
        (page cache dropped, and warm), each until every chunk's KV is on the device."""
        import torch

        from ragkv.engine import ChunkKV

        lm, nbytes = self.lm, sum(kv.nbytes for kv in self.kvs[:c])
        out = self.out.setdefault("kv_transfer", {}).setdefault(str(c), {"bytes": nbytes})
        est = nbytes / 1e9 + 0.05

        def rate(m: dict[str, Any] | None, key: str) -> None:
            if m is not None:
                out[key] = {**m, "GB_per_s": nbytes / m["median_s"] / 1e9}

        if self.device.type == "cuda":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            rate(self.sec.measure(f"{self.name} c{c} raw pinned->GPU copy",
                                  lambda: host.to(self.device, non_blocking=True), est_s=est), "raw_pinned_copy")
            del host
        for tier, cold in (("cpu", False), ("disk", True), ("disk", False)):
            store, keys = self.store(tier)

            def load(store: Any = store, keys: list[Any] = keys) -> list[Any]:
                hits = [h.hit() for h in store.prefetch(keys[:c])]
                return [ChunkKV.from_stored(h.entry, lm.device, lm.dtype) for h in hits]

            setup = (lambda: drop_page_cache(self._root_none)) if cold else None
            name = f"{tier}_to_device" + ("_cold" if cold else "_page_cache" if tier == "disk" else "")
            rate(self.sec.measure(f"{self.name} c{c} {name}", load, setup=setup, est_s=est), name)
        self.run.save()

    # ---- decode
    def decode(self, c: int) -> None:
        import torch

        from ragkv.engine.decode import decode_batch, pick_greedy
        from ragkv.types import Mode

        lm, steps, warm = self.lm, self.args.decode_steps, 2
        base = self.eng.run(self._full_prompt(self.full_ids(c)), Mode.FULL, reserve_tokens=0)
        n = base.n_prompt_tokens
        out = self.out.setdefault("decode", {}).setdefault(str(c), {"prompt_tokens": n, "steps": steps})
        kv_bpt = self.sz["kv_bytes_per_token"]
        for b in self.args.batches:
            what = f"{self.name} c{c} decode batch {b}"
            need = b * (n + steps + warm + 1) * kv_bpt
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
                if need > free - 2 * 2**30:
                    self.run.skip(what, f"its caches need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                    continue
            per_step = (self.full_s.get(c, 1.0) * 0.05 + 0.002 * b)
            # ragged, then pooled (and its captures): about 2 runs
            if not self.sec.budget.fits(2 * per_step * (steps + warm) + 1.0):
                self.run.skip(what, f"~{2 * per_step * (steps + warm):.1f} s, {self.sec.budget.left():.1f} s left")
                continue

            def body(b: int = b) -> dict[str, Any]:
                caches = self._copies(base, b, steps + warm + 1)
                tokens = [int(base.logits.argmax())] * b
                times, firsts = [], []  # firsts: row 0's token each step, which the pooled arm must repeat
                for i in range(warm + steps):
                    sync(self.device)
                    t = time.perf_counter()
                    with torch.inference_mode():  # the host reads each step's tokens, as the scheduler does
                        tokens = pick_greedy(decode_batch(lm, caches, tokens))
                    if i >= warm:
                        times.append(time.perf_counter() - t)
                    firsts.append(tokens[0])
                step = statistics.median(times)
                mean_len = n + warm + steps / 2
                read = self.sz["decode_weight_bytes"] + b * mean_len * kv_bpt  # weights once, every sequence's KV
                row = {"step_s": step, "step_mean_s": statistics.mean(times), "tokens_per_s": b / step,
                       "tokens_per_s_per_sequence": 1 / step, "bytes_per_step": read, "bytes_per_s": read / step}
                del caches
                row["pooled"] = self._pooled_decode(base, n, b, steps, warm, step, firsts)
                return row

            r = self.sec.guard(what, body)
            if r is not None:
                out[str(b)] = r
            self.run.save()

    def _copies(self, base: Any, b: int, room: int) -> list[Any]:
        """b decode caches, each a copy of the prompt `base`'s KV with room for `room` more tokens."""
        from ragkv.engine.kv.cache import KVCache

        lm, n = self.lm, base.n_prompt_tokens
        caches = []
        for _ in range(b):
            kc = KVCache(lm.kv_layers, lm.num_kv_heads, lm.head_dim, n + room, lm.dtype, lm.device)
            kc.k[:, :, :n].copy_(base.cache.k[:, :, :n])
            kc.v[:, :, :n].copy_(base.cache.v[:, :, :n])
            kc.length = n
            caches.append(kc)
        return caches

    def _pooled_decode(self, base: Any, n: int, b: int, steps: int, warm: int, ragged_step: float,
                       want: list[int]) -> dict[str, Any]:
        """The same decode over one pool (engine.decode_graphs), each bucket's step a CUDA graph
        unless --cuda-graphs off: its step time, its ratio to the ragged step above, and whether
        its greedy tokens are the ragged path's (`want`: row 0's token at each of its steps)."""
        import torch

        from ragkv.engine.decode import pick_greedy
        from ragkv.engine.decode_graphs import PooledDecoder, unsupported_reason

        lm = self.lm
        why = unsupported_reason(lm.adapter)
        if why is not None:
            return {"skipped": why}

        first = [int(base.logits.argmax())] * b
        dec = PooledDecoder(lm, pool_tokens=b * (n + steps + warm + 1) + 4 * 16,
                            graphs=self.args.cuda_graphs == "auto")
        pooled, tokens, times, got = self._copies(base, b, steps + warm + 1), list(first), [], []
        for i in range(warm + steps):
            sync(self.device)
            t = time.perf_counter()
            with torch.inference_mode():
                tokens = pick_greedy(dec.step(pooled, tokens))
            if i >= warm:
                times.append(time.perf_counter() - t)
            got.append(tokens[0])
        step = statistics.median(times)
        st = dec.stats
        row = {"step_s": step, "tokens_per_s": b / step, "speedup_vs_ragged": ragged_step / step,
               "graphs": dec.graphs, "graph_steps": st.graph_steps, "eager_steps": st.eager_steps,
               "ragged_steps": st.ragged_steps,  # steps with rows the pool did not hold: not a pooled step's time
               "captures": st.captures, "capture_failures": st.capture_failures,
               "greedy_tokens_equal_ragged": got == want}
        if dec.graphs:
            row["capture_s"] = st.capture_s
        return row

    def generate(self, c: int, modes: list[str]) -> None:
        """`generate_one` at each of `--generate-batches` (the same prompt in every row), in each of
        `modes` (eager, compiled)."""
        for compiled in [m == "compiled" for m in modes if m in self.args.generate_modes]:
            label = "compiled" if compiled else "static"
            if compiled and self.device.type != "cuda":
                self.run.skip(f"{self.name} c{c} generate compiled", "transformers compiles generate() on CUDA only")
                continue
            for b in self.args.generate_batches:
                self.sec.guard(f"{self.name} c{c} generate {label} b{b}",
                               lambda b=b, compiled=compiled: self.generate_one(c, b, compiled))

    def generate_one(self, c: int, batch: int, compiled: bool = False) -> None:
        """transformers' `generate` with a static cache, greedy, `batch` rows of the same prompt: a
        streamer stamps each new token, so a decode step is the median interval after the first
        token, and the first token's time is generate's own TTFT. Eager (`disable_compile`), or
        `compiled`: transformers' own torch.compile of the forward over the static cache, the
        stronger baseline (the warm-up run pays the compile)."""
        import torch

        label = "compiled" if compiled else "static"
        x = torch.tensor([self.full_ids(c)] * batch, device=self.device)
        n = 4 + self.args.decode_steps
        est = 2 * batch * self.full_s.get(c, 1.0) + n * 0.05
        first = est + (COMPILE_EST_S if compiled else 0.0)
        if not self.sec.budget.fits(first + self.args.repeats * est):
            self.run.skip(f"{self.name} c{c} generate {label} b{batch}",
                          f"~{first + self.args.repeats * est:.0f} s, {self.sec.budget.left():.0f} s left")
            return
        flags = {"disable_compile": not compiled}

        def gen(stamps: list[float]) -> Any:
            kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      cache_implementation="static", pad_token_id=0, streamer=Stamps(stamps))
            try:
                return self.model.generate(x, **kw, **flags)
            except (TypeError, ValueError) as exc:
                if "disable_compile" not in str(exc) or not flags:
                    raise
                flags.clear()  # an older transformers: no such flag (it compiles on its own terms)
                stamps.clear()
                return self.model.generate(x, **kw)

        steps, ttfts = [], []
        for i in range(1 + self.args.repeats):  # a warm-up first
            stamps: list[float] = []
            sync(self.device)
            t0 = time.perf_counter()
            gen(stamps)
            # stamps: the prompt, then each new token (the host has it: each step is synchronized)
            if i and len(stamps) >= 4:
                ttfts.append(stamps[1] - t0)
                steps.append(statistics.median([b - a for a, b in zip(stamps[2:], stamps[3:])]))
        if steps:
            step = statistics.median(steps)
            got = {"batch": batch, "prompt_tokens": x.shape[1], "new_tokens": n, "step_s": step,
                   "decode_tokens_per_s": batch / step, "ttft_s": statistics.median(ttfts),
                   "compile": ("disabled" if flags.get("disable_compile") else "transformers' torch.compile")
                   if flags else "transformers' default (no disable_compile flag)"}
            if batch == 1:
                self.out.setdefault(f"generate_{label}", {})[str(c)] = got
            else:
                self.out.setdefault(f"generate_{label}_batches", {}).setdefault(str(c), {})[str(batch)] = got

    def profile_decode(self, c: int) -> None:
        """Where a decode step's time goes, at each of `--profile-batches`: torch.profiler over
        3 steps after a warm-up. Per step: wall time, the device's busy time (its kernels' sum),
        kernel launches and host-side operator calls, and the heaviest kernels and host operators.
        A step whose wall time far exceeds its busy time is bound by the host (launches, Python)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        from ragkv.engine.decode import decode_batch, pick_greedy
        from ragkv.engine.kv.cache import KVCache
        from ragkv.types import Mode

        lm, steps = self.lm, 3
        base = self.eng.run(self._full_prompt(self.full_ids(c)), Mode.FULL, reserve_tokens=0)
        n = base.n_prompt_tokens
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        out = self.out.setdefault("decode_profile", {}).setdefault(str(c), {"prompt_tokens": n})
        for b in self.args.profile_batches:
            caches = []
            for _ in range(b):
                kc = KVCache(lm.kv_layers, lm.num_kv_heads, lm.head_dim, n + steps + 2, lm.dtype, lm.device)
                kc.k[:, :, :n].copy_(base.cache.k[:, :, :n])
                kc.v[:, :, :n].copy_(base.cache.v[:, :, :n])
                kc.length = n
                caches.append(kc)
            tokens = [int(base.logits.argmax())] * b
            with torch.inference_mode():
                tokens = pick_greedy(decode_batch(lm, caches, tokens))  # warm-up
                sync(self.device)
                t0 = time.perf_counter()
                with profile(activities=acts) as prof:
                    for _ in range(steps):
                        tokens = pick_greedy(decode_batch(lm, caches, tokens))
                    sync(self.device)
                wall = (time.perf_counter() - t0) / steps
            ev = prof.key_averages()
            dev_attr = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
            kernels = [e for e in ev if getattr(e, dev_attr, 0) > 0]
            busy_us = sum(getattr(e, dev_attr) for e in kernels) / steps
            top_dev = sorted(kernels, key=lambda e: -getattr(e, dev_attr))[:8]
            top_cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:8]
            out[str(b)] = {
                "wall_step_s": wall, "device_busy_step_s": busy_us / 1e6 if self.device.type == "cuda" else None,
                "kernel_launches_per_step": sum(e.count for e in ev if e.key.startswith(("cudaLaunchKernel",
                                                                                          "cuLaunchKernel"))) / steps,
                "aten_calls_per_step": sum(e.count for e in ev if e.key.startswith("aten::")) / steps,
                "top_device": [(e.key[:80], round(getattr(e, dev_attr) / steps / 1e3, 3)) for e in top_dev],
                "top_host": [(e.key[:80], round(e.self_cpu_time_total / steps / 1e3, 3)) for e in top_cpu]}
            print(f"  [{self.name}] decode profile c{c} b{b}: {wall * 1e3:.1f} ms a step, device busy "
                  f"{busy_us / 1e3:.1f} ms, {out[str(b)]['kernel_launches_per_step']:.0f} kernel launches, "
                  f"{out[str(b)]['aten_calls_per_step']:.0f} aten calls", flush=True)
            del caches
            self.run.save()

    def close(self) -> None:
        for s in self.stores:
            s.close()
        for d in self.tmp:
            shutil.rmtree(d, ignore_errors=True)
        for name in [n for n in self.__dict__ if n.startswith("_store_")] + ["eng", "lm", "model", "kvs", "stores"]:
            self.__dict__.pop(name, None)  # the weights and every KV: freed before the next model


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_bench.json")
    ap.add_argument("--models", default="llama3.1-8b,qwen3-8b", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--shape", choices=("real", "tiny"), default="real", help="tiny: a few layers, small dims")
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--chunks", type=ints, default=[8, 16], help="chunk counts, e.g. 8,16")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--ratio", type=float, default=0.15, help="blend's recompute ratio")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64], help="decode batch sizes")
    ap.add_argument("--sections", type=sections, default=list(SECTIONS),
                    help=f"what to run beside the build, the check and full/mode TTFT (default all: {','.join(SECTIONS)})")
    ap.add_argument("--generate-batches", type=ints, default=[1, 32], help="transformers generate() batch sizes")
    ap.add_argument("--profile-batches", type=ints_or_none, default=[1, 32],
                    help="decode batch sizes profiled with torch.profiler ('none': no profile)")
    ap.add_argument("--cuda-graphs", choices=("auto", "off"), default="auto",
                    help="the pooled decode arm captures each bucket's step as a CUDA graph (auto, on CUDA) or not")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 16; --quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats after a warm-up (default 3; --quick 1)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time; what would not fit is skipped")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 4 decode steps, fewer tier variants")
    ap.add_argument("--disk-dir", default=None, help="where the disk tier's files go (default: the temp folder)")
    ap.add_argument("--generate-modes", type=generate_modes, default=["eager", "compiled"],
                    help="transformers generate() baselines: eager (disable_compile) and compiled (its own "
                         "torch.compile over the static cache, CUDA only), e.g. eager")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 for --shape tiny on the CPU, else torch's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="prompt rows a step computes at most (the engine's chunked prefill; 0 = whole layers; "
                         "default: the engine's own, sized from its measured speed)")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.decode_steps = args.decode_steps or (4 if args.quick else 16)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; one of {', '.join(MODELS)}")
    if not args.chunks or min(args.chunks) < 1 or args.chunk_tokens < 1 or min(args.batches, default=0) < 1:
        ap.error("--chunks, --chunk-tokens and --batches must be >= 1")
    args.chunks = sorted(set(args.chunks))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    notes = bootstrap()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.shape == "real" and not args.device.startswith("cuda"):
        raise SystemExit("real shapes (8B parameters) need a GPU: use --shape tiny on the CPU")
    # tiny shapes on the CPU gain nothing from more threads, and on a busy CPU the threads spin
    # (2 cores under load: 106 s with 2 threads, 26 s with 1)
    threads = args.threads or (1 if args.shape == "tiny" and not args.device.startswith("cuda") else None)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _bench(args, notes)
    finally:
        torch.set_num_threads(before)  # (main may be called in a process that goes on)


def _bench(args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args)
    device = torch.device(args.device)
    import transformers

    card = card_of(device)
    run.data["env"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                       "cuda": torch.version.cuda, "python": platform.python_version(), "card": card,
                       "flash_attn": importlib.util.find_spec("flash_attn") is not None, "notes": notes,
                       "cpu_threads": torch.get_num_threads()}
    print(f"gpu_bench on {card['name']} ({args.dtype}), models {args.models}, chunks {args.chunks} x "
          f"{args.chunk_tokens}, budget {args.budget_s:.0f} s" + "".join(f"\n  note: {n}" for n in notes), flush=True)
    total = Budget(args.budget_s - (time.monotonic() - _STARTED) - RESERVE_S)  # from the process's start
    for i, name in enumerate(args.models):
        budget = Budget(total.left() / (len(args.models) - i), total)  # an equal share of what is left
        mb = ModelBench(run, args, name, budget)
        try:
            mb.sec.guard(f"{name} build", mb.build)
            if not hasattr(mb, "eng"):
                continue
            mb.sec.guard(f"{name} chunk prefill", mb.precompute)
            if not hasattr(mb, "kvs"):
                continue
            mb.sec.guard(f"{name} check", mb.check)
            on = set(args.sections)
            for c in args.chunks:
                mb.sec.guard(f"{name} c{c} ttft", lambda c=c, mb=mb: mb.ttft(c))
                if c not in mb.full_s:
                    continue
                if "hf" in on:
                    mb.sec.guard(f"{name} c{c} transformers prefill", lambda c=c, mb=mb: mb.hf_prefill(c))
                if "decode" in on:
                    mb.sec.guard(f"{name} c{c} decode", lambda c=c, mb=mb: mb.decode(c))
                if c == args.chunks[0]:
                    if "generate" in on:
                        mb.sec.guard(f"{name} c{c} generate static", lambda c=c, mb=mb: mb.generate(c, ["eager"]))
                    if "profile" in on and args.profile_batches:
                        mb.sec.guard(f"{name} c{c} decode profile", lambda c=c, mb=mb: mb.profile_decode(c))
                if "side" in on and c == args.chunks[0]:
                    mb.sec.guard(f"{name} c{c} side by side", lambda c=c, mb=mb: mb.side_by_side(c))
                if "tiers" in on:
                    mb.sec.guard(f"{name} c{c} tiers", lambda c=c, mb=mb: mb.tiers(c))
                if "transfers" in on:
                    mb.sec.guard(f"{name} c{c} kv transfer", lambda c=c, mb=mb: mb.transfers(c))
                run.save()
            if "generate" in on and args.chunks[0] in mb.full_s:  # last: its compile takes a minute or more
                c0 = args.chunks[0]
                mb.sec.guard(f"{name} c{c0} generate compiled", lambda c=c0, mb=mb: mb.generate(c, ["compiled"]))
        finally:
            mb.close()
            derive(run.data["models"][name], card)
            run.save()
            del mb  # the model and its KV go before the next is built
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n" + table(run.data), flush=True)
    run.save()
    print(f"\nwrote {run.path} in {time.monotonic() - run.t0:.1f} s", flush=True)
    return run.data


if __name__ == "__main__":
    from contextlib import suppress

    with suppress(Exception):  # huge pages and glibc tuning, as the server runs (engine/kv/host_allocator.py)
        bootstrap()
        from ragkv.engine.kv.host_allocator import tune_host_allocator

        tune_host_allocator()
    data = main()
    sys.exit(1 if data["errors"] else 0)
