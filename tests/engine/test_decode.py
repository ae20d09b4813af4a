"""Streaming decode: equals transformers' greedy generate, honours EOS, stop and sampling."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine import Engine, Prompt, SamplingParams, load_model
from ragkv.types import FinishReason, Mode

CHUNKS = [
    "The observatory on Mount Kerr was built in 1931 by the astronomer Ada Lind.",
    "Its main telescope has a mirror of 2.4 metres and is still used for surveys.",
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return Engine(load_model(str(tiny_llama_dir), device="cpu"))


def _greedy_hf(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=lm.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def test_greedy_equals_generate_tiny(tiny):
    ids = tiny.prompt.prompt_ids(CHUNKS, "Who built it?")
    stream = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=20))
    pieces = list(stream)
    ref = _greedy_hf(tiny.lm, ids, 20)
    n = len(stream.token_ids)
    assert stream.token_ids == ref[:n]
    assert stream.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    if stream.finish_reason is FinishReason.LENGTH:
        assert n == 20
    assert "".join(pieces) == tiny.lm.tokenizer.decode(stream.token_ids, skip_special_tokens=True)


@pytest.mark.real_model
def test_greedy_equals_generate_smollm2(smollm2):
    eng = Engine(smollm2)
    ids = eng.prompt.prompt_ids(CHUNKS, "Who built the observatory on Mount Kerr?")
    stream = eng.decode(eng.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=24))
    text = "".join(stream)
    ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    if ref and ref[-1] in smollm2.eos_token_ids:
        ref = ref[:-1]
    assert stream.token_ids == ref
    assert "Ada Lind" in text, text


def test_stop_string_ends_generation_and_is_not_emitted(tiny):
    ids = tiny.prompt.prompt_ids(CHUNKS, "Who?")
    free = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=30))
    text = "".join(free)
    assert len(text) > 6
    stop = text[3:6]
    stream = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=30, stop=(stop,)))
    got = "".join(stream)
    assert stream.finish_reason is FinishReason.STOP
    assert got == text[: text.find(stop)]


def test_a_stop_found_by_the_consumer_ends_the_stream_at_its_token(tiny):
    """As in the server: the scheduler's side only picks tokens (`advance`), the consumer
    detokenizes them and finds the stop string some tokens later; the stream then ends with
    its token_ids cut back to the stop's token, and the text is the same as decoding alone."""
    ids = tiny.prompt.prompt_ids(CHUNKS, "Who?")
    free = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=30))
    text = "".join(free)
    stop = text[3:6]
    alone = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=30, stop=(stop,)))
    alone_text = "".join(alone)

    stream = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=30, stop=(stop,)))
    consumer, stops = stream.detokenizer(), []
    consumer._on_stop = lambda n: (stops.append(n), stream.stop_after(n))
    picked, pieces, lag = [], [], 3  # the consumer reads 3 tokens behind the decode
    while stream.finish_reason is None:
        token = stream.advance()
        if token is not None:
            picked.append(token)
            if stream.finish_reason is None:
                stream.receive(stream._forward(token))
        if len(picked) > lag:
            pieces.append(consumer.push(picked[-1 - lag]))
    for token in picked[len(picked) - lag:]:
        pieces.append(consumer.push(token))
    pieces.append(consumer.finish())
    assert "".join(pieces) == alone_text == text[: text.find(stop)]
    assert stops == [len(alone.token_ids)] and consumer.token_count == len(alone.token_ids)
    assert stream.finish_reason is FinishReason.STOP and stream.token_ids == alone.token_ids
    assert len(picked) > len(alone.token_ids)  # it had decoded past the stop, and took those back
    assert consumer.push(picked[0]) == ""  # nothing after a stop


def test_eos_ends_generation(tiny):
    ids = tiny.prompt.prompt_ids(CHUNKS, "Who?")
    first = int(torch.argmax(tiny.run(Prompt(ids), Mode.FULL).logits))
    lm = tiny.lm
    object.__setattr__(lm, "eos_token_ids", (first,))  # make the first greedy token an EOS
    try:
        stream = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=10))
        assert list(stream) == [] and stream.finish_reason is FinishReason.STOP and stream.token_ids == []
    finally:
        object.__setattr__(lm, "eos_token_ids", (lm.tokenizer.eos_token_id,))


def test_sampling_is_seeded(tiny):
    ids = tiny.prompt.prompt_ids(CHUNKS, "Who?")

    def run(seed):
        s = tiny.decode(tiny.run(Prompt(ids), Mode.FULL), SamplingParams(max_new_tokens=12, temperature=1.0,
                                                               top_p=0.9, top_k=50, seed=seed))
        list(s)
        return s.token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_decode_grows_the_cache_past_its_reserve(tiny):
    ids = tiny.prompt.prompt_ids(CHUNKS, "Who?")
    prompt = tiny.run(Prompt(ids), Mode.FULL, reserve_tokens=2)
    stream = tiny.decode(prompt, SamplingParams(max_new_tokens=16))
    list(stream)
    assert stream.token_ids == _greedy_hf(tiny.lm, ids, 16)[: len(stream.token_ids)]


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0.0),
                                 dict(top_k=-1), dict(stop=("",))])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def _incremental_text(lm, ids: list[int]) -> tuple[str, list[str]]:
    """Feed `ids` to a detokenizer one token at a time (as a decode's consumer does) and
    return its text and pieces."""
    from ragkv.engine.detokenize import Detokenizer

    text = Detokenizer(lm.tokenizer)
    pieces = [text.push(t) for t in ids]
    pieces.append(text.finish())
    return text._text, pieces  # everything it decoded, and what it gave out


@pytest.mark.parametrize("seed", range(5))
def test_incremental_detokenization_equals_a_whole_decode(tiny, smollm2, seed):
    """Random ids (multi-byte characters split across tokens included) decode to the same text
    one token at a time as all at once, and the pieces emitted add up to it."""
    g = torch.Generator().manual_seed(seed)
    for lm in (tiny.lm, smollm2):
        tok = lm.tokenizer
        text = "Grüße, 東京 — naïve café ☕ 4721. " * 3
        real = tok(text, add_special_tokens=False)["input_ids"]
        noise = torch.randint(0, len(tok), (40,), generator=g).tolist()
        for ids in (real, noise, real[:7] + noise[:9] + real[7:]):
            whole = tok.decode(ids, skip_special_tokens=True)
            text_inc, pieces = _incremental_text(lm, ids)
            assert text_inc == whole
            assert "".join(pieces) == whole
