"""`ragkv demo`: the main job on the embedded defaults, for a new user's first run.

1. Index the built-in demo corpus (chunks, embeddings, FAISS, every chunk's KV on
   disk) with `ragkv index demo` — resumable, so a second run only checks it.
2. Start `ragkv serve` on a free loopback port (CPU + disk tiers, shipped models).
3. Ask questions through the Python SDK in `full`, `blend` and `focus` mode, streaming each
   answer with its sources (which search found each: dense, lexical or both, fused by
   the default hybrid search) and time to first token, then stop the server. Blend runs at
   the server's default: the cheapest ratio the index's calibration predicts within
   `--fidelity-kl` of full prefill, and the demo prints the ratio and that prediction.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from ragkv.types import Mode, QueryStats

DEMO_QUESTIONS = (
    "What does the json module's dumps function do?",
    "How do I create a temporary directory that is removed automatically?",
)


def default_index_dir() -> Path:
    from ragkv.engine.model_loading import cache_dir

    return cache_dir() / "demo-index"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_commands(index_dir: Path, model_spec: str, port: int) -> tuple[list[str], list[str]]:
    """The `ragkv` command lines the demo runs (after `python -m ragkv.cli`): index, then serve."""
    index = ["index", "demo", "--out", str(index_dir), "--model", model_spec]
    serve = ["serve", "--index", str(index_dir), "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", "off", "--log-level", "warning"]
    return index, serve


def describe_run(stats: QueryStats) -> str:
    """What a demo answer ran, from its final stats."""
    ran = stats.mode.value
    if stats.recompute_ratio is not None:
        ran += f" at ratio {stats.recompute_ratio:g}"
    if stats.predicted_kl is not None and stats.mode is not Mode.FULL:
        ran += f" (calibrated KL to full prefill {stats.predicted_kl:.4f})"
    return (f"TTFT {stats.ttft_seconds:.2f} s (server); ran {ran}; recomputed {stats.recompute_fraction:.0%} of "
            f"chunk tokens; answered over {len(stats.used_chunk_ids)} chunks")


def run_demo(index_dir: Path | None, model_spec: str, max_new_tokens: int, questions: tuple[str, ...] = DEMO_QUESTIONS,
             out: TextIO = sys.stdout) -> int:
    from ragkv import RagClient

    index_dir = index_dir or default_index_dir()
    ragkv = [sys.executable, "-m", "ragkv.cli"]
    print(f"[1/3] indexing the demo corpus into {index_dir} (first run: a few minutes on 2 cores)",
          file=out, flush=True)
    port = _free_port()
    index, serve = demo_commands(index_dir, model_spec, port)
    subprocess.run(ragkv + index, check=True)

    addr = f"127.0.0.1:{port}"
    print(f"[2/3] starting the server on {addr}", file=out, flush=True)
    server = subprocess.Popen(ragkv + serve, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        with RagClient(addr, timeout=300) as client:
            _wait_until_serving(client, server)
            print("[3/3] asking through the SDK (full prefill; blend at the ratio the index's calibration "
                  "chose; focus)\n", file=out, flush=True)
            for question in questions:
                print(f"Q: {question}", file=out)
                for mode in ("full", "blend", "focus"):
                    stream = client.query(question, mode=mode, top_k=4, max_new_tokens=max_new_tokens)
                    t0 = time.perf_counter()
                    first = None
                    print(f"  [{mode:5s}] ", end="", file=out, flush=True)
                    for piece in stream:
                        first = first or time.perf_counter() - t0
                        print(piece, end="", file=out, flush=True)
                    stats = stream.result()
                    print(f"\n          {describe_run(stats)} of {len(stream.chunks)}; first piece at the client "
                          f"after {first or 0:.2f} s", file=out)
                sources = ", ".join(f"{c.metadata.get('source', c.chunk_id)} ({c.score:.3f}, found by "
                                    f"{'+'.join(m.value for m in c.found_by) or '-'}, KV from "
                                    f"{c.kv_tier.name.lower() if c.kv_tier else '-'})" for c in stream.chunks)
                print(f"  sources: {sources}\n", file=out, flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


def _wait_until_serving(client, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    import grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the demo server exited with code {server.returncode}; see its log above")
        try:
            client.list_collections(timeout=5)
            return
        except grpc.RpcError:
            time.sleep(0.5)
    raise TimeoutError(f"the demo server did not start serving within {timeout_s:.0f} s")
