"""The soak's short version: 1 client for 30 s against a tiny random model, with every fault kind."""

from __future__ import annotations

import json
from pathlib import Path

from bench import soak


def test_failures_names_each_way_a_soak_fails() -> None:
    good = {"codes": {"OK": 10, "RESOURCE_EXHAUSTED": 1}, "differing_answers": 0, "rss_growth": 0.02,
            "rss_mib": {"first": 100, "max": 102, "last": 102}}
    assert soak.failures(good, 0.10) == []
    bad = dict(good, codes={"OK": 3, "DATA_LOSS": 1, "UNKNOWN": 2}, differing_answers=1, rss_growth=0.2)
    why = " / ".join(soak.failures(bad, 0.10))
    for expected in ("1 request(s) ended DATA_LOSS", "2 request(s) ended UNKNOWN", "1 answer(s) differ",
                     "RSS grew 20.0%"):
        assert expected in why, f"{expected!r} not in {why!r}"
    assert soak.failures(dict(good, codes={}), 0.10) == ["no request was answered"]


def test_each_answer_is_checked_against_the_mode_it_ran_in() -> None:
    """A blend ask the loading controller served by full prefill is held to full's answer; a pair
    the clean pass never saw served as asked takes its first answer, and later ones are held to it."""
    report = soak.Report()
    reference = {("q", "full"): "F", ("q", "blend"): "B"}
    report.check(reference, "q", "blend", "full", "F")  # served by full prefill, full's answer
    report.check(reference, "q", "blend", "blend", "B")
    assert report.n_differing == 0
    report.check(reference, "q", "blend", "full", "B")  # blend's text, but it ran full: differs
    assert report.n_differing == 1 and report.differing[0] == ("q", "blend (ran full)", "B", "F")
    report.check(reference, "q", "reuse", "reuse", "R")  # no clean-pass reference: taken from load
    report.check(reference, "q", "reuse", "reuse", "R")
    assert report.references_under_load == 1 and report.n_differing == 1
    report.check(reference, "q", "reuse", "reuse", "X")
    assert report.n_differing == 2


def test_rss_growth_sees_a_leak_through_the_noise_of_requests_in_flight() -> None:
    import random

    rng = random.Random(0)
    flat = [1400 + rng.choice((-150, 0, 150, 220)) for _ in range(600)]  # in-flight swings, no trend
    flat[-1] = 1620  # a last sample at a peak: a point-to-point measure would call it +16%
    assert abs(soak.rss_growth(flat)[0]) < 0.05
    leak = [1400 + 0.5 * i + rng.choice((-150, 0, 150)) for i in range(600)]  # +0.5 MiB a second
    growth, first, last, window = soak.rss_growth(leak)
    assert growth > 0.15 and window == 60 and last > first
    assert soak.rss_growth([100.0, 110.0])[3] == 1  # a short run: one-sample windows


def test_short_soak_passes_under_faults(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    rc = soak.main(["--tiny", "--clients", "1", "--minutes", "0.5", "--fault-every", "1.5",
                    "--workdir", str(tmp_path / "work"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, f"soak failed: {report['failures']} (server log {report['server_log']})"
    assert report["requests"] >= 20, report["codes"]
    assert set(report["codes"]) == {"OK"}, report["codes"]
    assert set(report["codes_by_mode"]) == set(soak.MODES)
    for kind in ("flip", "truncate", "delete", "s3_stop", "s3_start"):
        assert report["faults"].get(kind, 0) >= 1, f"no {kind} fault injected: {report['faults']}"
    assert report["rss_mib"]["first"] > 0 and report["open_fds"]["first"] > 0
