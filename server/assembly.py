"""A serving pipeline built from settings: the indexes synced and opened, the model loaded and
gated, the engine built with its KV tree and step sizes, each collection's KV store and served
ratio, and the engine's prefill rate measured once.

`ragkv serve`, a cluster's replicas and the benches call `build_pipeline`; tests that share one
loaded model call `assemble_pipeline`. `server/pipeline.py` holds the `Pipeline` this builds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ragkv.engine import Engine, LoadedModel, TreeConfig, load_model
from ragkv.engine.check import gate_model
from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT
from ragkv.errors import IndexMismatchError
from ragkv.kvstore import Compression, StoreConfig, TieredStore, TierSpec, hash_prefix
from ragkv.kvstore.tree_files import TreeFiles
from ragkv.retriever import Retriever
from ragkv.retriever.chunk_keys import NeighbourOptions
from ragkv.server.fidelity import served_ratio
from ragkv.server.loading_controller import ControllerConfig, LoadingController
from ragkv.server.pipeline import Collection, Pipeline
from ragkv.server.search_config import retriever_options
from ragkv.server.settings import ServerSettings
from ragkv.types import Tier

log = logging.getLogger(__name__)

_SEED_TEXT = "The loading controller measures how fast this engine computes a chunk of text like this one."


def build_pipeline(settings: ServerSettings) -> Pipeline:
    """Open every index, load the model (the first index's, unless settings name one), build the
    engine and the pipeline over them.

    Raises:
        FileNotFoundError: An index directory holds no index.
        ModelLoadError: The model cannot be loaded.
    """
    if not settings.indexes:
        raise ValueError("no index to serve: give at least one --index [NAME=]DIR")
    settings = settings.resolved()  # --device/--dtype auto: cuda and bfloat16 when torch sees a GPU
    search = retriever_options(settings)  # search mode, fusion and reranker, shared by every index
    retrievers = {spec.name: (spec.index_dir, Retriever.open(spec.index_dir, device=settings.device, **search))
                  for spec in settings.indexes}
    first = next(iter(retrievers.values()))[1]
    lm = load_model(settings.served_model(first.manifest.model_spec), device=settings.device,
                    dtype=settings.dtype.value)
    gate_model(lm, skip=not settings.model_check)
    return assemble_pipeline(lm, retrievers, settings)


def assemble_pipeline(lm: LoadedModel, retrievers: dict[str, tuple[Path, Retriever]],
                      settings: ServerSettings) -> Pipeline:
    """The pipeline over a loaded model and opened retrievers: an engine of the settings' own
    (its KV tree, its step sizes), each collection's store and served ratio, the prefill rate
    measured (tests share one loaded model between pipelines of different settings)."""
    engine = Engine(lm, tree=tree_config(settings, lm), step_tokens=settings.prompt_step_tokens,
                    step_s=settings.prompt_slice_s, decode=settings.decode())
    collections = {}
    for name, (index_dir, retriever) in retrievers.items():
        manifest = retriever.manifest
        mismatch = None
        try:
            retriever.check_model(lm.fingerprint, lm.tokenizer_fingerprint)
        except IndexMismatchError as exc:
            mismatch = f"collection {name!r}: {exc}"
            log.warning("%s", mismatch)
        store = TieredStore(store_config(settings, Path(index_dir), manifest.kv_uris, lm.device,
                                         manifest.kv_compression),
                            lm.fingerprint, lm.tokenizer_fingerprint)
        served = served_ratio(name, manifest.calibration, settings.fidelity_kl, settings.default_recompute_ratio)
        log.info("%s", served.reason)
        collections[name] = Collection(name, retriever, store, tuple(manifest.prefix_ids),
                                       hash_prefix(manifest.prefix_ids), mismatch,
                                       manifest.system_prompt or DEFAULT_SYSTEM_PROMPT,
                                       NeighbourOptions.from_dict(manifest.neighbours),
                                       manifest.calibration, served,
                                       # the index's plain copies' own compression, unless --kv-compression names one
                                       Compression(manifest.plain_compression)
                                       if manifest.plain_compression and settings.kv_compression == "auto" else None)
    if engine.decoder is not None and engine.decoder.graphs:  # capture now, not on the first requests
        t0 = time.perf_counter()
        n = engine.decoder.warm()
        log.info("captured %d decode graphs (batch buckets 1-64) in %.1f s", n, time.perf_counter() - t0)
    controller = LoadingController(ControllerConfig(enabled=settings.kv_controller), engine.speed)
    first = next(iter(collections.values()), None)
    if first is not None:
        _seed_speed(engine, first.prefix_ids)
    return Pipeline(engine, collections, settings.focus(), settings.kv_layered, controller, settings.quality_guard_mass,
                    settings.system_prompt_policy, settings.system_prompt_recompute_ratio)


def tree_config(settings: ServerSettings, lm: LoadedModel) -> TreeConfig:
    """The KV tree the settings ask for (`--kv-tree-*`), its disk tier's files for `lm`."""
    files = (TreeFiles(settings.kv_tree_dir, lm.fingerprint, lm.tokenizer_fingerprint)
             if settings.kv_tree_dir is not None else None)
    return TreeConfig(budget_bytes=settings.kv_tree_bytes, tenant_share=settings.kv_tree_key_share,
                      host_bytes=settings.kv_tree_host_bytes, files=files, disk_bytes=settings.kv_tree_disk_bytes,
                      retain_max_s=settings.kv_tree_retain_max_s, retain_default_s=settings.kv_tree_retain_default_s,
                      follow_ups=settings.kv_tree_follow_ups)


def _seed_speed(engine: Engine, prefix_ids: Sequence[int]) -> None:
    """Seed the engine's prefill rate: ~100 tokens after the prefix, once to warm up (the first
    call allocates), once timed. A hybrid (FULL only) learns it from its first requests."""
    if engine.recurrent:
        return
    ids = engine.prompt.chunk_ids(" ".join([_SEED_TEXT] * 4))
    engine.prefill(list(prefix_ids), ids)
    t0 = time.perf_counter()
    engine.prefill(list(prefix_ids), ids)
    engine.speed.observe(len(ids), time.perf_counter() - t0)


def store_config(settings: ServerSettings, index_dir: Path, kv_uris: Sequence[str], device: torch.device,
                 kv_compression: str = "none") -> StoreConfig:
    """The serving store of one index: memory tiers from the settings, then the index's own
    durable tiers, except where the settings name a disk or S3 tier of their own."""
    from ragkv.retriever.manifest import resolve_kv_uris

    memory = [TierSpec(Tier.CPU, budget_bytes=settings.kv_cpu_bytes)]
    if device.type == "cuda" and settings.kv_gpu_bytes > 0:
        memory.insert(0, TierSpec(Tier.GPU, budget_bytes=settings.kv_gpu_bytes))
    # the index's tiers (a relative disk tier lives in the index folder), replaced by the settings' own
    durable = {spec.tier: spec for spec in map(TierSpec.parse, resolve_kv_uris(kv_uris, index_dir))}
    if settings.kv_disk_dir is not None:
        durable[Tier.DISK] = TierSpec(Tier.DISK, path=str(settings.kv_disk_dir))
    if settings.kv_s3_uri is not None:
        durable[Tier.S3] = TierSpec.parse(settings.kv_s3_uri)
    if not durable:
        durable[Tier.DISK] = TierSpec(Tier.DISK, path=str((index_dir / "kv").resolve()))
    # computed KV written back is stored as the index's own files are, unless --kv-compression says otherwise
    compression = kv_compression if settings.kv_compression == "auto" else settings.kv_compression
    writes = None if settings.kv_s3_writeback else frozenset(t for t in durable if t is not Tier.S3)
    return StoreConfig(tiers=(*memory, *durable.values()), compression=Compression(compression), write_through=writes,
                       device=str(device))  # layered reads dequantize compressed files on the engine's device


def fetch_indexes(settings: ServerSettings) -> None:
    """Sync every s3:// collection into its local folder (files already there and current are
    kept, so a restart copies only what changed). The shard folders of a merged index stay in S3.
    `ragkv serve` runs it before loading; in a cluster every replica and the ingress do, on
    their own hosts.

    Raises:
        RagKVError: a bucket cannot be read, or holds no index.
    """
    from ragkv.retriever.manifest import SHARD_DIR
    from ragkv.retriever.remote import S3Location, download

    def wanted(rel: str) -> bool:
        return SHARD_DIR.fullmatch(rel.partition("/")[0]) is None

    for spec in settings.indexes:
        if spec.source is not None:
            download(S3Location.parse(spec.source), spec.index_dir, wanted)
