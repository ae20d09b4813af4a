"""A slow KV tier under load, loading controller on and off, in one run.

    python -m bench.slow_tier --duration 20 --clients 1,4 --latency-ms 300 --mbps 40

Builds the `ragkv bench --concurrency` index (40 documents, 256-token chunks, KV on disk),
then serves it from an in-process server (gRPC on loopback, nothing kept in the CPU tier,
so every request reads its chunks' KV) with each tier of `--tiers`, the loading controller
on and off: `disk` (the disk tier as it is), `throttled` (the disk tier, each read waiting
`--latency-ms` at open and its bytes coming at `--mbps` MB/s: a remote tier over a slow
link) and `s3_throttled` (the KV in S3, a moto server on loopback reached over real HTTP
by boto3, throttled the same way: the index's only KV tier is the bucket). For each, N clients (N in `--clients`) ask with the
modes in rotation for `--duration` seconds; per mode it reports the client-side time to
first token and inter-token latency, p50 and p95, and how the chunks' KV came (loaded,
computed because cheaper, computed after an overrun). Ratios: throttled over disk, and
controller on over off on the throttled tier, from the same run.

The throttle is injected into the tier's byte reads (`DurableTier._source` and `_read`),
so layer-wise reading, verification and promotion run as they do in production.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("reuse", "blend", "focus", "full")


@dataclass
class _Run:
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    itl: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    sources: Counter = field(default_factory=Counter)
    requests: int = 0
    errors: int = 0


@contextmanager
def throttled(latency_s: float, bytes_per_s: float, tier: str = "disk"):
    """Every read of the disk (or "s3") tier waits `latency_s` at open; its bytes arrive at `bytes_per_s`."""
    from ragkv.kvstore.tiers.disk import DiskTier
    from ragkv.kvstore.tiers.s3 import S3Tier

    cls = {"disk": DiskTier, "s3": S3Tier}[tier]
    real_source, real_read = cls._source, cls._read

    class _SlowReader:
        def __init__(self, inner) -> None:
            self.inner = inner

        def readinto(self, buf) -> int:
            n = self.inner.readinto(buf)
            time.sleep(n / bytes_per_s)
            return n

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    class _SlowSource:
        def __init__(self, inner) -> None:
            self.inner, self.size = inner, inner.size

        def reader(self, start: int, end: int):
            return _SlowReader(self.inner.reader(start, end))

        def close(self) -> None:
            self.inner.close()

    def source(self, key):
        time.sleep(latency_s)
        src = real_source(self, key)
        return None if src is None else _SlowSource(src)

    def read(self, key):
        time.sleep(latency_s)
        got = real_read(self, key)
        if got is not None:
            time.sleep(len(got[0] if isinstance(got, tuple) else got) / bytes_per_s)
        return got

    cls._source, cls._read = source, read
    try:
        yield
    finally:
        cls._source, cls._read = real_source, real_read


@contextmanager
def s3_index(index: Path, root: Path):
    """A copy of `index` whose only KV tier is a bucket on a moto S3 server on loopback,
    holding the index's KV files (boto3 reaches it over real HTTP)."""
    import dataclasses
    import os
    import shutil

    import boto3
    from moto.server import ThreadedMotoServer

    from ragkv.retriever.manifest import KV_DIR_NAME, read_manifest, write_manifest

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server would log every GET
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL_S3"]}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(env, AWS_ENDPOINT_URL_S3=f"http://{host}:{port}")
    try:
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="ragkv-bench")
        copy = root / "s3-index"
        shutil.copytree(index, copy, ignore=shutil.ignore_patterns(KV_DIR_NAME))
        for f in (index / KV_DIR_NAME).rglob("*.safetensors"):
            client.upload_file(str(f), "ragkv-bench", f"kv/{f.relative_to(index / KV_DIR_NAME).as_posix()}")
        write_manifest(copy, dataclasses.replace(read_manifest(copy), kv_uris=("s3://ragkv-bench/kv",)))
        yield copy
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _client(addr: str, questions: list[str], offset: int, stop_at: float, max_new: int, run: _Run,
            lock: threading.Lock) -> None:
    from ragkv.client import RagClient

    i = offset
    with RagClient(addr, timeout=600) as client:
        while time.perf_counter() < stop_at:
            mode = MODES[i % len(MODES)]
            i += 1
            t0 = time.perf_counter()
            stamps = []
            try:
                stream = client.query(questions[i % len(questions)], mode=mode, top_k=4, max_new_tokens=max_new)
                for _ in stream:
                    stamps.append(time.perf_counter())
                stats = stream.result()
            except Exception:  # counted, never hidden
                with lock:
                    run.errors += 1
                continue
            with lock:
                run.requests += 1
                if stamps:
                    run.ttft[mode].append(stamps[0] - t0)
                    run.itl[mode].extend(b - a for a, b in zip(stamps, stamps[1:]))
                run.sources.update({k.value: v for k, v in stats.kv_sources.items()})


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    return round(statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else xs[0], 3)


