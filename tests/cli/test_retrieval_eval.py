"""`ragkv eval --retrieval-only`: the fact corpus, recall and MRR per search mode, one JSON object."""

from __future__ import annotations

import json
import re

import pytest

from ragkv.cli.main import main
from ragkv.cli.retrieval_eval import FactCase, fact_corpus, score_modes


def _json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, f"--retrieval-only must print exactly one line, got {len(out)}"
    return json.loads(out[0])


def _shape(text: str) -> str:
    """A question's wording with its item name taken out."""
    return re.sub(r"[A-Z][a-z]+-\d+", "X", text)


def test_fact_corpus_shape_and_new_wording_each_seed():
    docs, cases = fact_corpus(40, 20, seed=0)
    assert len(docs) == 40 and len(cases) == 20 and len({d["id"] for d in docs}) == 40
    names = [d["metadata"]["item"] for d in docs]
    assert len(set(names)) == 40
    assert len({n.split("-")[0] for n in names}) < 10  # names share bases: only the identifier differs
    for case in cases:  # each answer is stated by exactly the document of the item the question names
        item = next(n for n in names if re.search(rf"\b{re.escape(n)}\b", case.question))
        holders = [d for d in docs if case.answers[0] in d["text"]]
        assert any(d["metadata"]["item"] == item for d in holders)
    assert isinstance(docs[0]["metadata"]["year"], int)
    wordings = [{_shape(c.question) for c in fact_corpus(40, 20, seed=s)[1]} for s in range(4)]
    assert len({frozenset(w) for w in wordings}) > 1  # another seed words its questions differently
    assert fact_corpus(40, 20, seed=3) == fact_corpus(40, 20, seed=3)
    with pytest.raises(ValueError, match="at least 2 documents"):
        fact_corpus(1, 1)


def test_retrieval_only_reports_every_mode_on_the_fact_corpus(tiny_llama_dir, capsys):
    rc = main(["eval", "--retrieval-only", "--synthetic", "facts", "--docs", "40", "--n", "20", "--seed", "1",
               "--model", str(tiny_llama_dir), "--json"])
    assert rc == 0
    out = _json(capsys)
    modes = out["retrieval"]
    assert set(modes) == {"dense", "lexical", "hybrid"}
    for m in modes.values():
        assert m["n"] == 20 and m["top_k"] == 4 and 0.0 <= m["mrr"] <= m["retrieval_recall"] <= 1.0
    assert modes["hybrid"]["retrieval_recall"] >= 0.95
    assert modes["hybrid"]["retrieval_recall"] >= modes["dense"]["retrieval_recall"]
    assert out["source"] == {"synthetic": "facts", "docs": 40, "questions": 20, "seed": 1}
    assert out["fusion"]["method"] == "rrf"


def test_retrieval_only_on_an_index_with_a_reranker(job_config, tiny_lm, embedder, tmp_path, capsys):
    import dataclasses

    from ragkv.indexer.job import run_index
    from ragkv.retriever.rerank import tiny_cross_encoder_dir
    from tests.indexer.helpers import NEEDLE_QUESTION

    run_index(dataclasses.replace(job_config, precompute_kv=False), lm=tiny_lm, embedder=embedder)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "needle", "question": NEEDLE_QUESTION, "answer": "4721"}) + "\n"
                         + json.dumps({"id": "none", "question": "What colour is the sky?",
                                       "answer": ["no such text"]}) + "\n")
    ce = tiny_cross_encoder_dir(tmp_path / "ce")
    rc = main(["eval", "--retrieval-only", "--index", str(job_config.out), "--questions", str(questions),
               "--top-k", "2", "--reranker", str(ce), "--json"])
    assert rc == 0
    out = _json(capsys)["retrieval"]
    assert set(out) == {"dense", "lexical", "hybrid", "reranked"}
    for name in ("dense", "lexical", "hybrid"):
        assert out[name]["retrieval_recall"] == 0.5 and out[name]["mrr"] == 0.5 and out[name]["missed"] == ["none"]


def test_score_modes_counts_rank_of_first_answer():
    class Fake:
        def search(self, question, top_k, mode, rerank):
            texts = {"dense": ["a", "b", "ANSWER"], "lexical": ["ANSWER", "b", "c"], "hybrid": ["x", "y", "z"]}
            return [type("H", (), {"text": t})() for t in texts[mode][:top_k]]

    cases = [FactCase("1", "q", ("answer",))]
    got = score_modes(Fake(), cases, 3, ["dense", "lexical", "hybrid"], rerank=False)
    assert got["dense"]["mrr"] == pytest.approx(1 / 3) and got["dense"]["retrieval_recall"] == 1.0
    assert got["lexical"]["mrr"] == 1.0
    assert got["hybrid"]["retrieval_recall"] == 0.0 and got["hybrid"]["missed"] == ["1"]
