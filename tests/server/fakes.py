"""A fake QueryBackend and an in-thread server harness for the gRPC-layer tests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from ragkv.engine.request import Answered, ChunkComputed, ChunksReady, Request, TokenOut, Work
from ragkv.errors import IndexMismatchError
from ragkv.server.backend import BackendParts, Prepared
from ragkv.server.inprocess import InProcessServer
from ragkv.server.query import Query
from ragkv.server.settings import ServerSettings
from ragkv.server.status import UnknownCollectionError
from ragkv.types import (
    CollectionInfo,
    CollectionStats,
    FinishReason,
    Mode,
    RetrievedChunk,
    Tier,
    TierStats,
)

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


class _Words:
    """The fake's detokenizer: token i is the answer's word i."""

    def __init__(self, words: list[str]) -> None:
        self.words, self.stopped, self.token_count = words, False, 0

    def push(self, token: int) -> str:
        self.token_count += 1
        return self.words[token]

    def finish(self) -> str:
        return ""


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
        self.asked: dict[Request, Query] = {}  # each prepared request's query (a request hashes by identity)

    @property
    def modes(self) -> frozenset[Mode]:
        return frozenset({Mode.FULL, Mode.PREFIX, Mode.REUSE, Mode.BLEND, Mode.FOCUS})

    def parts(self) -> BackendParts:
        return BackendParts()  # no engine: no KV tree, speed or tiers

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

    def retrieve(self, collection: str, question: str, top_k: int, search_mode: object = None,
                 filters: object = ()) -> tuple[RetrievedChunk, ...]:
        self._info(collection)
        return CORPUS[:top_k]

    def prepare(self, query: Query, hits: object = None) -> Prepared:
        if self._info(query.collection).name == "mismatch":
            raise IndexMismatchError("index built with model other-model-fp, server runs model-fp")
        # as many prompt tokens as its answer counts (Answered.prompt_tokens below)
        request = Request(mode=query.mode, sampling=query.sampling,
                          question_ids=tuple(range(10 + 12 * len(CORPUS[:query.top_k]))))
        request.phase_seconds["retrieve"] = 0.001
        self.asked[request] = query  # the fake answers with the question's words
        return Prepared(request, self.retrieve(query.collection, query.question, query.top_k),
                        length_limit=query.length_limit)

    def detokenizer(self, request: Request) -> _Words:
        return _Words(self._words(request))

    def keep(self, collection: str, request: Request, computed: ChunkComputed) -> None:
        raise AssertionError("the fake computes no chunk KV")

    def _words(self, request: Request) -> list[str]:
        words = self.asked[request].question.split() if self.n_pieces is None else [f"w{i}" for i in range(self.n_pieces)]
        return [w + " " for w in words][:request.sampling.max_new_tokens]

    def work(self, request: Request) -> Work:
        q = self.asked[request].question
        cancel = request.cancel
        self.started.append(q)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            chunks = CORPUS[:self.asked[request].top_k]
            yield ChunksReady(tuple(TIERS[i % len(TIERS)] for i in range(len(chunks))))
            if "boom" in q:
                raise RuntimeError("engine exploded")
            pieces = self._words(request)
            for token, _ in enumerate(pieces):  # token i is the answer's word i (_Words)
                if self.token_delay:
                    time.sleep(self.token_delay)
                if cancel.is_set():
                    self.cancelled.append(q)
                    yield 0  # a step: the scheduler drops the cancelled request here
                yield TokenOut(token)
            finish = FinishReason.LENGTH if len(pieces) == request.sampling.max_new_tokens else FinishReason.STOP
            recompute = 1.0 if request.mode is Mode.FULL else self.asked[request].recompute_ratio
            self.finished.append(q)
            return Answered(
                prompt_tokens=10 + 12 * len(chunks),
                cached_prompt_tokens=12 * len(chunks),
                completion_tokens=len(pieces),
                recompute_fraction=recompute,
                finish_reason=finish,
                phase_seconds={"kv_load": 0.002, "decode": 0.003},
                bytes_loaded={Tier.CPU: 1000, Tier.DISK: 2000},
            )
        finally:
            if cancel.is_set() and q not in self.cancelled and q not in self.finished:
                self.cancelled.append(q)
            self.active -= 1


class ServerThread(InProcessServer):
    """A RagServer on 127.0.0.1 in its own event loop thread (tests assert it loaded)."""

    def __init__(self, settings: ServerSettings, factory, wait_loaded: bool = True) -> None:
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


def build_index(root: Path, texts: dict[str, str], model_dir: Path, chunk_tokens: int = 32) -> Path:
    """An index of `texts` (file name -> text) under `root`, chunk KV by the model in `model_dir`."""
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in texts.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=root / "index", model=str(model_dir), progress=False,
                             chunking=ChunkingConfig(size=chunk_tokens, overlap=0)))
    return root / "index"
