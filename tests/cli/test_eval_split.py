"""`ragkv eval` out of sample (issue 53): --split, --folds, and --from-cases with --replay-focus."""

from __future__ import annotations

import json

import pytest

from ragkv.cli.main import main
from ragkv.evals.split import Part, Split


def _dataset(tmp_path, n: int = 6):
    rows = [{"question": f"Who owns vault {i}?", "answers": [f"Owner {i}"],
             "ctxs": [{"title": f"T{i}-{j}", "text": f"Passage {j} of row {i}. Vault {j} is owned by Owner {i + j}."}
                      for j in range(3)]} for i in range(n)]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(rows))
    return path


def _eval(capsys, *flags: str) -> dict:
    rc = main(["eval", *flags, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out.strip())


def _tiny(tiny_llama_dir, path, *flags: str) -> list[str]:
    return ["--dataset", str(path), "--n", "6", "--ctxs", "3", "--model", str(tiny_llama_dir), "--neighbours", "0",
            "--max-new-tokens", "2", *flags]


def test_the_two_sides_of_a_split_hold_every_question_once(tiny_llama_dir, tmp_path, capsys):
    path = _dataset(tmp_path)
    ids = {}
    for part in ("tune", "report"):
        out_file = tmp_path / f"{part}.jsonl"
        out = _eval(capsys, *_tiny(tiny_llama_dir, path, "--modes", "full,blend", "--split", part, "--split-seed", "3",
                                   "--cases-out", str(out_file)))
        ids[part] = [json.loads(line)["id"] for line in out_file.read_text().splitlines()]
        assert out["modes"]["blend"]["n"] == len(ids[part]) and out["config"]["split"] == part
    assert sorted(ids["tune"] + ids["report"]) == [f"q{i}" for i in range(6)]
    assert ids["report"] == Split(seed=3).select([f"q{i}" for i in range(6)], Part.REPORT, key=str)


def test_folds_report_each_fold_by_the_pick_of_the_others(tiny_llama_dir, tmp_path, capsys):
    out = _eval(capsys, *_tiny(tiny_llama_dir, _dataset(tmp_path), "--modes", "full,reuse,blend", "--ratio", "1.0",
                               "--folds", "2", "--fold-seed", "1"))
    held = out["held_out"]
    assert held["folds"] == 2 and held["tuned"]["n"] == 6
    assert sum(f["n"] for f in held["per_fold"]) == 6
    # blend at ratio 1.0 is full prefill (KL ~0): reuse, far from it, is never picked
    assert {f["picked"] for f in held["per_fold"]} == {"blend"} and held["tuned"]["kl_mean"] < 1e-6


def test_a_replayed_focus_rule_is_the_rule_run(tiny_llama_dir, tmp_path, capsys):
    """Replaying the default handover rule from blend's rows and an always-lookup focus's rows gives
    the very answers and KL of that rule run by the engine (tuning a threshold needs no rerun)."""
    cases = tmp_path / "cases.jsonl"
    _eval(capsys, *_tiny(tiny_llama_dir, _dataset(tmp_path), "--modes", "full,blend,focus", "--focus-rules", "0.5:3,1:0",
                         "--cases-out", str(cases)))
    rows = [json.loads(line) for line in cases.read_text().splitlines()]
    assert set(rows[0]["methods"]) == {"full", "blend", "focus@s0.5n3", "focus@s1n0"}
    assert any(r["methods"]["focus@s0.5n3"]["handed_over"] for r in rows)  # both decisions are replayed
    assert not all(r["methods"]["focus@s0.5n3"]["handed_over"] for r in rows)
    out = _eval(capsys, "--from-cases", str(cases), "--replay-focus", "0.5:3,0:0")
    run, replayed = out["modes"]["focus@s0.5n3"], out["modes"]["replay@s0.5n3"]
    for key in ("kl_mean", "f1_vs_full", "agreement", "first_token_agreement", "recompute_fraction"):
        assert replayed[key] == pytest.approx(run[key], abs=1e-9), key
    assert out["modes"]["replay@s0n0"]["n"] == 6
    report = _eval(capsys, "--from-cases", str(cases), "--split", "report", "--split-seed", "3")
    assert report["modes"]["full"]["n"] == len(Split(seed=3).select(rows, Part.REPORT, key=lambda r: r["id"]))


def test_split_options_name_what_is_wrong(tmp_path, capsys):
    cases = tmp_path / "cases.jsonl"
    cases.write_text('{"id": "q0", "methods": {"full": {}}}\n')
    for flags, message in ((["--folds", "2", "--split", "tune"], "--folds and --split"),
                           (["--folds", "1"], "--folds must be at least 2"),
                           (["--split", "tune", "--split-frac", "1.5"], "--split-frac"),
                           (["--replay-focus", "0.5"], "spread:several pairs")):
        assert main(["eval", "--from-cases", str(cases), *flags]) != 0
        assert message in capsys.readouterr().err
    cases.write_text("not json\n")
    assert main(["eval", "--from-cases", str(cases)]) != 0
    assert "cases.jsonl:1: not a --cases-out line" in capsys.readouterr().err
