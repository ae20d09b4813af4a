"""search_mode, metadata filters and the reranker through a real server: wire, validation, pipeline.

The index holds a JSONL corpus with typed metadata (ints, bools) and two text files;
a tiny random cross-encoder is served with `reranker=DIR`.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from ragkv.client import RagClient
from ragkv.retry import NO_RETRY
from ragkv.server.settings import CollectionSpec
from ragkv.server.status import InvalidArgumentError
from ragkv.server.validation import RequestLimits, validate_query, validate_retrieve
from ragkv.types import FilterOp, MetadataFilter, Mode, QueryOptions, SearchMode
from tests.server.fakes import ServerThread, settings

DOCS = [
    {"id": "kx-1", "text": "Device Korlin-41 is tracked under code QX-5512 and owned by Dana Novak.",
     "metadata": {"team": "alpha", "year": 2021, "active": True}},
    {"id": "kx-2", "text": "Device Korlin-47 is tracked under code QX-5519 and owned by Omar Khan.",
     "metadata": {"team": "beta", "year": 2023, "active": False}},
    {"id": "kx-3", "text": "Device Korlin-48 is tracked under code QX-5530 and owned by Vera Rossi.",
     "metadata": {"team": "beta", "year": "2023", "active": True}},
]
TEXTS = {"guides/bread.txt": "Knead the dough for ten minutes and let it rise.",
         "guides/space.txt": "Mars has two moons, Phobos and Deimos."}


@pytest.fixture(scope="module")
def search_index(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index

    root = tmp_path_factory.mktemp("search-index")
    corpus = root / "corpus"
    (corpus / "guides").mkdir(parents=True)
    (corpus / "devices.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, text in TEXTS.items():
        (corpus / name).write_text(text)
    run_index(IndexJobConfig(corpus=corpus, out=root / "index", model=str(tiny_llama_dir),
                             chunking=ChunkingConfig(size=64, overlap=0), progress=False))
    return root / "index"


@pytest.fixture(scope="module")
def server(search_index: Path, tmp_path_factory: pytest.TempPathFactory):
    from ragkv.retriever.rerank import tiny_cross_encoder_dir
    from ragkv.server.assembly import build_pipeline

    ce = tiny_cross_encoder_dir(tmp_path_factory.mktemp("ce") / "ce")
    plain = ServerThread(settings(indexes=(CollectionSpec("default", search_index),)), build_pipeline)
    reranked = ServerThread(settings(indexes=(CollectionSpec("default", search_index),), reranker=ce),
                            build_pipeline)
    yield plain, reranked
    plain.stop()
    reranked.stop()


def test_retrieve_each_search_mode(server) -> None:
    plain, _ = server
    with RagClient(plain.addr, timeout=60, retry=NO_RETRY) as client:
        for mode in ("dense", "lexical", "hybrid", None):
            chunks = client.retrieve("Who owns the device with code QX-5519?", top_k=2, search_mode=mode).chunks
            assert len(chunks) == 2, mode
            if mode == "lexical":
                assert "QX-5519" in chunks[0].text and chunks[0].found_by == (SearchMode.LEXICAL,)
            if mode == "dense":
                assert all(c.found_by == (SearchMode.DENSE,) for c in chunks)
            if mode in ("hybrid", None):  # the server's default is hybrid
                assert "QX-5519" in chunks[0].text and set(chunks[0].found_by) == {SearchMode.DENSE,
                                                                                   SearchMode.LEXICAL}


def test_retrieve_filters_keep_json_types(server) -> None:
    plain, _ = server
    with RagClient(plain.addr, timeout=60, retry=NO_RETRY) as client:
        q = "Which planet has two moons?"
        beta = client.retrieve(q, top_k=4, filters={"team": "beta"}).chunks
        assert {c.metadata["team"] for c in beta} == {"beta"} and len(beta) == 2  # filtered before top-k
        year_int = client.retrieve(q, top_k=4, search_mode="dense", filters={"year": 2023}).chunks
        assert [c.metadata["year"] for c in year_int] == [2023]  # the int, not the string "2023"
        assert type(year_int[0].metadata["year"]) is int and year_int[0].metadata["active"] is False
        active = client.retrieve(q, top_k=4, search_mode="lexical", filters={"active": True}).chunks
        assert {c.metadata["team"] for c in active} == {"alpha", "beta"} and len(active) == 2
        guides = client.retrieve(q, top_k=4, filters=[MetadataFilter("source", "guides/", FilterOp.PREFIX)]).chunks
        assert len(guides) == 2 and "Phobos" in guides[0].text
        with pytest.raises(grpc.RpcError) as err:
            client.retrieve(q, filters=[MetadataFilter("source", "", FilterOp.PREFIX)])
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "filters[0]" in err.value.details()


def test_query_filters_and_search_mode(server) -> None:
    plain, _ = server
    with RagClient(plain.addr, timeout=120, retry=NO_RETRY) as client:
        stream = client.query("What is the code of Korlin-48?", top_k=2, mode=Mode.FULL, max_new_tokens=2,
                              search_mode="lexical", filters={"team": "beta"})
        list(stream)
        chunks = stream.chunks
    assert chunks and all(c.metadata["team"] == "beta" for c in chunks)
    assert "QX-5530" in chunks[0].text and chunks[0].found_by == (SearchMode.LEXICAL,)


def test_reranker_scores_come_back(server) -> None:
    plain, reranked = server
    q = "Who owns the device with code QX-5519?"
    with RagClient(reranked.addr, timeout=60, retry=NO_RETRY) as client:
        got = client.retrieve(q, top_k=3).chunks
    with RagClient(plain.addr, timeout=60, retry=NO_RETRY) as client:
        fused = client.retrieve(q, top_k=3).chunks
    scores = [c.score for c in got]
    assert scores == sorted(scores, reverse=True)
    assert 0.0 <= min(scores) and max(scores) <= 1.0  # the one-label cross-encoder's sigmoid, not RRF sums
    assert scores != [c.score for c in fused]


def test_validation_of_search_options() -> None:
    limits = RequestLimits(max_filters=2)
    q, collection, top_k, search_mode, filters = validate_retrieve("q", QueryOptions(search_mode=SearchMode.LEXICAL),
                                                                   limits)
    assert q == "q" and search_mode is SearchMode.LEXICAL and collection == "default" and top_k == 4 and not filters
    params = validate_query("q", QueryOptions(filters=(MetadataFilter("a", 1),)), limits, frozenset(Mode))
    assert params.filters == (MetadataFilter("a", 1),) and params.search_mode is None
    with pytest.raises(InvalidArgumentError, match="at most 2 filters"):
        validate_retrieve("q", QueryOptions(filters=(MetadataFilter("a", 1),) * 3), limits)
    with pytest.raises(InvalidArgumentError, match="search_mode"):
        validate_retrieve("q", QueryOptions(search_mode="sparse"), limits)  # type: ignore[arg-type]


def test_serve_flags_reach_the_retriever(tmp_path: Path) -> None:
    import argparse

    from ragkv.cli.serve import add_serve_parser, settings_from_args
    from ragkv.server.search_config import retriever_options

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--index", str(tmp_path), "--default-search-mode", "lexical",
                              "--fusion", "weighted", "--lexical-weight", "2", "--search-candidates", "20"])
    st = settings_from_args(args, env={})
    opts = retriever_options(st)
    assert opts["default_mode"] is SearchMode.LEXICAL and opts["reranker"] is None
    assert opts["fusion"].method.value == "weighted" and opts["fusion"].lexical_weight == 2.0
    assert opts["fusion"].candidates == 20
    with pytest.raises(FileNotFoundError, match="no cross-encoder"):
        retriever_options(settings_from_args(parser.parse_args(["serve", "--reranker", str(tmp_path)]), env={}))
    with pytest.raises(ValueError, match="fusion must be one of rrf, weighted, got 'bogus'"):
        retriever_options(settings_from_args(parser.parse_args(["serve", "--fusion", "bogus"]), env={}))


def test_query_cli_search_flags(server, capsys: pytest.CaptureFixture[str]) -> None:
    from ragkv.cli.main import main

    plain, _ = server
    rc = main(["query", "What is the code of Korlin-48?", "--addr", plain.addr, "--mode", "full", "--top-k", "2",
               "--max-new-tokens", "2", "--search-mode", "lexical", "--filter", "year=2023",
               "--prefix", "source=devices", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["metadata"]["year"] for c in doc["chunks"]] == [2023]  # the int; "2023" (a str) is filtered out
    assert doc["chunks"][0]["found_by"] == ["lexical"]
