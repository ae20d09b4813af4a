"""scripts/follow_up_eval.py, the follow-up policy measured against full prefill, run on a tiny
random model with a chat template and a dataset of its own: the carried prompt is full
prefill's, the turns cost a fraction of computing them, and at ratio 1.0 carrying them is
full prefill (KL ~0)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PASSAGES = ["Paris is the capital of France. The secret number is 4721.",
            "Alice met Bob by the river in spring, and they talked about the archive.",
            "ragkv stores the KV cache of every chunk and blends them at query time.",
            "The quick brown fox jumps over the lazy dog near the old mill."]


def _script():
    spec = importlib.util.spec_from_file_location("follow_up_eval_under_test", REPO / "scripts" / "follow_up_eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ragkv.evals.testing import tiny_model_dir

    # deep enough that the query selector's scoring layers leave most of the pass to the picks
    model = tiny_model_dir(tmp_path_factory.mktemp("chat") / "model", "llama", num_layers=16, seed=3)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return model


@pytest.mark.parametrize("ratio", [0.2, 1.0])
def test_the_follow_up_eval_compares_carrying_the_turns_with_computing_them(chat_model, tmp_path, ratio):
    data = [{"question": q, "answers": ["x"], "ctxs": [{"title": "", "text": t * 8} for t in PASSAGES[i:i + 2]]}
            for i, q in enumerate(["What is the secret number?", "Who met Bob?", "What does ragkv store?"])]
    dataset = tmp_path / "qa.json"
    dataset.write_text(json.dumps(data))
    out = tmp_path / "report.json"
    assert _script().main(["--dataset", str(dataset), "--model", str(chat_model), "--pairs", "1", "--ctxs", "2",
                           "--ratio", str(ratio), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pairs"] == 1
    (row,) = report["rows"]
    assert row["turn_tokens"] >= 8
    if ratio == 1.0:  # every chunk token recomputed, the turns' too: full prefill, at full cost
        assert row["kl_carried"] <= 1e-6 and row["f1_carried"] == 1.0 and row["turns_cost"] == 1.0
    else:  # the turns cost about the ratio of computing them
        assert row["computed_carried"] < row["computed_again"] and 0 < row["turns_cost"] <= 2 * ratio


def test_a_model_without_a_chat_template_is_refused_naming_why(tiny_llama_dir, tmp_path):
    data = [{"question": q, "answers": ["x"], "ctxs": [{"title": "", "text": PASSAGES[0]}]} for q in ("A?", "B?")]
    (tmp_path / "qa.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no chat template"):
        _script().main(["--dataset", str(tmp_path / "qa.json"), "--model", str(tiny_llama_dir), "--pairs", "1"])
