"""The `ragkv` command line: index, serve, query, eval, bench, demo, check-model.

Each subcommand imports its heavy dependencies (torch, FAISS) only when it runs,
so `ragkv --help` and `ragkv query` work on a client-only install.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ragkv.errors import RagKVError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def _run_demo(args: argparse.Namespace) -> int:
    from ragkv.cli.demo import run_demo

    return run_demo(index_dir=args.index, model_spec=args.model, max_new_tokens=args.max_new_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragkv",
        description=(
            "RAG retrieval with a persistent per-chunk KV-cache store. "
            "Index documents once (chunks, embeddings, per-chunk KV), then serve "
            "questions with blended KV reuse instead of a full prefill."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run the main job on the embedded defaults: index the demo corpus, serve, ask",
        description="Index the built-in demo corpus (stdlib documentation) with the shipped "
        "models, start the gRPC server on loopback, and ask questions through the Python SDK "
        "in full, blend and focus mode, printing each streamed answer with its sources and TTFT.",
    )
    demo.add_argument("--index", type=Path, default=None,
                      help="where the demo index lives (default: $RAGKV_CACHE_DIR/demo-index)")
    demo.add_argument("--model", default="smollm2-135m-instruct",
                      help="model spec: HF directory, hub id, .gguf file, or the default")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap")
    demo.set_defaults(func=_run_demo)

    from ragkv.cli.index import add_index_parser

    add_index_parser(sub)
    from ragkv.cli.query import add_query_parser
    from ragkv.cli.serve import add_serve_parser

    add_serve_parser(sub)
    add_query_parser(sub)
    from ragkv.cli.bench import add_bench_parser
    from ragkv.cli.eval import add_eval_parser

    add_eval_parser(sub)
    add_bench_parser(sub)
    from ragkv.cli.system_prompt_eval import add_parser as add_instructions_eval_parser

    add_instructions_eval_parser(sub)
    from ragkv.cli.check_model import add_check_model_parser

    add_check_model_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "index"):
        from ragkv.cli.environment import warn_unknown_env

        warn_unknown_env()
    try:
        return int(args.func(args))
    except (RagKVError, ValueError) as exc:
        print(f"ragkv: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
