"""Out-of-sample evaluation (issue 53): seeded splits and folds, reports from per-case rows,
tuning on one part and reporting on another, and focus rules replayed from recorded rows."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine.focus import spread
from ragkv.evals.replay import ReplayRule, parse_rules, replay, runners_up_spread
from ragkv.evals.split import (
    Part,
    Split,
    TuneRule,
    cross_validate,
    fold_of,
    held_out_summary,
    report_from_rows,
    tuned_methods,
    unit_hash,
)

IDS = [f"q{i}" for i in range(200)]


def _one(kl: float, ttft: float, f1: float = 1.0, **extra) -> dict:
    return {"acc": True, "f1": f1, "agree": kl == 0, "f1_vs_full": f1, "first": True, "kl": kl, "ttft_s": ttft,
            "kv_prefill_s": 0.5, "recompute_fraction": 0.15, **extra}


def _rows(n: int = 40) -> list[dict]:
    """Method 'slow' is closest to full on every case; 'fast' is 3x faster and 0.01 further."""
    return [{"id": f"q{i}", "methods": {"full": _one(0.0, 3.0), "slow": _one(0.01, 1.0, 0.9),
                                        "fast": _one(0.02, 0.3, 0.8)}} for i in range(n)]


def test_a_split_is_fixed_by_id_and_seed_whatever_the_set():
    split = Split(seed=7, tune_frac=0.5)
    tune, report = split.select(IDS, Part.TUNE, key=str), split.select(IDS, Part.REPORT, key=str)
    assert sorted(tune + report) == sorted(IDS) and not set(tune) & set(report)
    assert 70 <= len(tune) <= 130  # a hash: about half
    assert split.select(IDS[:50], Part.TUNE, key=str) == [x for x in tune if x in IDS[:50]]  # --n does not move it
    assert unit_hash("q1", 7) == unit_hash("q1", 7) != unit_hash("q1", 8)
    assert Split(seed=8).select(IDS, Part.TUNE, key=str) != tune  # another seed, another split
    assert len(Split(seed=7, tune_frac=0.2).select(IDS, Part.TUNE, key=str)) < len(tune)


def test_split_and_fold_arguments_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"--split-frac .* \(0, 1\), got 1.0"):
        Split(tune_frac=1.0)
    with pytest.raises(ValueError, match="--folds must be at least 2"):
        fold_of("q0", 1, 0)
    folds = [fold_of(x, 3, 0) for x in IDS]
    assert set(folds) == {0, 1, 2} and folds == [fold_of(x, 3, 0) for x in IDS]


def test_a_report_from_rows_is_the_mean_and_median_of_its_cases():
    rows = _rows(3)
    rows[2]["methods"]["fast"] = _one(0.05, 0.9, 0.5)
    r = report_from_rows(rows, "fast")
    assert r.n == 3 and r.kl_mean == pytest.approx(0.03) and r.ttft_median_s == pytest.approx(0.3)
    assert r.f1_vs_full == pytest.approx(0.7) and r.recompute_fraction == pytest.approx(0.15)
    assert report_from_rows(rows, "absent").n == 0
    assert tuned_methods(rows) == ["slow", "fast"]


def test_tuning_picks_the_fastest_within_the_kl_slack():
    rows = _rows()
    reports = {m: report_from_rows(rows, m) for m in ("slow", "fast")}
    assert TuneRule(kl_slack=0.005).pick(reports) == "slow"  # fast is 0.01 further: not within 0.005
    assert TuneRule(kl_slack=0.02).pick(reports) == "fast"
    with pytest.raises(ValueError, match="nothing to tune over"):
        TuneRule().pick({})


def test_cross_validation_reports_each_fold_by_the_pick_of_the_others():
    rows = _rows()
    for row in rows:  # on one fold 'fast' is as close to full as 'slow': tuning elsewhere must not see it
        if fold_of(row["id"], 2, 0) == 0:
            row["methods"]["fast"] = _one(0.01, 0.3, 0.8)
    results = cross_validate(rows, ["slow", "fast"], folds=2, seed=0)
    assert [r.fold for r in results] == [0, 1]
    assert results[0].picked == "slow"  # tuned on fold 1, where fast is further
    assert results[1].picked == "fast"  # tuned on fold 0, where fast is as close and faster
    assert sum(r.report.n for r in results) == len(rows) and all(r.n_tune + r.report.n == 40 for r in results)
    summary = held_out_summary(results, rows, 2, 0)
    assert summary["tuned"]["n"] == 40
    n0 = results[0].report.n
    assert summary["tuned"]["kl_mean"] == pytest.approx((0.01 * n0 + 0.02 * (40 - n0)) / 40)
    with pytest.raises(ValueError, match="candidate methods"):
        cross_validate(rows, [], 2, 0)


def test_the_replayed_handover_test_is_the_engines():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.rand(5, generator=g)
        scores = scores / scores.max()
        assert runners_up_spread(scores.tolist()) == pytest.approx(spread(scores), abs=1e-6)
    assert ReplayRule(0.66, 3).hands_over([1.0, 0.7, 0.7, 0.1])  # spread 0.7
    assert not ReplayRule(0.66, 3).hands_over([1.0, 0.6, 0.2, 0.1])  # spread 0.4, two kept
    assert ReplayRule(0.9, 3).hands_over([1.0, 0.6, 0.55, 0.1])  # three kept (keep 0.5)
    assert not ReplayRule(0.9, 0).hands_over([1.0, 0.6, 0.55, 0.1])
    assert not ReplayRule(0.0, 0).hands_over([1.0, 0.2])  # one kept: a lookup whatever the spread
    assert parse_rules("0.66:3, 1:0") == [ReplayRule(0.66, 3), ReplayRule(1.0, 0)]
    with pytest.raises(ValueError, match="spread:several pairs"):
        parse_rules("0.66")


def test_replay_takes_blends_row_on_a_handover_and_the_lookups_otherwise():
    lookup = dict(_one(0.2, 0.1), handed_over=False, phases_s={"focus": 0.05})
    rows = [{"id": "a", "methods": {"blend": _one(0.01, 1.0), "look": {**lookup, "chunk_scores": [1.0, 0.9, 0.8]}}},
            {"id": "b", "methods": {"blend": _one(0.01, 1.0), "look": {**lookup, "chunk_scores": [1.0, 0.1, 0.1]}}}]
    out = replay(rows, [ReplayRule(0.66, 3)], "blend", "look")
    a, b = (row["methods"]["replay@s0.66n3"] for row in out)
    assert a["kl"] == 0.01 and a["handed_over"] and a["ttft_s"] == pytest.approx(1.05)  # blend + the scoring pass
    assert b["kl"] == 0.2 and not b["handed_over"] and b["ttft_s"] == 0.1
    with pytest.raises(ValueError, match="case a: replay needs methods 'blend' and 'focus'"):
        replay(rows, [ReplayRule(0.66, 3)], "blend", "focus")