def _level(addr: str, n: int, duration: float, questions: list[str], max_new: int) -> dict:
    run, lock = _Run(), threading.Lock()
    stop_at = time.perf_counter() + duration
    threads = [threading.Thread(target=_client, args=(addr, questions, k, stop_at, max_new, run, lock))
               for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "requests": run.requests, "errors": run.errors, "kv_sources": dict(run.sources),
        "ttft_p50_s": {m: _pct(run.ttft[m], 50) for m in MODES if run.ttft[m]},
        "ttft_p95_s": {m: _pct(run.ttft[m], 95) for m in MODES if run.ttft[m]},
        "itl_p50_s": {m: _pct(run.itl[m], 50) for m in MODES if run.itl[m]},
        "itl_p95_s": {m: _pct(run.itl[m], 95) for m in MODES if run.itl[m]},
    }


def _serve(index: Path, controller: bool, levels: list[int], duration: float, questions: list[str],
           max_new: int) -> dict:
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.inprocess import InProcessServer
    from ragkv.server.settings import CollectionSpec, ServerSettings

    # the KV tree off: the warm-up and each level ask the same questions, and a tree hit reads no
    # tier at all (it would flatter the figures, and leave the controller nothing to decide)
    settings = ServerSettings(indexes=(CollectionSpec("default", index),), host="127.0.0.1", port=0,
                              metrics_port=None, kv_cpu_bytes=1, kv_controller=controller, kv_tree_bytes=0,
                              max_queue=max(levels) + 4, max_batch=max(levels))
    server = InProcessServer(settings, build_pipeline, load_timeout=600)
    try:
        _level(server.addr, 1, min(6.0, duration), questions, max_new)  # warm up: tiers measured
        return {str(n): _level(server.addr, n, duration, questions, max_new) for n in levels}
    finally:
        server.stop()


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: the shipped SmolLM2)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level and configuration")
    ap.add_argument("--clients", default="1,4", help="concurrency levels, comma-separated")
    ap.add_argument("--latency-ms", type=float, default=300.0, help="throttled tier: wait at each read's open")
    ap.add_argument("--mbps", type=float, default=40.0, help="throttled tier: MB/s of each read")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--tiers", default="disk,throttled,s3_throttled",
                    help="configurations, comma-separated: disk, throttled (disk), s3_throttled (moto S3 on loopback)")
    ap.add_argument("--index", type=Path, default=None, help="an existing index (default: build the bench's)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    from ragkv.cli.load_bench import _build_index, _questions

    levels = [int(x) for x in args.clients.split(",") if x.strip()]
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="ragkv-slow-tier-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, None, None)
        questions = _questions(index, 64, seed=0)
        tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
        unknown = set(tiers) - {"disk", "throttled", "s3_throttled"}
        if unknown:
            ap.error(f"--tiers: unknown {sorted(unknown)}; use disk, throttled, s3_throttled")
        for tier in tiers:
            for controller in (False, True):
                name = f"{tier}/controller_{'on' if controller else 'off'}"
                print(f"running {name} ...", file=sys.stderr, flush=True)
                with contextlib.ExitStack() as stack:
                    served = index
                    if tier == "s3_throttled":
                        served = stack.enter_context(s3_index(index, Path(tmp) / name.replace("/", "-")))
                    if tier != "disk":
                        stack.enter_context(throttled(args.latency_ms / 1000, args.mbps * 1e6,
                                                      "s3" if tier == "s3_throttled" else "disk"))
                    report[name] = _serve(served, controller, levels, args.duration, questions, args.max_new_tokens)
    ratios = {}
    for n in map(str, levels):
        for m in MODES:
            def get(cfg: str, what: str, n: str = n, m: str = m) -> float | None:
                return report[cfg][n][what].get(m) if cfg in report else None
            ratios[f"{n} clients/{m}"] = {k: v for slow in ("throttled", "s3_throttled") for k, v in {
                f"ttft_p50 {slow}/disk (off)": _ratio(get(f"{slow}/controller_off", "ttft_p50_s"),
                                                      get("disk/controller_off", "ttft_p50_s")),
                f"ttft_p50 {slow}/disk (on)": _ratio(get(f"{slow}/controller_on", "ttft_p50_s"),
                                                     get("disk/controller_on", "ttft_p50_s")),
                f"ttft_p50 on/off ({slow})": _ratio(get(f"{slow}/controller_on", "ttft_p50_s"),
                                                    get(f"{slow}/controller_off", "ttft_p50_s")),
                f"itl_p95 on/off ({slow})": _ratio(get(f"{slow}/controller_on", "itl_p95_s"),
                                                   get(f"{slow}/controller_off", "itl_p95_s")),
            }.items()}
    out = {"runs": report, "ratios": ratios,
           "config": {"clients": levels, "tiers": tiers, "duration_s": args.duration, "latency_ms": args.latency_ms,
                      "mbps": args.mbps, "max_new_tokens": args.max_new_tokens, "model": args.model,
                      "modes": list(MODES), "baseline": "the same run's disk tier / controller off"}}
    if args.json:
        print(json.dumps(out))
    else:
        for cfg, levels_out in report.items():
            for n, r in levels_out.items():
                print(f"{cfg:28s} {n:>2} clients: {r['requests']:4d} req, errors {r['errors']}, "
                      f"TTFT p50 {r['ttft_p50_s']}, ITL p95 {r['itl_p95_s']}, KV {r['kv_sources']}")
        for k, v in ratios.items():
            print(f"{k:20s} {v}")
    return 1 if any(r["errors"] for lv in report.values() for r in lv.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
