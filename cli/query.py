"""`ragkv query`: ask a running server a question and stream the answer to the terminal.

Client-only: grpc and protobuf, never torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ragkv.types import FilterOp, MetadataFilter, Mode, SearchMode


def add_query_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `query` on the `ragkv` subcommand parser."""
    p = sub.add_parser(
        "query",
        help="ask a running server a question and stream the answer",
        description="Ask a ragkv server a question; the answer streams to stdout, the "
        "retrieved chunks and timings go to stderr (or everything as one JSON object with --json).",
    )
    p.add_argument("question", help="the question")
    p.add_argument("--addr", default=os.environ.get("RAGKV_ADDR", "localhost:50051"),
                   help="server host:port (default $RAGKV_ADDR or localhost:50051)")
    p.add_argument("--collection", default=None, help="collection name (default: 'default')")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=None, help="KV mode (default: server's)")
    p.add_argument("--top-k", type=int, default=None, help="chunks to retrieve")
    p.add_argument("--search-mode", choices=[m.value for m in SearchMode], default=None,
                   help="dense, lexical or hybrid (default: server's, hybrid)")
    p.add_argument("--filter", dest="filters", action="append", default=[], type=_equals_filter,
                   metavar="KEY=VALUE", help="metadata equality before top-k; VALUE is JSON if it parses "
                                             "(year=2023 is an int, team=beta a string); repeatable")
    p.add_argument("--prefix", dest="filters", action="append", type=_prefix_filter, metavar="KEY=PREFIX",
                   help="metadata string prefix before top-k (source=guides/); repeatable")
    p.add_argument("--ratio", dest="recompute_ratio", type=float, default=None, help="blend recompute ratio [0, 1]")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer length cap")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--token-file", type=Path, default=None,
                   help="bearer token file (default $RAGKV_AUTH_TOKEN)")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca-cert", type=Path, default=None, help="PEM CA certificate (implies --tls)")
    p.add_argument("--insecure", action="store_true",
                   help="send the token in plaintext to a host that is not this machine (a network you trust); "
                        "without it a token needs --tls there")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds (default 120)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(func=run_query)
    return p


def _split(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _equals_filter(text: str) -> MetadataFilter:
    key, raw = _split(text)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return MetadataFilter(key, value)


def _prefix_filter(text: str) -> MetadataFilter:
    key, prefix = _split(text)
    return MetadataFilter(key, prefix, FilterOp.PREFIX)


def _jsonable(obj: object) -> object:
    if hasattr(obj, "value") and not isinstance(obj, (int, float, str)):
        return obj.value
    return str(obj)


def run_query(args: argparse.Namespace) -> int:
    """Run one query; returns the exit status."""
    import grpc

    from ragkv.client import RagClient

    token = args.token_file.read_text().strip() if args.token_file else os.environ.get("RAGKV_AUTH_TOKEN")
    client = RagClient(args.addr, token=token, tls=args.tls, root_certificates=args.ca_cert, timeout=args.timeout,
                       insecure=args.insecure)
    started = time.perf_counter()
    first_piece_at: float | None = None
    try:
        with client:
            stream = client.query(
                args.question, collection=args.collection, top_k=args.top_k, mode=args.mode,
                recompute_ratio=args.recompute_ratio, temperature=args.temperature, top_p=args.top_p,
                seed=args.seed, max_new_tokens=args.max_new_tokens, stop=args.stop,
                search_mode=args.search_mode, filters=args.filters,
            )
            if not args.json:
                for i, chunk in enumerate(stream.chunks):
                    tier = chunk.kv_tier.value if chunk.kv_tier else "-"
                    found = "+".join(m.value for m in chunk.found_by) or "-"
                    sys.stderr.write(f"[{i + 1}] {chunk.chunk_id} score={chunk.score:.3f} found_by={found} "
                                     f"kv={tier}\n")
            for piece in stream:
                if first_piece_at is None:
                    first_piece_at = time.perf_counter()
                if not args.json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            stats = stream.result()
    except grpc.RpcError as exc:
        sys.stderr.write(f"ragkv query: {exc.code().name}: {exc.details()}\n")
        return 1
    client_ttft = (first_piece_at or time.perf_counter()) - started
    if args.json:
        doc = {
            "answer": stats.text,
            "chunks": [asdict(c) for c in stream.chunks],
            "stats": asdict(stats),
            "client_ttft_seconds": client_ttft,
            "client_total_seconds": time.perf_counter() - started,
        }
        sys.stdout.write(json.dumps(doc, default=_jsonable, indent=2) + "\n")
    else:
        sys.stdout.write("\n")
        sys.stderr.write(
            f"mode={stats.mode.value} ttft={client_ttft * 1000:.0f}ms (server {stats.ttft_seconds * 1000:.0f}ms) "
            f"total={stats.total_seconds * 1000:.0f}ms tokens={stats.usage.completion_tokens} "
            f"recomputed={stats.recompute_fraction:.2f} finish={stats.finish_reason.value} "
            f"used={len(stats.used_chunk_ids)}/{len(stream.chunks)} chunks\n"
        )
    return 0
