"""`ragkv eval --calibration` on the tiny random Llama: it calibrates on the file's passages as
`ragkv index` does, measures the same ratios on the held-out questions only, and reports the
ratio `ragkv serve --fidelity-kl` would pick with what it measures there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragkv.cli.main import main as ragkv_main
from ragkv.indexer.calibrate import RATIOS

FACTS = [
    ("Mars", "Mars is the fourth planet from the Sun and has two small moons named Phobos and Deimos."),
    ("Bluebird", "The internal memo says the secret launch code of project Bluebird is 4721 this year."),
    ("Bread", "Bread is made from flour, water, salt and yeast, then baked until the crust is brown."),
    ("Paris", "Paris has been the capital of France since the year 987 under King Hugh Capet."),
    ("Dogs", "Dogs were domesticated from grey wolves in Siberia about fifteen thousand years ago."),
    ("Saturn", "Saturn has spectacular rings made of ice and rock that were first seen by Galileo."),
]


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    cases = [{"id": f"q{i}", "question": f"What does the passage about {title} say?", "answers": [text.split()[-1]],
              "ctxs": [{"title": t, "text": x} for t, x in FACTS[i:] + FACTS[:i]][:4]}
             for i, (title, text) in enumerate(FACTS)]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(cases))
    return path


def test_calibration_is_measured_on_held_out_questions_and_names_the_served_ratio(
        dataset: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = ragkv_main(["eval", "--calibration", "--dataset", str(dataset), "--n", "6", "--ctxs", "4",
                       "--model", str(tiny_llama_dir), "--calibration-sets", "3", "--max-new-tokens", "3",
                       "--fidelity-kl", "0.02", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    from ragkv.evals.split import Part, Split

    held_out = len(Split(0, 0.5).select([type("C", (), {"id": f"q{i}"})() for i in range(6)], Part.REPORT))
    assert out["held_out_questions"] == held_out >= 1
    assert out["calibration"]["sets"] >= 1 and out["calibration"]["corpus_passages"] == len(FACTS)
    assert [r["recompute_ratio"] for r in out["settings"]] == sorted(RATIOS)
    for row in out["settings"]:
        assert row["measured_kl"] >= 0 and row["predicted_kl"] >= 0
        if row["predicted_kl"] > 0:
            assert row["measured_over_predicted"] == pytest.approx(row["measured_kl"] / row["predicted_kl"])
            assert row["within_2x"] == (0.5 <= row["measured_over_predicted"] <= 2.0)
    assert out["within_2x_share"] == sum(r["within_2x"] for r in out["settings"]) / len(out["settings"])
    meets = [r for r in out["settings"] if r["predicted_kl"] <= 0.02]
    served = out["served"]
    assert served["recompute_ratio"] == (meets[0]["recompute_ratio"] if meets else served["recompute_ratio"])
    assert served["fidelity_kl"] == 0.02 and "recompute ratio" in served["reason"]
