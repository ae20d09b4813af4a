"""The server decoding over one KV pool (--decode-pool on, as on CUDA; eager on this CPU): the
answers of ragged decode, concurrent requests batched over the pool, every run given back, and
/metrics saying which path each step took."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from tests.server.fakes import ServerThread, build_index, settings

CORPUS = {
    "paris.txt": "Paris is the capital of France. The secret number is 4721. It was chosen by Alice.",
    "fox.txt": "The quick brown fox jumps over the lazy dog. Alice met Bob by the river in spring.",
    "ragkv.txt": "ragkv stores the KV cache of every chunk and blends them at query time, fast.",
}
QUESTIONS = ["What is the secret number?", "Who met Bob?", "What does ragkv store?", "Where is Paris?"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path):
    from ragkv.server.assembly import build_pipeline

    spec = (CollectionSpec("docs", build_index(tmp_path_factory.mktemp("pool-index"), CORPUS, tiny_llama_dir)),)
    pooled = ServerThread(settings(indexes=spec, metrics_port=0, decode_pool="on"), build_pipeline)
    ragged = ServerThread(settings(indexes=spec, decode_pool="off"), build_pipeline)
    yield pooled, ragged
    pooled.stop()
    ragged.stop()


def _answers(addr: str, mode: str) -> list[tuple[str, int]]:
    """The questions asked at once (so their decode steps batch): each answer's text and tokens."""
    out: dict[int, tuple[str, int]] = {}

    def ask(i: int) -> None:
        with RagClient(addr) as client:
            stream = client.query(QUESTIONS[i], collection="docs", mode=mode, top_k=2, max_new_tokens=12)
            out[i] = ("".join(stream), stream.result().usage.completion_tokens)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [out[i] for i in range(len(QUESTIONS))]


@pytest.mark.parametrize("mode", ["full", "blend"])
def test_pooled_decode_answers_as_ragged_decode_and_gives_every_run_back(servers, mode: str) -> None:
    pooled, ragged = servers
    answers = _answers(pooled.addr, mode)
    assert answers == _answers(ragged.addr, mode)
    assert sum(n for _, n in answers) > len(answers)  # they decoded past their first tokens
    decoder = pooled.server.service.backend.engine.decoder
    assert decoder is not None and decoder.stats.eager_steps > 0
    assert decoder.pool.used == 0, "a finished request kept its run in the pool"
    assert ragged.server.service.backend.engine.decoder is None
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{pooled.server.metrics_port}/metrics", timeout=10).read()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.decode().splitlines()
             if ln.startswith("ragkv_decode_steps_total")}
    assert lines['ragkv_decode_steps_total{path="eager"}'] == decoder.stats.eager_steps > 0
    assert lines['ragkv_decode_steps_total{path="graph"}'] == 0  # no CUDA: no graphs
