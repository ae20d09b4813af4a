"""The KV step of indexing: prefill chunks after the shared prefix and write them to kvstore.

Compute and writing overlap: the engine prefills batch i+1 while a writer thread
puts batch i into the store (torch and file I/O both release the GIL), so the
disk tier costs little on top of plain prefill (see bench/indexer_bench.py).

This module and ``indexer.ray_runner`` (which maps ``KVWriter.compute`` and ``write`` over
Ray actors) are the only indexer modules that touch the engine's tensors or kvstore.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragkv.errors import StoreError

if TYPE_CHECKING:  # the engine and kvstore load torch: imported where they run, named here
    from ragkv.engine import ChunkKV, Engine
    from ragkv.kvstore import ChunkKey, KVEntry, TieredStore


@dataclass(frozen=True, slots=True)
class KVItem:
    """One chunk whose KV is to be computed."""

    row: int  # the chunk's row in the chunk database
    kv_key: ChunkKey  # names its KV in the store
    token_ids: tuple[int, ...]  # its token ids (no prefix)
    # tokens prefilled between the prefix and the chunk (its neighbours: indexer.neighbours); () = none
    context_ids: tuple[int, ...] = ()
    context_tag: str = ""  # the options that chose the context (NeighbourOptions.tag()); "" = none
    # the context as the neighbours' own plain KV instead (NeighbourContext.KV): (plain key,
    # token ids) of each, most similar first, cut to context_budget tokens; context_ids then
    # only name the context (in the key)
    context_neighbours: tuple[tuple[ChunkKey, tuple[int, ...]], ...] = ()
    context_budget: int = 0


def open_store(uris: Sequence[str], model_fp: str, tokenizer_fp: str, compression: str = "none") -> TieredStore:
    """A kvstore TieredStore writing through to the tiers named by ``uris``, K and V stored
    as ``compression`` says (none, int8, fp8, int4 or int2)."""
    from ragkv.kvstore import StoreConfig, TieredStore

    config = StoreConfig.from_uris(list(uris), compression=compression)
    return TieredStore(config, model_fp, tokenizer_fp)


class KVWriter:
    """Computes and stores chunks' KV; ``run`` returns after every item is durable.

    Args:
        engine: an ``engine.Engine``.
        store: a kvstore store with ``contains(key)`` and ``put(entry)``.
        prefix_ids: the shared prefix.
    """

    def __init__(self, engine: Engine, store: TieredStore, prefix_ids: Sequence[int]) -> None:
        from ragkv.kvstore import hash_prefix

        self.engine = engine  # engine.Engine
        self.store = store  # kvstore TieredStore (or any object with contains/put)
        self.prefix_ids = list(prefix_ids)  # the shared prefix
        self._prefix_hash = hash_prefix(self.prefix_ids)
        self._lm = engine.lm

    def missing(self, items: Sequence[KVItem]) -> list[KVItem]:
        """The items whose KV is not in the store yet (a resumed run skips the rest)."""
        return [it for it in items if not self.store.contains(it.kv_key)]

    def compute(self, batch: Sequence[KVItem]) -> list[ChunkKV]:
        """Prefill one batch after the prefix (and each item's context): one ``engine.ChunkKV`` per item."""
        if not any(it.context_ids for it in batch):
            return [self.engine.prefill(self.prefix_ids, ids) for ids in [it.token_ids for it in batch]]
        from ragkv.engine.prefill import context_segments

        out = []
        for it in batch:
            if it.context_neighbours:  # the neighbours' stored plain KV: only the chunk's tokens run
                plain = [self._plain(k, ids) for k, ids in it.context_neighbours]
                context = context_segments(plain, it.context_budget)
                out.append(self.engine.prefill(self.prefix_ids, it.token_ids, context_kv=context))
            else:
                out.append(self.engine.prefill(self.prefix_ids, it.token_ids, it.context_ids))
        return out

    def _plain(self, key: ChunkKey, token_ids: Sequence[int]) -> ChunkKV:
        """A neighbour's plain KV as an ``engine.ChunkKV``: from the store (the plain pass wrote
        it), or computed again if no tier has it whole (deleted or corrupted since)."""
        from ragkv.engine import ChunkKV

        hit = self.store.read(key)
        if hit is None:
            return self.engine.prefill(self.prefix_ids, token_ids)
        return ChunkKV.from_stored(hit.entry, self._lm.device, self._lm.dtype)

    def write(self, batch: Sequence[KVItem], kvs: Sequence[ChunkKV]) -> int:
        """Put one computed batch into the store; returns the bytes stored (as encoded: an int8
        plain copy counts its int8 file, not the float KV it was computed as).

        ``compute`` then ``write`` is the per-batch function of every runner: ``run``
        overlaps the two on threads, ``indexer.ray_runner`` calls them in Ray actors.
        """
        nbytes = 0
        for item, kv in zip(batch, kvs):
            nbytes += self.store.put(self._entry(item, kv))
        return nbytes

    def run(
        self,
        batches: Sequence[Sequence[KVItem]],
        on_done: Callable[[Sequence[KVItem], int], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Prefill and store each batch; call ``on_done(batch, nbytes)`` once it is durable.

        Stops after the batch in flight when ``should_stop()`` turns true; every batch
        handed to ``on_done`` is fully written, no other is.
        """
        todo: queue.Queue = queue.Queue(maxsize=2)
        failure: list[BaseException] = []

        def write_loop() -> None:
            while True:
                job = todo.get()
                if job is None:
                    return
                batch, kvs = job
                try:
                    on_done(batch, self.write(batch, kvs))
                except BaseException as exc:  # handed to the caller's thread below
                    failure.append(exc)
                    return

        writer = threading.Thread(target=write_loop, name="kv-writer", daemon=True)
        writer.start()
        try:
            for batch in batches:
                if should_stop() or failure:
                    break
                kvs = self.compute(batch)
                while writer.is_alive():
                    try:
                        todo.put((batch, kvs), timeout=0.5)
                        break
                    except queue.Full:
                        continue
        finally:
            if writer.is_alive():
                todo.put(None)
            writer.join()
        if failure:
            exc = failure[0]
            if isinstance(exc, StoreError):
                raise exc
            raise StoreError(f"writing chunk KV to the store failed: {exc}") from exc

    def _entry(self, item: KVItem, kv: ChunkKV) -> KVEntry:
        from ragkv.kvstore import ChunkContext, KVEntry

        context = ChunkContext(item.context_tag, item.context_ids).hash() if item.context_tag else None
        return KVEntry.of(kv, item.kv_key, self._lm.fingerprint,
                          self._lm.tokenizer_fingerprint, self._prefix_hash, context)
