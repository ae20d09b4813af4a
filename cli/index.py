"""``ragkv index``: build, update, resume or merge an index from the command line.

    ragkv index CORPUS --out INDEX_DIR [options]   index a folder (resumable, incremental)
    ragkv index demo --out INDEX_DIR              build the demo corpus, then index it
    ragkv index merge --out INDEX_DIR             merge shard outputs into one index

CORPUS and INDEX_DIR may be ``s3://bucket/prefix``: the corpus is fetched and the index
built in a local staging folder (``--staging``), then uploaded (``retriever.remote``). A
rerun fetches what an earlier, interrupted run uploaded and resumes from it.

Heavy imports (torch, FAISS, sentence-transformers) happen only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from ragkv.indexer.chunking import DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP_TOKENS
from ragkv.indexer.neighbours import INDEX_DEFAULT, INDEX_KV_COMPRESSION, PLAIN_COPY_COMPRESSION
from ragkv.indexer.spot import DEFAULT_IMDS_ENDPOINT, EXIT_INTERRUPTED, IndexInterrupted
from ragkv.types import DType

KV_COMPRESSIONS = ["none", "int8", "fp8", "int4", "int2"]  # kvstore.compression.Compression (no torch import here)

ENV_KV_URIS = "RAGKV_KV_URIS"  # comma-separated default for --kv-store
ENV_IMDS = "RAGKV_IMDS_ENDPOINT"  # IMDS base URL; setting it turns the Spot watcher on
ENV_NAMES = (ENV_KV_URIS, ENV_IMDS)  # every RAGKV_ variable `ragkv index` reads itself
DEMO = "demo"
MERGE = "merge"


def _share(text: str) -> float:
    """argparse type: a share in [0, 1]."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {x:g}")
    return x


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_index_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``index`` on the ``ragkv`` subcommands."""
    p = sub.add_parser(
        "index",
        help="split a corpus into chunks, embed them and precompute their KV",
        description=(
            "Index CORPUS (a folder of .txt, .md and .jsonl files) into --out: chunks by the "
            "LLM's tokenizer, sentence-transformers embeddings, a FAISS index, and every chunk's "
            "KV in kvstore. Rerun the same command to resume after a crash or to update after the "
            "corpus changed. `ragkv index demo --out DIR` indexes the built-in demo corpus; "
            "`ragkv index merge --out DIR` merges the shard outputs of --shard runs. Exits "
            f"{EXIT_INTERRUPTED} when stopped by SIGTERM or a Spot notice (rerun to resume)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("corpus", metavar="CORPUS",
                   help=f"corpus folder or s3://bucket/prefix, or `{DEMO}`, or `{MERGE}`")
    p.add_argument("--out", required=True,
                   help="index folder, or s3://bucket/prefix (built in --staging, then uploaded)")
    p.add_argument("--staging", type=Path, default=None,
                   help="local folder an s3:// --out is built in (default: $RAGKV_CACHE_DIR/staging/BUCKET/PREFIX)"),
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="LLM: HF directory, hub id, .gguf file, or a shipped model (gemma3-270m with the gemma extra)")
    p.add_argument("--embedder", default="all-MiniLM-L6-v2",
                   help="sentence-transformers model directory, or the shipped default")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per chunk at most")
    p.add_argument("--chunk-overlap", type=int, default=DEFAULT_OVERLAP_TOKENS,
                   help="tokens shared by consecutive chunks at most")
    p.add_argument("--kv-store", action="append", dest="kv_stores", metavar="URI",
                   help="kvstore tier to write, repeatable: disk:/path or s3://bucket/prefix "
                        f"(default: ${ENV_KV_URIS}, else disk:OUT/kv, which a rerun also clears of the KV "
                        "no chunk reads any more: deleted and changed documents')")
    p.add_argument("--no-kv", action="store_true", help="skip KV precompute (chunks and vectors only)")
    p.add_argument("--system-prompt", default=None, metavar="TEXT|@FILE",
                   help="the system prompt answers from this index get (it is in every chunk's KV, so changing "
                        "it means a new index); @FILE reads it from a file (default: the built-in one)")
    p.add_argument("--kv-compression", choices=KV_COMPRESSIONS, default=None,
                   help="how KV files store K and V: int4 (the default for a new index; a rerun keeps what the "
                        "index was built with; KIVI: keys per channel, values per token, "
                        "in groups) stores 0.31x of bf16's bytes, int2 0.19x; int8/fp8 per-channel quantization "
                        "0.51x; none keeps the model's dtype (float32 on a CPU: 2x bf16), which a CPU reading "
                        "from the page cache serves fastest; see docs/kv-compression.md")
    p.add_argument("--neighbours", type=int, default=INDEX_DEFAULT.m, metavar="M",
                   help="neighbour-conditioned KV: prefill each chunk after its M most similar chunks (by the "
                        "index's embeddings); 0 = plain KV (one neighbour brings blend and focus closest to full "
                        "prefill on MuSiQue: docs/quality.md)")
    p.add_argument("--neighbour-budget", type=int, default=INDEX_DEFAULT.budget_tokens, metavar="TOKENS",
                   help="most neighbour tokens before a chunk, the nearest kept")
    p.add_argument("--neighbour-choice", choices=["nearest", "random"], default="nearest",
                   help="neighbours by similarity, or at random (a control); default nearest")
    p.add_argument("--neighbour-context", choices=["tokens", "kv"], default=INDEX_DEFAULT.context.value,
                   help="kv (default): every chunk's plain KV is stored too (see --plain-kv-compression) and "
                        "serves a prompt's first chunk, which follows the prefix alone, exactly; each chunk is "
                        "computed after its neighbours' plain KV, so only its own tokens run (2.2x plain "
                        "indexing at m = 1); tokens: the neighbours' tokens, cut to the budget, are prefilled "
                        "with every chunk and only its neighbour KV is stored (2.2x at m = 1, budget 512; "
                        "docs/quality.md)")
    p.add_argument("--plain-kv-compression", choices=KV_COMPRESSIONS, default=PLAIN_COPY_COMPRESSION,
                   help="with --neighbour-context kv: how the plain copies store K and V (default int8: with "
                        "int4 neighbour KV the index then holds 0.82x the bytes of one bf16 copy)")
    p.add_argument("--calibrate", choices=["on", "off"], default="on",
                   help="on (default): measure blend against full prefill at a few recompute ratios on a sample of "
                        "the corpus's own chunk sets, with questions made from the chunks, and record it in the "
                        "manifest; `ragkv serve` then serves the cheapest ratio that meets --fidelity-kl (1 set per "
                        "100 chunks, 4 to 32: a few percent of a large corpus's indexing, +49%% on the demo's 54 "
                        "chunks; measured again when --recalibrate-after of the chunks changed). off: the server's default ratio")
    p.add_argument("--calibration-sets", type=_positive_int, default=None, metavar="N",
                   help="chunk sets calibration measures (default: 1 per 100 chunks, 4 to 32). Fewer cost less "
                        "and predict less: the standard error of each ratio's KL is in the manifest; an index "
                        "calibrated with another number is measured again")
    p.add_argument("--recalibrate-after", type=_share, default=0.5, metavar="SHARE",
                   help="keep the index's calibration until the chunks whose KV changed since it was measured "
                        "(added, changed, deleted, or computed after other neighbours) reach this share of those it "
                        "was measured on (default 0.5: on 400 chunks or more, measuring again costs about what indexing "
                        "4.5%% of them does, so at most ~9%% of the indexing those changes took); 0: measure again "
                        "on any change")
    p.add_argument("--shard", metavar="i/N",
                   help="index only shard i of N (default: AWS_BATCH_JOB_ARRAY_INDEX/_SIZE when set)")
    p.add_argument("--device", default=DType.AUTO.value, help="torch device; auto = cuda when torch sees a GPU, else cpu")
    p.add_argument("--skip-model-check", action="store_true",
                   help="index without the start-up correctness gate (ragkv check-model); logged as a warning: "
                        "KV of a model the engine computes wrongly is wrong")
    p.add_argument("--dtype", default=DType.AUTO.value, choices=[d.value for d in DType],
                   help="LLM dtype; auto = bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kv-batch", type=int, default=4, help="chunks prefilled per checkpoint")
    p.add_argument("--runner", choices=["local", "ray"], default="local",
                   help="where KV is computed: this process, or Ray actors holding one model each "
                        "(needs pip install 'ragkv[ray]')")
    p.add_argument("--ray-address", default=None,
                   help="--runner ray: cluster to join (`auto`, `ray://host:10001`); "
                        "default: $RAY_ADDRESS, else a new local Ray instance")
    p.add_argument("--ray-workers", type=int, default=0,
                   help="--runner ray: actors (models loaded); 0 = one per GPU with --device cuda, else one per CPU")
    p.add_argument("--embed-batch", type=int, default=64, help="chunks embedded per checkpoint")
    p.add_argument("--imds-endpoint", default=os.environ.get(ENV_IMDS),
                   help="poll this IMDS for Spot interruption notices "
                        f"(default: ${ENV_IMDS}; {DEFAULT_IMDS_ENDPOINT} when AWS_BATCH_JOB_ID is set)")
    p.add_argument("--imds-interval", type=float, default=5.0, help="seconds between IMDS polls")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_index_command)
    return p


def read_system_prompt(value: str | None) -> str | None:
    """``--system-prompt``: the text itself, or ``@FILE`` to read it from a file; None = the default.

    Raises:
        ValueError: The text (or the file) is empty, or the file cannot be read.
    """
    if value is None:
        return None
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--system-prompt {value!r}: cannot read {path}: {exc}") from None
        value = value.strip()
    if not value.strip():
        raise ValueError("--system-prompt is empty: give the text, or @FILE naming a file with it")
    return value


def _kv_compression(asked: str | None, index_dir: Path) -> str:
    """--kv-compression as given; left out, what the index in `index_dir` was built with (a rerun
    resumes it: the default changed from none to int4 in issue 56), else INDEX_KV_COMPRESSION."""
    if asked is not None:
        return asked
    from ragkv.retriever.manifest import read_manifest

    built = read_manifest(index_dir)
    return built.kv_compression if built is not None else INDEX_KV_COMPRESSION


def _staging(args: argparse.Namespace, what: str, uri: str) -> Path:
    from ragkv.engine.model_loading import cache_dir
    from ragkv.retriever.remote import S3Location

    loc = S3Location.parse(uri)
    if what == "out" and args.staging is not None:
        return args.staging
    return loc.cache_dir(cache_dir() / ("staging" if what == "out" else "corpus"))


def run_index_command(args: argparse.Namespace) -> int:
    """Run ``ragkv index``; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="ragkv: %(message)s")
    from ragkv.retriever.remote import S3Location, download, is_s3_uri, upload

    remote = S3Location.parse(args.out) if is_s3_uri(args.out) else None
    out = _staging(args, "out", args.out) if remote else Path(args.out)
    if args.corpus == MERGE:
        from ragkv.indexer.merge import merge_shards
        from ragkv.retriever.manifest import SHARD_DIR

        if remote is not None:  # the shards' own files; their KV stays where it is
            download(remote, out, lambda rel: SHARD_DIR.fullmatch(rel.partition("/")[0]) is not None)
        manifest = merge_shards(out, progress=not args.no_progress)
        if remote is not None:
            upload(out, remote, lambda rel: "/" not in rel)  # the merged index's top-level files
        print(f"merged index {args.out}: {manifest.n_documents} documents, {manifest.n_chunks} chunks, "
              f"{manifest.n_tokens} tokens")
        return 0

    from ragkv.engine.kv.host_allocator import tune_host_allocator

    tune_host_allocator()  # before torch's first large allocation
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, Runner, run_index
    from ragkv.indexer.sharding import resolve_shard
    from ragkv.indexer.spot import SpotWatcher, StopSignal
    from ragkv.retriever.chunk_keys import NeighbourOptions
    from ragkv.retriever.manifest import KV_DIR_NAME

    shard = resolve_shard(args.shard)
    # what this run owns in --out: its shard folder (or the whole index) and the local KV
    mine = (lambda rel: rel.startswith((f"{shard.dir_name()}/", f"{KV_DIR_NAME}/"))) if shard else \
        (lambda rel: not rel.startswith(("shard-", "demo-corpus/")))
    if args.corpus == DEMO:
        from ragkv.indexer.demo_corpus import build_demo_corpus

        corpus = build_demo_corpus(out / "demo-corpus")
    elif is_s3_uri(args.corpus):
        corpus = _staging(args, "corpus", args.corpus)
        download(S3Location.parse(args.corpus), corpus)
    else:
        corpus = Path(args.corpus)
    if remote is not None:  # resume from what an interrupted run uploaded
        download(remote, out, lambda rel: mine(rel) and not rel.startswith(f"{KV_DIR_NAME}/"), missing_ok=True)
    kv = tuple(args.kv_stores or [u for u in os.environ.get(ENV_KV_URIS, "").split(",") if u.strip()])
    from ragkv.engine.device import resolve_device, resolve_dtype  # imports torch: not for --help

    device = resolve_device(args.device)
    config = IndexJobConfig(
        corpus=corpus, out=out, model=args.model, embedder=args.embedder,
        chunking=ChunkingConfig(args.chunk_size, args.chunk_overlap), kv_uris=kv,
        precompute_kv=not args.no_kv, shard=shard, device=device,
        dtype=resolve_dtype(args.dtype, device), kv_batch=args.kv_batch, embed_batch=args.embed_batch,
        progress=not args.no_progress, runner=Runner(args.runner), ray_address=args.ray_address,
        ray_workers=args.ray_workers, system_prompt=read_system_prompt(args.system_prompt),
        kv_compression=INDEX_KV_COMPRESSION, plain_kv_compression=args.plain_kv_compression,
        model_check=not args.skip_model_check, calibrate=args.calibrate == "on",
        calibration_sets=args.calibration_sets, recalibrate_after=args.recalibrate_after,
        neighbours=NeighbourOptions(args.neighbours, args.neighbour_budget, args.neighbour_choice,
                                    context=args.neighbour_context),
    )
    config = replace(config, kv_compression=_kv_compression(args.kv_compression, config.index_dir()))
    if config.runner is Runner.RAY and config.precompute_kv:
        from ragkv.indexer.ray_runner import import_ray

        import_ray()  # a missing extra fails before any work, not after chunking and embedding
    endpoint = args.imds_endpoint or (DEFAULT_IMDS_ENDPOINT if os.environ.get("AWS_BATCH_JOB_ID") else None)
    stop = StopSignal()
    try:
        with SpotWatcher(stop, endpoint, interval_s=args.imds_interval):
            summary = run_index(config, stop)
    except IndexInterrupted as exc:
        if remote is not None:  # the checkpoint goes up, so the retry on another host resumes
            upload(out, remote, mine)
        print(f"ragkv: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if remote is not None:
        upload(out, remote, mine)
    for line in summary.lines():
        print(line)
    if remote is not None:
        print(f"uploaded to {remote.uri}")
    return 0
