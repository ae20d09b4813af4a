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
    outs, constrained = [], []
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


class _Counting:
    """llguidance.LLMatcher, counting what it compiles: matchers built, grammars validated."""

    def __init__(self, real: type) -> None:
        self.real, self.built, self.validated = real, 0, 0

    def __call__(self, *args, **kwargs):
        self.built += 1
        return self.real(*args, **kwargs)

    def validate_grammar(self, *args, **kwargs) -> str:
        self.validated += 1
        return self.real.validate_grammar(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    import llguidance

    shim = _Counting(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", shim)
    return shim


def _fresh_schema() -> dict:
    """A schema no other test compiled (the caches are per process)."""
    import uuid

    return {**SCHEMA, "properties": {**SCHEMA["properties"], "id": {"const": uuid.uuid4().hex}}}


def test_a_repeated_schema_is_compiled_once_per_tokenizer(tiny_lm, counting: _Counting) -> None:
    """A client sending the same schema again (or the three steps of one request: the grammar's
    validation, the request's matcher, a retry) costs no compile after the first."""
    import torch

    engine = Engine(tiny_lm)
    schema = _fresh_schema()
    lark = f"start: %json {json.dumps(schema)}\n"
    first = [lark_grammar(lark) for _ in range(3)]
    assert len(set(first)) == 1 and counting.validated == 1
    constraints = [engine.grammars.compile(first[0], closing=True) for _ in range(3)]
    assert counting.built == 1 and engine.grammars.compiled == 1
    # each request has its own place in the grammar: one stepping leaves the others at the start
    ids = engine.lm.tokenizer.encode('{"name"', add_special_tokens=False)

    def step(c, token: int) -> None:  # as the decode does: wait for the mask, then advance
        c.apply(torch.zeros(engine.grammars.vocab_size))
        c.consume(token)
        c.start()

    for t in ids:
        step(constraints[0], t)
    for c in constraints[1:]:
        step(c, ids[0])  # still admits the first token: nothing the first one consumed moved it
    for c in constraints:
        c.apply(torch.zeros(engine.grammars.vocab_size))  # no mask left computing


def test_a_schema_the_compiler_refuses_is_not_compiled_again(tiny_lm, counting: _Counting) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "((" + "x" * 8}}}
    for _ in range(3):
        with pytest.raises(GrammarError, match="unclosed"):
            json_schema_grammar(bad)
    assert counting.validated == 1


def test_a_huge_schema_is_refused_quickly_naming_the_limit(tiny_lm, counting: _Counting) -> None:
    """Thousands of optional properties: llguidance's JSON compiler takes seconds on such a
    schema (about 3.5 s for 8,000 on one core), and it ran up to three times per request."""
    import time

    from ragkv.engine.constrain import MAX_GRAMMAR_BYTES, GrammarLimitError

    engine = Engine(tiny_lm)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8000)}}
    t0 = time.perf_counter()
    for attempt in (lambda: json_schema_grammar(schema),
                    lambda: lark_grammar(f"start: %json {json.dumps(schema)}\n"),
                    lambda: engine.grammars.compile(f"start: %json {json.dumps(schema)}\n")):
        with pytest.raises(ValueError, match=f"limit of {MAX_GRAMMAR_BYTES:,} bytes") as info:
            attempt()
        assert isinstance(info.value, GrammarLimitError) and isinstance(info.value, GrammarError)
        assert "RAGKV_MAX_GRAMMAR_BYTES" in str(info.value)
    assert time.perf_counter() - t0 < 1.0
    assert counting.validated == 0 and counting.built == 0  # refused before any compiling


def test_the_byte_limit_can_be_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
    monkeypatch.setenv("RAGKV_MAX_GRAMMAR_BYTES", "100")
    with pytest.raises(GrammarError, match="limit of 100 bytes"):
        json_schema_grammar(schema)
    monkeypatch.setenv("RAGKV_MAX_GRAMMAR_BYTES", "100000")
    assert json_schema_grammar(schema)


def test_the_compilers_limits_apply_and_are_named(tiny_lm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar compiler runs under explicit limits (GRAMMAR_LIMITS); a grammar past one is
    refused with an error naming it, by the validation and by the tokenizer's compile alike."""
    from ragkv.engine import constrain

    monkeypatch.setitem(constrain.GRAMMAR_LIMITS, "max_grammar_size", 500)
    schema = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(60)}}
    lark = f"start: %json {json.dumps(schema)}\n"
    with pytest.raises(constrain.GrammarLimitError, match="max_grammar_size=500"):
        lark_grammar(lark)
    engine = Engine(tiny_lm)
    with pytest.raises(constrain.GrammarLimitError, match="max_grammar_size=500"):
        engine.grammars.compile(lark + "\n")  # not validated first: the matcher's own compile
