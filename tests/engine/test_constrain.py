"""Constrained decoding (engine/constrain.py): the output follows its grammar whatever the
model writes, and unconstrained requests in the same batch keep their greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from ragkv.engine import Engine, SamplingParams
from ragkv.engine.constrain import CLOSING_WINDOW, GrammarError, json_schema_grammar, lark_grammar
from ragkv.engine.scheduler import Scheduler, SchedulerConfig
from ragkv.types import FinishReason, Mode
from tests.engine.test_scheduler import REQUESTS, _alone, _job, _request, _Sink

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "year": {"type": "integer"},
    "kind": {"enum": ["telescope", "village", "cable car"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "year", "kind"], "additionalProperties": False}
NUMBER = r"The answer is [0-9]{1,4}\."


def _constrained_job(engine: Engine, sched: Scheduler, grammar: str, params: SamplingParams, sink: _Sink,
                     closing: bool = True) -> None:
    req = dataclasses.replace(_request(engine, Mode.BLEND, 2, "Describe it.", params.max_new_tokens, params),
                              constraint=engine.grammars.compile(grammar, closing))
    sched.submit(req, engine.work(req), sink)


def _text(engine: Engine, sink: _Sink) -> str:
    return engine.lm.tokenizer.decode(sink.tokens, skip_special_tokens=True)


def test_free_requests_keep_their_tokens_beside_constrained_ones(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    alone = _alone(engine)
    sched = Scheduler(SchedulerConfig(prompt_slice_s=1e-4))
    sinks, outs, constrained = [], [], []
    grammars = [json_schema_grammar(SCHEMA), lark_grammar(f"start: /{NUMBER}/")]
    for i, (mode, n, q, m) in enumerate(REQUESTS):
        outs.append(_Sink())
        _job(engine, sched, mode, n, q, m, outs[-1])
        if i < len(grammars):  # a constrained request between the free ones
            constrained.append(_Sink())
            _constrained_job(engine, sched, grammars[i], SamplingParams(max_new_tokens=128), constrained[-1])
    for s in outs + constrained:
        assert s.ended.wait(300)
    sched.close()
    assert [o.tokens for o in outs] == alone
    doc = json.loads(_text(engine, constrained[0]))
    jsonschema.validate(doc, SCHEMA)
    assert re.fullmatch(NUMBER, _text(engine, constrained[1]))
    assert sched.stats.steps < sum(len(o.tokens) for o in outs + constrained)  # they shared steps


@pytest.mark.parametrize("seed", range(12))
def test_sampled_random_model_output_always_validates(tiny_lm, seed: int) -> None:
    """A random model sampled at temperature 1 writes anything it may: the grammar holds it
    to the schema, and the closing window ends it inside the budget."""
    engine = Engine(tiny_lm)
    sink = _Sink()
    sched = Scheduler()
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=seed)
    _constrained_job(engine, sched, json_schema_grammar(SCHEMA), params, sink)
    assert sink.ended.wait(120)
    sched.close()
    done = sink.finished.answered
    assert done.finish_reason is FinishReason.STOP and done.completion_tokens == len(sink.tokens) <= 128
    jsonschema.validate(json.loads(_text(engine, sink)), SCHEMA)


def test_without_the_closing_window_a_budget_can_cut_the_json(tiny_lm) -> None:
    """The closing window is what ends structured answers in budget: without it, some
    sampled random-model answers run out (the test above would fail)."""
    engine = Engine(tiny_lm)
    cut = 0
    for seed in range(12):
        sink = _Sink()
        sched = Scheduler()
        params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=seed)
        _constrained_job(engine, sched, json_schema_grammar(SCHEMA), params, sink, closing=False)
        assert sink.ended.wait(120)
        sched.close()
        cut += sink.finished.answered.finish_reason is FinishReason.LENGTH
    assert cut > 0 and CLOSING_WINDOW < 128


def test_greedy_constrained_alone_equals_in_a_batch(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    grammar = json_schema_grammar(SCHEMA)
    texts = []
    for together in (False, True):
        sched = Scheduler(SchedulerConfig(prompt_slice_s=1e-4))
        sinks = [_Sink()]
        _constrained_job(engine, sched, grammar, SamplingParams(max_new_tokens=40), sinks[0])
        if together:
            for mode, n, q, m in REQUESTS:
                sinks.append(_Sink())
                _job(engine, sched, mode, n, q, m, sinks[-1])
        for s in sinks:
            assert s.ended.wait(300)
        sched.close()
        texts.append(sinks[0].tokens)
    assert texts[0] == texts[1]


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "object", "properties": {"a": {"type": "wibble"}}}, "wibble"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "string", "pattern": "(("}, "unclosed"),
])
def test_a_schema_the_library_cannot_compile_is_a_grammar_error_naming_it(schema: dict, needle: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(needle)):
        json_schema_grammar(schema)
