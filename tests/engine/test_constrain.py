"""Constrained decoding (engine/constrain.py): the output follows its grammar whatever the
model writes, and unconstrained requests in the same batch keep their greedy tokens."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from ragkv.engine import Engine, SamplingParams
from ragkv.engine.constrain import CLOSING_WINDOW, GrammarError, json_schema_grammar, lark_grammar
from ragkv.engine.scheduler import Decode, Scheduler, SchedulerConfig
from ragkv.types import FinishReason, Mode
from tests.engine.test_scheduler import PASSAGES, REQUESTS, _alone, _job, _Sink, _Token

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "year": {"type": "integer"},
    "kind": {"enum": ["telescope", "village", "cable car"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "year", "kind"], "additionalProperties": False}
NUMBER = r"The answer is [0-9]{1,4}\."


def _constrained_job(engine: Engine, grammar: str, out: dict, params: SamplingParams, closing: bool = True):
    prefix_ids = engine.prompt.prefix_ids()
    chunk_ids = [engine.prompt.chunk_ids(p) for p in PASSAGES[:2]]
    kvs = [engine.prefill_chunk(prefix_ids, ids) for ids in chunk_ids]
    res = yield from engine.run_steps(prefix_ids, chunk_ids, kvs, engine.prompt.question_ids("Describe it."),
                                      Mode.BLEND, reserve_tokens=params.max_new_tokens)
    stream = engine.decode(res, params, engine.grammars.compile(grammar, closing))
    out["stream"] = stream
    yield Decode(stream, _Token)


def _text(engine: Engine, stream) -> str:  # noqa: ANN001
    return engine.lm.tokenizer.decode(stream.token_ids, skip_special_tokens=True)


def test_free_requests_keep_their_tokens_beside_constrained_ones(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    alone = _alone(engine)
    sched = Scheduler(SchedulerConfig(prompt_slice_s=1e-4))
    sinks, outs, constrained = [], [], []
    grammars = [json_schema_grammar(SCHEMA), lark_grammar(f"start: /{NUMBER}/")]
    for i, (mode, n, q, m) in enumerate(REQUESTS):
        out: dict = {}
        sinks.append(_Sink())
        sched.submit(_job(engine, mode, n, q, m, out), sinks[-1], threading.Event())
        outs.append(out)
        if i < len(grammars):  # a constrained request between the free ones
            c: dict = {}
            sinks.append(_Sink())
            sched.submit(_constrained_job(engine, grammars[i], c, SamplingParams(max_new_tokens=128)), sinks[-1],
                         threading.Event())
            constrained.append(c)
    for s in sinks:
        assert s.ended.wait(300)
    sched.close()
    assert [o["stream"].token_ids for o in outs] == alone
    doc = json.loads(_text(engine, constrained[0]["stream"]))
    jsonschema.validate(doc, SCHEMA)
    assert re.fullmatch(NUMBER, _text(engine, constrained[1]["stream"]))
    assert sched.stats.steps < sum(len(o["stream"].token_ids) for o in outs + constrained)  # they shared steps


@pytest.mark.parametrize("seed", range(12))
def test_sampled_random_model_output_always_validates(tiny_lm, seed: int) -> None:
    """A random model sampled at temperature 1 writes anything it may: the grammar holds it
    to the schema, and the closing window ends it inside the budget."""
    engine = Engine(tiny_lm)
    out: dict = {}
    sink = _Sink()
    sched = Scheduler()
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=seed)
    sched.submit(_constrained_job(engine, json_schema_grammar(SCHEMA), out, params), sink, threading.Event())
    assert sink.ended.wait(120)
    sched.close()
    stream = out["stream"]
    assert stream.finish_reason is FinishReason.STOP and len(stream.token_ids) <= 128
    jsonschema.validate(json.loads(_text(engine, stream)), SCHEMA)
    assert sink.tokens == stream.token_ids


def test_without_the_closing_window_a_budget_can_cut_the_json(tiny_lm) -> None:
    """The closing window is what ends structured answers in budget: without it, some
    sampled random-model answers run out (the test above would fail)."""
    engine = Engine(tiny_lm)
    cut = 0
    for seed in range(12):
        out: dict = {}
        sink = _Sink()
        sched = Scheduler()
        params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=seed)
        sched.submit(_constrained_job(engine, json_schema_grammar(SCHEMA), out, params, closing=False), sink,
                     threading.Event())
        assert sink.ended.wait(120)
        sched.close()
        cut += out["stream"].finish_reason is FinishReason.LENGTH
    assert cut > 0 and CLOSING_WINDOW < 128


def test_greedy_constrained_alone_equals_in_a_batch(tiny_lm) -> None:
    engine = Engine(tiny_lm)
    grammar = json_schema_grammar(SCHEMA)
    texts = []
    for together in (False, True):
        sched = Scheduler(SchedulerConfig(prompt_slice_s=1e-4))
        out: dict = {}
        sinks = [_Sink()]
        sched.submit(_constrained_job(engine, grammar, out, SamplingParams(max_new_tokens=40)), sinks[0],
                     threading.Event())
        if together:
            for mode, n, q, m in REQUESTS:
                sinks.append(_Sink())
                sched.submit(_job(engine, mode, n, q, m, {}), sinks[-1], threading.Event())
        for s in sinks:
            assert s.ended.wait(300)
        sched.close()
        texts.append(out["stream"].token_ids)
    assert texts[0] == texts[1]


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "object", "properties": {"a": {"type": "wibble"}}}, "wibble"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "string", "pattern": "(("}, "unclosed"),
])
def test_a_schema_the_library_cannot_compile_is_a_grammar_error_naming_it(schema: dict, needle: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(needle)):
        json_schema_grammar(schema)
