"""A fake QueryBackend and an in-thread server harness for the gRPC-layer tests."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence

from ragkv.errors import IndexMismatchError
from ragkv.types import (
    CollectionInfo,
    CollectionStats,
    FinishReason,
    Mode,
    RetrievedChunk,
    Tier,
    TierStats,
)
from ragkv.server.inprocess import InProcessServer
from ragkv.server.backend import ChunksEvent, DoneEvent, PreparedQuery, QueryParams, TokenEvent
from ragkv.server.settings import ServerSettings
from ragkv.server.status import UnknownCollectionError

TIERS = (Tier.CPU, Tier.DISK, Tier.COMPUTED, Tier.GPU)
CORPUS = tuple(
    RetrievedChunk(
        chunk_id=f"doc{i}#0",
        score=1.0 - i / 10,
        text=f"chunk number {i} " + "lorem ipsum " * 5,
        metadata={"source": f"doc{i}.txt"},
        num_tokens=12,
    )
    for i in range(8)
)


class FakeBackend:
    """Deterministic answers: the question's words, one piece each, then "<eos>".

    Questions containing "boom" raise inside answer(); the collection "mismatch"
    fails prepare() with IndexMismatchError. Every answer's fate is recorded.
    """

    def __init__(self, token_delay: float = 0.0, n_pieces: int | None = None) -> None:
        self.token_delay = token_delay  # seconds slept before each piece
        self.n_pieces = n_pieces  # fixed answer length in pieces; None = question words
        self.started: list[str] = []  # questions the engine thread picked up
        self.finished: list[str] = []  # answered to the end
        self.cancelled: list[str] = []  # stopped by the cancel flag
        self.active = 0  # answers running right now (must stay <= 1)
        self.max_active = 0

    @property
    def modes(self) -> frozenset[Mode]:
        return frozenset({Mode.FULL, Mode.PREFIX, Mode.REUSE, Mode.BLEND, Mode.FOCUS})

    def collections(self) -> Sequence[CollectionInfo]:
        return [
            CollectionInfo("default", len(CORPUS), "model-fp", "tok-fp"),
            CollectionInfo("mismatch", 1, "other-model-fp", "tok-fp"),
        ]

    def collection_stats(self, name: str) -> CollectionStats:
        info = self._info(name)
        return CollectionStats(info, (TierStats(Tier.CPU, entries=3, bytes_used=300, hits=5, misses=2, bytes_read=1500),
                                      TierStats(Tier.DISK, entries=8, bytes_used=800, hits=2, misses=0, bytes_read=1600)))

    def _info(self, name: str) -> CollectionInfo:
        for info in self.collections():
            if info.name == name:
                return info
        raise UnknownCollectionError(f"collection {name!r} is not served here (served: default, mismatch)")

    def retrieve(self, collection: str, question: str, top_k: int, search: object = None) -> tuple[RetrievedChunk, ...]:
        self._info(collection)
        return CORPUS[:top_k]

    def prepare(self, params: QueryParams) -> PreparedQuery:
        if self._info(params.collection).name == "mismatch":
            raise IndexMismatchError("index built with model other-model-fp, server runs model-fp")
        return PreparedQuery(params, self.retrieve(params.collection, params.question, params.top_k), {"retrieve": 0.001})

    def answer(self, prepared: PreparedQuery, cancel: threading.Event) -> Iterator[object]:
        q = prepared.params.question
        self.started.append(q)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            chunks = tuple(
                dataclasses.replace(c, kv_tier=TIERS[i % len(TIERS)]) for i, c in enumerate(prepared.chunks)
            )
            yield ChunksEvent(chunks)
            if "boom" in q:
                raise RuntimeError("engine exploded")
            words = q.split() if self.n_pieces is None else [f"w{i}" for i in range(self.n_pieces)]
            pieces = [w + " " for w in words][: prepared.params.max_new_tokens]
            for piece in pieces:
                if self.token_delay:
                    time.sleep(self.token_delay)
                if cancel.is_set():
                    self.cancelled.append(q)
                    return
                yield TokenEvent(piece)
            finish = FinishReason.LENGTH if len(pieces) == prepared.params.max_new_tokens else FinishReason.STOP
            recompute = 1.0 if prepared.params.mode is Mode.FULL else prepared.params.recompute_ratio
            yield DoneEvent(
                prompt_tokens=10 + 12 * len(chunks),
                cached_prompt_tokens=12 * len(chunks),
                completion_tokens=len(pieces),
                recompute_fraction=recompute,
                finish_reason=finish,
                phase_seconds={"kv_load": 0.002, "decode": 0.003},
                bytes_loaded={Tier.CPU: 1000, Tier.DISK: 2000},
            )
            self.finished.append(q)
        finally:
            if cancel.is_set() and q not in self.cancelled and q not in self.finished:
                self.cancelled.append(q)
            self.active -= 1


class ServerThread(InProcessServer):
    """A RagServer on 127.0.0.1 in its own event loop thread (tests assert it loaded)."""

    def __init__(self, settings: ServerSettings, factory, wait_loaded: bool = True) -> None:  # noqa: ANN001
        super().__init__(settings, factory, wait_loaded=False)
        if wait_loaded:
            assert self.wait_loaded(30.0)
        self.addr = f"127.0.0.1:{self.port}"


def settings(**overrides: object) -> ServerSettings:
    """Loopback settings for tests: any free port, no metrics port unless asked.

    The loading controller is off unless asked: a tiny model computes a chunk faster than
    any tier reads it, so with it on these tests' reads (the paths they test) would be
    replaced by recomputes. tests/server/test_loading_controller.py tests it on.

    The KV tree is off unless asked, for the same reason: a test repeating a question would
    be served its prompt's KV from the tree, not by the tiers it tests.
    tests/server/test_kv_tree.py tests it on."""
    base = {"host": "127.0.0.1", "port": 0, "metrics_port": None, "kv_controller": False, "kv_tree_bytes": 0}
    base.update(overrides)
    return ServerSettings(**base)
