"""`python -m ragkv.cli.system_prompt_eval` on the tiny random Llama: its command line parses, both
paths run on every pair of each split, and at recompute ratio 1.0 the prefix path (the
instructions in front, the chunks' KV moved after them) is full prefill of the prompt sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragkv.cli import system_prompt_eval as system_prompts

CASES = [
    {"question": "Who met Bob?", "answers": ["Alice"],
     "ctxs": [{"title": "Fox", "text": "The quick brown fox jumps over the lazy dog. Alice met Bob."},
              {"title": "Paris", "text": "Paris is the capital of France. The secret number is 4721."}]},
    {"question": "What is the secret number?", "answers": ["4721"],
     "ctxs": [{"title": "Paris", "text": "Paris is the capital of France. The secret number is 4721."},
              {"title": "ragkv", "text": "ragkv stores the KV cache of every chunk and blends it."}]},
]


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(CASES))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert system_prompts.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_at_ratio_one_the_prefix_path_is_full_prefill_of_the_prompt_sent(
        dataset: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--dataset", str(dataset), "--n", "2", "--ctxs", "2", "--prompts", "2", "--model",
               str(tiny_llama_dir), "--ratios", "0.5,1.0", "--max-new-tokens", "4", "--json")
    for split in ("tune", "report"):
        exact = out[split]["prefix@1"]
        assert exact["n"] == 1 and exact["kl_mean"] < 1e-4
        assert exact["top_token_agreement"] == 1.0 and exact["f1_vs_full"] == 1.0
        assert out[split]["suffix"]["n"] == out[split]["prefix@0.5"]["n"] == 1
        assert {"full", "indexed", "suffix", "prefix_first@1", "prefix_second@0.5"} <= set(out[split]["ttft_median_s"])
    # the smallest ratio meeting the KL target on the tune split: 1.0 (exact) when 0.5 does not
    chosen = out["chosen_on_tune"]
    assert chosen["path"] == "prefix" and chosen["ratio"] in (0.5, 1.0)
    assert chosen["ratio"] == 1.0 or out["tune"]["prefix@0.5"]["kl_mean"] <= out["kl_target"]
    assert out["report_of_chosen"]["n"] == 1 and "speedup_first_call" in out["report_of_chosen"]
    assert all(n != out["index_prefix_tokens"] for n in out["prefix_tokens"])  # other prefixes: chunks move


def test_the_built_in_prompts_are_unlike_the_index_and_10_to_300_tokens(smollm2) -> None:
    from ragkv.cli.dataset import DEFAULT_INSTRUCTION

    tok = smollm2.tokenizer  # the shipped model's tokens
    assert len(system_prompts.SYSTEM_PROMPTS) >= 6 and DEFAULT_INSTRUCTION not in system_prompts.SYSTEM_PROMPTS
    lengths = [len(tok(p)["input_ids"]) for p in system_prompts.SYSTEM_PROMPTS]
    assert min(lengths) >= 10 and max(lengths) <= 300, lengths


def test_bad_arguments_name_what_is_wrong(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        system_prompts.main(["--dataset", str(dataset), "--prompts", "1"])
    assert "--prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        system_prompts.main(["--dataset", str(dataset.parent / "missing.json")])
    assert "is not a file" in capsys.readouterr().err


def test_the_chunks_kv_is_what_the_served_index_holds(dataset: Path, tiny_llama_dir: Path) -> None:
    """The eval measures the KV the server reads: the first chunk's plain copy, then neighbour KV
    (computed after a neighbouring passage), as `ragkv index` builds it; not every chunk computed
    right after the prefix, KV no index serves to blend (the eval measured that once, and it put
    the prefix path at 2-3x the KL from full prefill that the served KV gives)."""
    from ragkv.cli.dataset import DEFAULT_INSTRUCTION, load_dataset
    from ragkv.engine import Engine, load_model

    engine = Engine(load_model(str(tiny_llama_dir)), system_prompt=DEFAULT_INSTRUCTION)
    cases, passages = load_dataset(dataset, n=2, ctxs=2)
    kvs = system_prompts.served_kv(engine, cases, passages)(cases[0])
    assert [kv.after_context for kv in kvs] == [False, True]
    assert [kv.token_ids.tolist() for kv in kvs] == [engine.prompt.chunk_ids(c) for c in cases[0].chunks]
