"""One client on a slow tier beside three streaming clients, in one run.

    python -m bench.slow_client --duration 30 --latency-ms 1500

Builds the `ragkv bench --concurrency` index (40 documents, 256-token chunks, KV on disk) and
serves three copies of it from one in-process server (gRPC on loopback, nothing kept in the
CPU tier, the KV tree off, the loading controller on): `fast` (the disk tier as it is), `slow`
(the same KV, each read waiting `--latency-ms` at open: a remote tier that stalls) and `nokv`
(no stored KV, and none kept: every chunk computed, every time). Three bystanders ask `fast` back to back for long
answers while, in turn:

1. `alone`: nobody else asks (the bystanders' baseline);
2. `slow`: a fourth client asks `slow`, one question after another;
3. `computed`: the fourth client asks the same questions of `nokv` (its chunks computed).

It reports the bystanders' inter-token latency p50/p95/p99 in each phase and their ratio to
`alone`, and the fourth client's time to first token p50/p95 on `slow` against `computed`:
a stalled tier should cost a request no more than computing its chunks does (the loading
controller races an overrun read against its chunk's compute), and its waiting should cost the
bystanders nothing (a request waiting on KV is parked, off the engine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.slow_tier import _pct

PHASES = ("alone", "slow", "computed")


@dataclass
class _Tally:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    sources: Counter = field(default_factory=Counter)
    requests: int = 0
    errors: int = 0


@contextmanager
def tiers(slow: Path, latency_s: float, unkept: Path):
    """Every disk-tier read under `slow` waits `latency_s` at its open; no write under `unkept`
    lands (its chunks stay computed, request after request); other disk tiers as they are."""
    from ragkv.kvstore.tiers.disk import DiskTier

    real_source, real_read, real_write = DiskTier._source, DiskTier._read, DiskTier._write
    slow, unkept = slow.resolve(), unkept.resolve()

    def under(tier, root: Path) -> bool:
        return Path(tier.root).resolve().is_relative_to(root)

    def source(self, key):
        if under(self, slow):
            time.sleep(latency_s)
        return real_source(self, key)

    def read(self, key):
        if under(self, slow):
            time.sleep(latency_s)
        return real_read(self, key)

    def write(self, key, data) -> bool:
        return False if under(self, unkept) else real_write(self, key, data)

    DiskTier._source, DiskTier._read, DiskTier._write = source, read, write
    try:
        yield
    finally:
        DiskTier._source, DiskTier._read, DiskTier._write = real_source, real_read, real_write


def _ask(addr: str, collection: str, questions: list[str], offset: int, stop: threading.Event, max_new: int,
         tally: _Tally, lock: threading.Lock, mode: str = "reuse", top_k: int = 4) -> None:
    """One client asking `collection` back to back until `stop` (reuse mode over 4 chunks, unless told)."""
    from ragkv.client import RagClient

    i = offset
    with RagClient(addr, timeout=600) as client:
        while not stop.is_set():
            i += 1
            t0 = time.perf_counter()
            stamps = []
            try:
                stream = client.query(questions[i % len(questions)], collection=collection, mode=mode, top_k=top_k,
                                      max_new_tokens=max_new)
                for _ in stream:
                    stamps.append(time.perf_counter())
                stats = stream.result()
            except Exception:  # counted, never hidden
                with lock:
                    tally.errors += 1
                continue
            with lock:
                tally.requests += 1
                if stamps:
                    tally.ttft.append(stamps[0] - t0)
                    tally.itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
                tally.sources.update({k.value: v for k, v in stats.kv_sources.items()})


def _phase(addr: str, fourth: str | None, duration: float, questions: list[str], max_new: int,
           fourth_new: int, bystanders_on: str = "fast", fourth_mode: str = "reuse", fourth_top_k: int = 4) -> dict:
    """The three bystanders on `bystanders_on` for `duration` seconds, with a fourth client on
    `fourth` (None: none) asking in `fourth_mode` over `fourth_top_k` chunks."""
    lock, stop = threading.Lock(), threading.Event()
    bystanders, client = _Tally(), _Tally()
    threads = [threading.Thread(target=_ask, args=(addr, bystanders_on, questions, 7 * k, stop, max_new, bystanders,
                                                   lock)) for k in range(3)]
    if fourth is not None:
        threads.append(threading.Thread(target=_ask, args=(addr, fourth, questions, 1000, stop, fourth_new,
                                                           client, lock),
                                        kwargs={"mode": fourth_mode, "top_k": fourth_top_k}))
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join()
    out = {"bystanders": {"requests": bystanders.requests, "errors": bystanders.errors,
                          **{f"itl_p{q}_s": _pct(bystanders.itl, q) for q in (50, 95, 99)}}}
    if fourth is not None:
        out["fourth"] = {"collection": fourth, "requests": client.requests, "errors": client.errors,
                         "kv_sources": dict(client.sources),
                         **{f"ttft_p{q}_s": _pct(client.ttft, q) for q in (50, 95)}}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model spec (default: the shipped SmolLM2)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per phase (default 30)")
    ap.add_argument("--latency-ms", type=float, default=1500.0, help="the slow tier's wait at each read's open")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the bystanders' answers (default 64)")
    ap.add_argument("--fourth-new-tokens", type=int, default=8, help="the fourth client's answers (default 8)")
    ap.add_argument("--index", type=Path, default=None, help="an existing index (default: build the bench's)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ragkv.cli.load_bench import _build_index, _questions
    from ragkv.retriever.manifest import KV_DIR_NAME
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.inprocess import InProcessServer
    from ragkv.server.settings import CollectionSpec, ServerSettings

    with tempfile.TemporaryDirectory(prefix="ragkv-slow-client-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, None, None)
        questions = _questions(index, 64, seed=0)
        slow = shutil.copytree(index, Path(tmp) / "slow")
        nokv = shutil.copytree(index, Path(tmp) / "nokv", ignore=shutil.ignore_patterns(KV_DIR_NAME))
        (nokv / KV_DIR_NAME).mkdir()
        settings = ServerSettings(
            indexes=(CollectionSpec("fast", index), CollectionSpec("slow", slow), CollectionSpec("nokv", nokv)),
            host="127.0.0.1", port=0, metrics_port=None, kv_cpu_bytes=1, kv_tree_bytes=0, max_queue=8, max_batch=4,
            **({} if args.index else {"model": args.model}))
        report: dict = {}
        with tiers(slow, args.latency_ms / 1000, nokv):
            server = InProcessServer(settings, build_pipeline, load_timeout=600)
            try:
                _phase(server.addr, None, min(6.0, args.duration), questions, args.max_new_tokens,
                       args.fourth_new_tokens)  # warm up
                for name, fourth in zip(PHASES, (None, "slow", "nokv")):
                    print(f"phase {name} ...", file=sys.stderr, flush=True)
                    report[name] = _phase(server.addr, fourth, args.duration, questions, args.max_new_tokens,
                                          args.fourth_new_tokens)
            finally:
                server.stop()
    alone = report["alone"]["bystanders"]
    ratios = {f"bystanders itl_p{q} {p}/alone": _ratio(report[p]["bystanders"][f"itl_p{q}_s"], alone[f"itl_p{q}_s"])
              for p in ("slow", "computed") for q in (50, 95, 99)}
    for q in (50, 95):
        ratios[f"fourth ttft_p{q} slow/computed"] = _ratio(report["slow"]["fourth"][f"ttft_p{q}_s"],
                                                          report["computed"]["fourth"][f"ttft_p{q}_s"])
    out = {"phases": report, "ratios": ratios,
           "config": {"duration_s": args.duration, "latency_ms": args.latency_ms, "max_new_tokens": args.max_new_tokens,
                      "fourth_new_tokens": args.fourth_new_tokens, "model": args.model, "mode": "reuse", "top_k": 4,
                      "baseline": "the same run's phase alone (bystanders) and phase computed (the fourth client)"}}
    if args.json:
        print(json.dumps(out))
    else:
        for name, r in report.items():
            print(f"{name:9s} bystanders {r['bystanders']}  fourth {r.get('fourth', '-')}")
        for k, v in ratios.items():
            print(f"{k:38s} {v}")
    errors = sum(r[who]["errors"] for r in report.values() for who in ("bystanders", "fourth") if who in r)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
