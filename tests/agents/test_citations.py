"""Cited answers: every [n] an answer carries names a chunk retrieved for it.

The guarantee is the grammar's, so it is tested where a model is least likely to keep
it by itself: the tiny random Llama, sampled, over 100 random questions. The shipped
model's cited answers go through the OpenAI API once.
"""

from __future__ import annotations

import random
import re

import pytest

from ragkv.client import RagClient
from tests.server.fakes import ServerThread

WORDS = ("paris capital france secret number fox quick brown dog alice bob met kv cache chunk blends query "
         "time lazy jumps stores every").split()


def test_every_citation_of_100_random_questions_names_a_retrieved_chunk(tiny_server: ServerThread) -> None:
    rng = random.Random(7)
    cited = 0
    with RagClient(tiny_server.addr, timeout=60) as client:
        for i in range(100):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) + "?"
            top_k = rng.randint(1, 4)
            stream = client.query(question, top_k=top_k, citations=True, temperature=1.0, seed=i, max_new_tokens=64)
            stats = stream.result()
            retrieved = [c.chunk_id for c in stream.chunks]
            markers = re.findall(r"\[(\d+)\]", stats.text)
            assert stats.text.count("[") == len(markers), stats.text  # every "[" opens a citation
            assert [str(c.number) for c in stats.citations] == markers
            for c in stats.citations:
                assert 1 <= c.number <= len(retrieved) and c.chunk_id == retrieved[c.number - 1]
                assert stats.text[c.start:c.end] == f"[{c.number}]" and 0 <= c.sentence_start <= c.start
            cited += len(markers)
    assert cited > 0  # the random model did write citations (6 here): the checks above were not vacuous


def test_without_citations_a_bracket_is_just_text(tiny_server: ServerThread) -> None:
    with RagClient(tiny_server.addr, timeout=60) as client:
        stats = client.query("paris secret?", top_k=2, temperature=1.0, seed=3, max_new_tokens=24).result()
    assert stats.citations == ()


@pytest.mark.real_model
def test_smollm2_cited_answer_over_the_openai_api(smol_server: ServerThread) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_server.server.http_port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is the secret number?"}],
                                       max_tokens=48, extra_body={"citations": True, "top_k": 3})
    extra = r.model_extra["ragkv"]
    retrieved = [s["chunk_id"] for s in extra["sources"]]
    text = r.choices[0].message.content
    assert text and len(re.findall(r"\[(\d+)\]", text)) == len(extra["citations"]) == text.count("[")
    for c in extra["citations"]:
        assert c["chunk_id"] == retrieved[c["number"] - 1] and text[c["start"]:c["end"]] == f"[{c['number']}]"
