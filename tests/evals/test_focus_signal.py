"""Focus's per-request quality signal (issue 53): what its scoring pass read, on the result,
in the HTTP API's `ragkv` field and in the metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from prometheus_client import generate_latest

from ragkv.engine import BlendOptions, Engine, FocusOptions, Prompt, load_model
from ragkv.engine.focus import focus_layers, kept_attention, score_chunks
from ragkv.evals.testing import tiny_model_dir
from ragkv.server.metrics import ServerMetrics
from ragkv.server.openai_reply import ragkv_extra
from ragkv.types import FinishReason, FocusSignal, Mode, QueryStats, Usage
from tests.server.fakes import FakeBackend, ServerThread, settings

CHUNKS = ["alpha beta gamma delta epsilon " * 8, "one two three four five six " * 9, "red green blue cyan " * 7]
QUESTION = "what comes after alpha?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory.mktemp("focus-signal"), "llama", num_layers=6, seed=3)
    return Engine(load_model(str(d), device="cpu", dtype="float32"))


def _parts(eng: Engine):
    p = eng.prompt
    prefix_ids = p.prefix_ids()
    return prefix_ids, [eng.prefill(prefix_ids, p.chunk_ids(c)) for c in CHUNKS], p.question_ids(QUESTION)


def _prompt(eng: Engine) -> Prompt:
    return Prompt.of(*_parts(eng))


def test_the_scoring_pass_shares_the_questions_attention_among_the_chunks(tiny):
    prefix, kvs, q = _parts(tiny)
    scored = score_chunks(tiny.lm, tiny.prefix_kv(prefix), kvs, torch.tensor(q), focus_layers(tiny.lm.num_layers))
    assert scored.mass is not None and scored.mass.shape == (3,)
    assert float(scored.mass.sum()) == pytest.approx(1.0, abs=1e-5) and bool((scored.mass >= 0).all())
    assert kept_attention(scored.mass, [0, 1, 2]) == pytest.approx(1.0, abs=1e-5)
    assert kept_attention(scored.mass, [1]) == pytest.approx(float(scored.mass[1]))
    assert kept_attention(scored.mass, []) == 0.0


def test_a_lookup_and_a_handover_report_their_decision(tiny):
    lookup = tiny.run(_prompt(tiny), "focus", options=BlendOptions(focus=FocusOptions(keep=1.0, handover=True)))
    sig = lookup.focus_signal
    assert sig is not None and sig.handed_over is False is lookup.handed_over
    assert 0.0 < sig.kept_attention < 1.0  # the best chunk alone holds part of the question's attention
    top = sorted(lookup.chunk_scores, reverse=True)
    assert sig.spread == pytest.approx((top[1] + top[2]) / 2 / top[0], abs=1e-3)
    every = tiny.run(_prompt(tiny), "focus",
                     options=BlendOptions(focus=FocusOptions(keep=1e-9, handover=True, spread=0.0)))
    assert every.focus_signal == FocusSignal(True, 1.0, every.focus_signal.spread)  # a handover drops nothing
    assert tiny.run(_prompt(tiny), "blend").focus_signal is None


def _stats(focus: FocusSignal | None) -> QueryStats:
    return QueryStats(Usage(10, 2, 0), 0.1, 0.2, {}, 0.15, Mode.FOCUS, FinishReason.STOP, "x", focus=focus)


def test_the_http_ragkv_field_and_the_metrics_carry_the_signal():
    sig = FocusSignal(handed_over=False, kept_attention=0.62, spread=0.31)
    assert ragkv_extra((), _stats(sig), None)["focus"] == {"handed_over": False, "kept_attention": 0.62, "spread": 0.31}
    assert ragkv_extra((), _stats(None), None)["focus"] is None
    m = ServerMetrics()
    m.observe_answer(Mode.FOCUS, 0.1, 0.0, {}, focus=sig)
    m.observe_answer(Mode.BLEND, 0.1, 0.15, {})  # no focus: nothing observed
    text = generate_latest(m.registry).decode()
    assert 'ragkv_focus_kept_attention_ratio_count{collection="default",handed_over="false"} 1.0' in text
    assert 'ragkv_focus_kept_attention_ratio_bucket{collection="default",handed_over="false",le="0.7"} 1.0' in text
    assert 'ragkv_focus_spread_ratio_count{collection="default",handed_over="false"} 1.0' in text


class _FocusBackend(FakeBackend):
    """The fake server backend, its answers carrying a focus decision as the engine's would."""

    SIGNAL = FocusSignal(handed_over=False, kept_attention=0.58, spread=0.4)

    def work(self, request):
        answered = yield from super().work(request)
        return replace(answered, focus=self.SIGNAL if request.mode is Mode.FOCUS else None)


def test_a_served_answer_carries_the_signal_to_the_http_field_and_the_metrics():
    """engine Answered.focus -> QueryStats.focus -> the OpenAI response's ragkv.focus and the histograms."""
    import openai

    st = ServerThread(settings(http_port=0), lambda _: _FocusBackend())
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="none", max_retries=0,
                               timeout=10)
        asked = {mode: client.chat.completions.create(model="default", max_tokens=2, extra_body={"mode": mode},
                                                      messages=[{"role": "user", "content": "alpha beta"}])
                 for mode in ("focus", "blend")}
        body = generate_latest(st.server.metrics.registry).decode()
    finally:
        st.stop()
    assert asked["focus"].model_extra["ragkv"]["focus"] == {"handed_over": False, "kept_attention": 0.58, "spread": 0.4}
    assert asked["blend"].model_extra["ragkv"]["focus"] is None
    assert 'ragkv_focus_kept_attention_ratio_count{collection="default",handed_over="false"} 1.0' in body
    assert 'ragkv_focus_spread_ratio_count{collection="default",handed_over="true"}' not in body
