"""KL along the answer (`evals.evaluate.answer_kls`): at each answer position while the method's
answer agrees with full prefill's, and at the one where they part, then no further (past it the
two were fed different tokens, so their next-token distributions answer different prompts)."""

from __future__ import annotations

import math

import pytest
import torch

from ragkv.evals.evaluate import answer_kls


def _logits(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor(probs))


def _kl(p: tuple[float, ...], q: tuple[float, ...]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


P, Q, R = (0.7, 0.2, 0.1), (0.5, 0.3, 0.2), (0.1, 0.2, 0.7)


def test_it_stops_at_the_position_where_the_answers_part() -> None:
    ref_steps = [_logits(*P), _logits(*P), _logits(*P), _logits(*P)]
    steps = [_logits(*P), _logits(*Q), _logits(*R), _logits(*R)]
    # the answers agree on tokens 0 and 1, part at 2: positions 0, 1 and 2, not 3
    kls = answer_kls([0, 0, 0], ref_steps, [0, 0, 2], steps)
    assert kls == pytest.approx([0.0, _kl(P, Q), _kl(P, R)], abs=1e-6)


def test_answers_that_never_part_are_compared_at_every_position_both_have() -> None:
    ref_steps = [_logits(*P)] * 3
    steps = [_logits(*Q)] * 3  # both ended on EOS after two equal tokens: three positions each
    assert answer_kls([1, 1], ref_steps, [1, 1], steps) == pytest.approx([_kl(P, Q)] * 3, abs=1e-6)


def test_an_answer_that_ends_first_parts_there() -> None:
    ref_steps = [_logits(*P)] * 4
    steps = [_logits(*Q)] * 2  # the method's answer ended (EOS) after one token; full's went on
    assert answer_kls([1, 1, 1], ref_steps, [1], steps) == pytest.approx([_kl(P, Q)] * 2, abs=1e-6)
