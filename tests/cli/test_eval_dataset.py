"""`ragkv eval --dataset` (CacheBlend's QA format), SQuAD F1 and the fidelity metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ragkv.cli.dataset import DEFAULT_QUESTION_SUFFIX, load_dataset, passage_text
from ragkv.cli.main import main
from ragkv.evals.evaluate import best_f1, squad_normalize, token_f1

SHARED_MUSIQUE = Path(__file__).resolve().parents[3] / "shared" / "data" / "musique_dev.json"


def test_squad_normalization_and_token_f1():
    assert squad_normalize("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert squad_normalize("An apple a day") == "apple day"
    assert squad_normalize("theatre") == "theatre"  # 'the' only as a word
    assert token_f1("Exeter College.", "exeter college") == 1.0
    assert token_f1("He studied at Exeter College, Oxford", "Exeter College") == pytest.approx(0.5)  # P 2/6, R 1
    assert token_f1("Oxford", "Exeter College") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalize to nothing
    assert token_f1("", "Paris") == 0.0
    assert token_f1("paris paris", "paris") == pytest.approx(2 / 3)  # counts, not sets
    assert best_f1("Paris", ["London", "paris, France"]) == pytest.approx(2 / 3)
    assert best_f1("Paris", []) == 0.0


def _write(tmp_path, rows) -> Path:
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(rows))
    return path


def _row(i: int, n_ctx: int = 3) -> dict:
    return {"question": f"Who owns vault {i}?", "answers": [f"Owner {i}", f"O{i}"],
            "ctxs": [{"title": f"T{i}-{j}" if j else "", "text": f"Passage {j} of row {i}. Vault {i} is owned by Owner {i}."}
                     for j in range(n_ctx)]}


def test_dataset_parsing(tmp_path):
    path = _write(tmp_path, [_row(0), _row(1), _row(2)])
    cases, passages = load_dataset(path, n=2, ctxs=2, question_suffix=" Short.")
    assert [c.id for c in cases] == ["q0", "q1"]
    assert cases[0].question == "Who owns vault 0? Short." and cases[0].answers == ("Owner 0", "O0")
    assert cases[0].chunks == ("Passage 0 of row 0. Vault 0 is owned by Owner 0.",
                               "T0-1\nPassage 1 of row 0. Vault 0 is owned by Owner 0.")
    assert len(passages) == 9  # every passage of the file, the rows past --n too
    assert passage_text({"title": "", "text": " x "}) == "x"
    cases, _ = load_dataset(path, ctxs=3)
    assert len(cases) == 3 and cases[0].question.endswith(DEFAULT_QUESTION_SUFFIX)


@pytest.mark.parametrize("rows, match", [
    ("not json", "not JSON"),
    ([], "non-empty JSON list"),
    ([{"answers": ["a"], "ctxs": []}], r"row 0: field 'question'"),
    ([{"question": "q", "answers": "a", "ctxs": []}], r"row 0: field 'answers'"),
    ([{"question": "q", "answers": [], "ctxs": [{"text": "t"}]}], "non-empty list of strings"),
    ([{"question": "q", "answers": ["a"], "ctxs": [{"title": "t"}]}], r"ctxs\[0\]"),
    ([{"question": " ", "answers": ["a"], "ctxs": [{"text": "t"}]}], "question is empty"),
    ([{"question": "q", "answers": ["a"], "ctxs": [{"text": "t"}]}], "--ctxs asks for 2"),
])
def test_dataset_errors_name_the_row_and_field(tmp_path, rows, match):
    path = tmp_path / "bad.json"
    path.write_text(rows if isinstance(rows, str) else json.dumps(rows))
    with pytest.raises(ValueError, match=match):
        load_dataset(path, ctxs=2)


def test_dataset_missing_file_and_too_few_rows(tmp_path):
    with pytest.raises(ValueError, match="cannot read dataset .*nope.json"):
        load_dataset(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="1 questions, but --n asks for 5"):
        load_dataset(_write(tmp_path, [_row(0)]), n=5, ctxs=2)


def test_eval_dataset_with_neighbour_kv_json(tiny_llama_dir, tmp_path, capsys):
    path = _write(tmp_path, [_row(i) for i in range(4)])
    rc = main(["eval", "--dataset", str(path), "--n", "2", "--ctxs", "2", "--model", str(tiny_llama_dir),
               "--modes", "full,reuse,blend", "--ratio", "1.0", "--neighbours", "0,1", "--neighbour-budget", "32",
               "--neighbour-context", "tokens,kv", "--instruction", "Answer from the passages.", "--question-suffix", " Briefly.",
               "--max-new-tokens", "4", "--partial", str(tmp_path / "partial.json"),
               "--pool-embeddings", str(tmp_path / "pool.npy"), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert set(out["modes"]) == {"full", "reuse", "blend", "reuse+nb1", "blend+nb1", "reuse+nb1kv", "blend+nb1kv"}
    assert json.loads((tmp_path / "partial.json").read_text())["modes"] == out["modes"]  # after the last case
    assert np.load(tmp_path / "pool.npy").shape[0] == 12  # every passage of the file, kept for the next run
    full = out["modes"]["full"]
    assert full["n"] == 2 and full["f1_vs_full"] == 1.0 and full["first_token_agreement"] == 1.0
    assert full["kl_answer"] == full["kl_answer_max"] == 0.0
    for name in ("blend", "blend+nb1", "blend+nb1kv"):  # ratio 1.0 is full prefill, whatever KV it starts from
        m = out["modes"][name]
        assert m["kl_mean"] < 1e-6 and m["f1_vs_full"] == 1.0 and m["first_token_agreement"] == 1.0
        assert m["kl_answer_max"] < 1e-5  # and so at every answer position
    for name, m in out["modes"].items():
        assert 0.0 <= m["f1"] <= 1.0 and 0.0 <= m["f1_vs_full"] <= 1.0
        # the answer's KLs include the first position's: each case's highest is at least it
        assert m["kl_answer_max"] >= m["kl_mean"] - 1e-9 and m["kl_answer_max"] >= m["kl_answer"] - 1e-9
        assert (m["kv_prefill_median_s"] > 0) == (name != "full")
    assert out["modes"]["reuse"]["kl_answer_max"] > 0  # reuse is not full prefill on a random model
    assert out["config"]["instruction"] == "Answer from the passages."


def test_eval_names_a_bad_neighbour_context(tiny_llama_dir, tmp_path, capsys):
    path = _write(tmp_path, [_row(i) for i in range(2)])
    rc = main(["eval", "--dataset", str(path), "--n", "1", "--ctxs", "2", "--model", str(tiny_llama_dir),
               "--modes", "full,reuse", "--neighbours", "0,1", "--neighbour-context", "text", "--json"])
    assert rc != 0
    assert "--neighbour-context takes a comma list of tokens, kv, got 'text'" in capsys.readouterr().err


def test_eval_synthetic_reports_fidelity_on_the_kv_ragkv_index_builds(tiny_llama_dir, capsys):
    """With no --neighbours, the chunk KV is what `ragkv index` builds by default."""
    from ragkv.indexer.neighbours import INDEX_DEFAULT

    rc = main(["eval", "--synthetic", "niah", "--model", str(tiny_llama_dir), "--n", "1", "--context", "128",
               "--chunk-tokens", "64", "--modes", "full,reuse", "--max-new-tokens", "3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert INDEX_DEFAULT.m == 1 and set(out["modes"]) == {"full", "reuse+nb1kv"}
    assert out["config"]["neighbour_budget"] == INDEX_DEFAULT.budget_tokens
    m = out["modes"]["reuse+nb1kv"]
    assert {"f1", "f1_vs_full", "first_token_agreement", "kl_mean", "agreement"} <= set(m)
    assert m["kv_prefill_median_s"] > 0


def test_the_evals_default_kv_serves_the_first_chunk_from_its_stored_plain_copy(tiny_llama_dir, tmp_path,
                                                                                capsys, monkeypatch):
    """As a server does over the default index (`NeighbourOptions.plain_first`): the prompt's
    first chunk reads its plain KV as the index stores it (int8), the later ones their neighbour KV."""
    from ragkv.engine.runtime import Engine

    seen: list[list[tuple[bool, int]]] = []
    run = Engine.run

    def spy(self, prompt, mode, *args, **kwargs):
        if prompt.chunks is not None:
            seen.append([(bool(ch.after_context), int(ch.positions[0])) for ch in prompt.chunks])
            exact = self.prefill(prompt.prefix_ids, prompt.chunk_ids[0])
            assert not torch.equal(prompt.chunks[0].k, exact.k)  # the int8 copy, not the float KV
            torch.testing.assert_close(prompt.chunks[0].k, exact.k, atol=0.05, rtol=0.05)
        return run(self, prompt, mode, *args, **kwargs)

    monkeypatch.setattr(Engine, "run", spy)
    path = _write(tmp_path, [_row(i) for i in range(4)])
    rc = main(["eval", "--dataset", str(path), "--n", "1", "--ctxs", "3", "--model", str(tiny_llama_dir),
               "--modes", "full,reuse", "--max-new-tokens", "2", "--pool-embeddings", str(tmp_path / "pool.npy"),
               "--json"])
    assert rc == 0
    assert set(json.loads(capsys.readouterr().out.strip())["modes"]) == {"full", "reuse+nb1kv"}
    (first, *later), = seen
    assert first[0] is False and all(after for after, _ in later)
    assert all(start > first[1] for _, start in later)  # computed after a neighbour: past the prefix


def test_shared_musique_file_parses():
    if not SHARED_MUSIQUE.is_file():
        pytest.skip(f"the shared MuSiQue file is missing: {SHARED_MUSIQUE} (see shared/data/README.md)")
    cases, passages = load_dataset(SHARED_MUSIQUE, n=30, ctxs=5)
    assert len(cases) == 30 and all(len(c.chunks) == 5 and c.answers for c in cases)
    assert len(passages) > 30 * 5  # the neighbour pool is every passage of the file
