"""The start-up gate (`gate_model`): a model computed wrongly is refused; a one-off failure that
the second run does not repeat is served, with a warning that names the first run's numbers."""

from __future__ import annotations

import logging

import pytest

from ragkv.engine import check
from ragkv.engine.check import Check, gate_model
from ragkv.errors import ModelCheckError

GOOD = [Check("logits vs transformers", True, 1.4e-6, "max abs diff 1.43e-06"),
        Check("blend at 1.0 vs full", True, 0.0, "max abs diff 0.00e+00")]
BAD = [Check("logits vs transformers", False, 2.2e-3, "max abs diff 2.21e-03 (limit 5.4e-04)"), GOOD[1]]


def _runs(monkeypatch: pytest.MonkeyPatch, *results: list[Check]) -> list[int]:
    calls: list[int] = []

    def fake(lm, quick=False, decode_tokens=None):
        calls.append(1)
        return results[min(len(calls), len(results)) - 1]

    monkeypatch.setattr(check, "check_model", fake)
    monkeypatch.setattr(check, "_PASSED", set())
    return calls


def test_a_failure_the_second_run_does_not_repeat_is_served_with_a_warning(tiny_lm, monkeypatch, caplog) -> None:
    calls = _runs(monkeypatch, BAD, GOOD)
    with caplog.at_level(logging.WARNING, logger="ragkv.engine.check"):
        gate_model(tiny_lm)
    assert len(calls) == 2
    assert "failed its first run and passed its second" in caplog.text and "2.21e-03" in caplog.text


def test_a_model_that_fails_twice_is_refused_with_the_numbers(tiny_lm, monkeypatch) -> None:
    calls = _runs(monkeypatch, BAD, BAD)
    with pytest.raises(ModelCheckError, match=r"fails ragkv's correctness gate[\s\S]*2\.21e-03"):
        gate_model(tiny_lm)
    assert len(calls) == 2


def test_a_model_that_passes_is_checked_once(tiny_lm, monkeypatch) -> None:
    calls = _runs(monkeypatch, GOOD)
    gate_model(tiny_lm)
    gate_model(tiny_lm)  # passed once in this process: not again
    assert len(calls) == 1
