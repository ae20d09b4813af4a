"""kvstore throughput per tier, against a plain read of the same bytes from the same disk.

    python -m bench.kvstore_bench --chunks 8 --chunk-tokens 512 --rounds 5

Writes and reads the KV of `--chunks` SmolLM2-shaped chunks (L=30, Hkv=3, D=64,
fp16, random values: timing does not depend on them) through each tier: cpu, gpu
(when CUDA is there), disk, and s3 (a moto server on loopback, unless --no-s3).
For disk it also reads the same files raw (open + read into memory) and prints
the ratio tier/raw; both are read cold (the files' pages dropped from the page
cache with posix_fadvise before each round, which needs no root) and warm.
Then bytes per token for each compression. Medians over --rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ragkv.kvstore import (
    ChunkKey,
    Compression,
    CpuTier,
    DiskTier,
    GpuTier,
    KVEntry,
    S3Settings,
    S3Tier,
    StorageTier,
    hash_prefix,
)
from ragkv.kvstore.compression import fp8_supported
from ragkv.kvstore.fileformat import encode

MODEL_FP = "bench-smollm2-135m"
TOKENIZER_FP = "bench-tokenizer"
SHAPE_LHD = (30, 3, 64)  # SmolLM2-135M: L, Hkv, D


def make_chunks(n: int, tokens: int, dtype: torch.dtype) -> list[KVEntry]:
    """Random SmolLM2-shaped chunk KVs."""
    n_layers, n_heads, head_dim = SHAPE_LHD
    prefix = [1]
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.arange(i * tokens, (i + 1) * tokens, dtype=torch.int64)  # [T]
        out.append(KVEntry(
            key=ChunkKey.build(MODEL_FP, TOKENIZER_FP, prefix, ids.tolist()),
            k=torch.randn(n_layers, n_heads, tokens, head_dim, generator=g).to(dtype),  # [L, Hkv, T, D]
            v=torch.randn(n_layers, n_heads, tokens, head_dim, generator=g).to(dtype),  # [L, Hkv, T, D]
            token_ids=ids, positions=torch.arange(1, tokens + 1),
            model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP, prefix_hash=hash_prefix(prefix),
        ))
    return out


def drop_cache(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (they are clean: the tier fsynced them)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path]) -> int:
    """The baseline: read each file whole into memory, nothing else."""
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            total += len(f.read())
    return total


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_tier(tier: StorageTier, chunks: list[KVEntry], rounds: int) -> tuple[float, float]:
    """(put GB/s, get GB/s) of the chunks' tensor bytes; get touches every byte of K and V."""
    nbytes = sum(e.nbytes for e in chunks)
    put_s = timed(lambda: tier.put_many(chunks))

    def read_all() -> None:
        for e in chunks:
            got = tier.get(e.key)
            if got is None:
                raise RuntimeError(f"bench: {tier.tier.value} tier lost key {e.key.hex}")
    get_s = statistics.median(timed(read_all) for _ in range(rounds))
    return gbps(nbytes, put_s), gbps(nbytes, get_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="disk tier root (default: a temp dir under /tmp)")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 tier")
    args = ap.parse_args(argv)

    chunks = make_chunks(args.chunks, args.chunk_tokens, torch.float16)
    tokens = args.chunks * args.chunk_tokens
    mb = sum(e.nbytes for e in chunks) / 1e6
    print(f"kvstore bench: {args.chunks} chunks x {args.chunk_tokens} tokens, SmolLM2 shape "
          f"L,Hkv,D={SHAPE_LHD} fp16, {mb:.1f} MB of tensors; medians of {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    rows: list[tuple[str, float, float]] = []

    if torch.cuda.is_available():
        rows.append(("gpu", *bench_tier(GpuTier(MODEL_FP, TOKENIZER_FP), chunks, args.rounds)))
    rows.append(("cpu", *bench_tier(CpuTier(MODEL_FP, TOKENIZER_FP), chunks, args.rounds)))

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        disk = DiskTier(root, MODEL_FP, TOKENIZER_FP)
        put_s = timed(lambda: disk.put_many(chunks))
        paths = [disk.path(e.key) for e in chunks]
        file_bytes = sum(p.stat().st_size for p in paths)

        def tier_read() -> None:
            for e in chunks:
                if disk.get(e.key) is None:
                    raise RuntimeError(f"bench: disk tier lost key {e.key.hex}")

        results: dict[str, list[float]] = {"tier_cold": [], "raw_cold": [], "tier_warm": [], "raw_warm": []}
        for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both alike
            drop_cache(paths)
            results["raw_cold"].append(timed(lambda: raw_read(paths)))
            drop_cache(paths)
            results["tier_cold"].append(timed(tier_read))
            results["raw_warm"].append(timed(lambda: raw_read(paths)))
            results["tier_warm"].append(timed(tier_read))
        med = {k: statistics.median(v) for k, v in results.items()}
        rows.append(("disk (cold)", gbps(file_bytes, put_s), gbps(file_bytes, med["tier_cold"])))
        rows.append(("disk (warm)", float("nan"), gbps(file_bytes, med["tier_warm"])))

        int8_disk = DiskTier(Path(root) / "int8", MODEL_FP, TOKENIZER_FP, compression=Compression.INT8)
        rows.append(("disk int8 (warm)", *bench_tier(int8_disk, chunks, args.rounds)))

    if not args.no_s3:
        rows.append(("s3 (moto, loopback)", *bench_s3(chunks, args.rounds)))

    print(f"\n{'tier':<22}{'put GB/s':>10}{'get GB/s':>10}")
    for name, put, get in rows:
        print(f"{name:<22}{put:>10.3f}{get:>10.3f}")

    print(f"\ndisk read of the same {file_bytes / 1e6:.1f} MB, same files, same disk:")
    print(f"{'':<22}{'raw GB/s':>10}{'tier GB/s':>10}{'ratio':>8}")
    for mode in ("cold", "warm"):
        raw, tier = gbps(file_bytes, med[f"raw_{mode}"]), gbps(file_bytes, med[f"tier_{mode}"])
        print(f"{mode + ' page cache':<22}{raw:>10.3f}{tier:>10.3f}{tier / raw:>8.2f}")
    print("target: disk tier >= 0.80 of raw (cold)")

    print(f"\nbytes per token on disk (T={args.chunk_tokens} per chunk; K/V alone in fp16 is "
          f"2*30*3*64*2 = {2 * 30 * 3 * 64 * 2:,}):")
    sizes = {}
    for c in Compression:
        if c is Compression.FP8 and not fp8_supported():
            print(f"  {c.value:<5} (torch has no float8_e4m3fn)")
            continue
        sizes[c] = sum(len(encode(e, c)) for e in chunks) / tokens
        print(f"  {c.value:<5}{sizes[c]:>10,.1f} B/token  ({sizes[c] / sizes[Compression.NONE]:.3f} of fp16)")


def bench_s3(chunks: list[KVEntry], rounds: int) -> tuple[float, float]:
    """put/get GB/s through boto3 to a moto server on 127.0.0.1 (an HTTP round trip per object)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "bench")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="kv-bench")
        tier = S3Tier("kv-bench", "bench", MODEL_FP, TOKENIZER_FP, S3Settings(endpoint_url=endpoint, region="us-east-1"))
        try:
            return bench_tier(tier, chunks, max(1, rounds // 2))
        finally:
            tier.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
