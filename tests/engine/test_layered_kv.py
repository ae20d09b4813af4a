"""Chunks still loading (layer-wise pipelining) against the same chunks whole."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from ragkv.engine import BlendOptions, Engine, FocusOptions, Prompt, load_model
from ragkv.engine.kv.cache import KVCache
from ragkv.errors import KVFormatError
from ragkv.evals.testing import tiny_model_dir
from ragkv.types import Mode
from tests.engine.test_blend import _parts


class SlowGate:
    """A LayerReady whose layers arrive one by one on a timer thread, recording every wait."""

    def __init__(self, num_layers: int, delay: float = 0.002, fail_at: int | None = None) -> None:
        self.num_layers, self.waits = num_layers, []
        self._ready, self._fail_at, self._failed = 0, fail_at, False
        self._cond = threading.Condition()
        threading.Thread(target=self._arrive, args=(delay,), daemon=True).start()

    def _arrive(self, delay: float) -> None:
        for layer in range(self.num_layers):
            time.sleep(delay)
            with self._cond:
                if layer == self._fail_at:
                    self._failed = True  # the layers before it stay readable, as in kvstore's LayerGate
                    self._cond.notify_all()
                    return
                self._ready = layer + 1
                self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        return KVFormatError(f"checksum mismatch in layer {self._fail_at} (test)") if self._failed else None

    def wait(self, layer: int) -> None:
        self.waits.append(layer)
        with self._cond:
            while self._ready <= layer:
                if self._failed:
                    raise KVFormatError(f"checksum mismatch in layer {self._fail_at} (test)")
                self._cond.wait()


class PoisonedUntilReady:
    """A gate over a chunk whose k and v hold NaN until the gate lets a layer through:
    reading a layer before waiting for it would poison the result."""

    def __init__(self, kv, delay: float = 0.002) -> None:
        self.k, self.v = kv.k.clone(), kv.v.clone()
        self.num_layers = kv.k.shape[0]
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
        self.target = kv
        self.gate = SlowGate(self.num_layers, delay)
        self._filled = 0
        self._lock = threading.Lock()

    @property
    def error(self) -> BaseException | None:
        return self.gate.error

    def wait(self, layer: int) -> None:
        self.gate.wait(layer)
        with self._lock:
            while self._filled <= layer:
                self.target.k[self._filled] = self.k[self._filled]
                self.target.v[self._filled] = self.v[self._filled]
                self._filled += 1


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_engine(request, tmp_path_factory):
    d = tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=7)
    return Engine(load_model(str(d), device="cpu", dtype="float32"))


def _loading(kvs):
    """Each chunk as a fresh copy whose layers are NaN until its gate says they arrived."""
    out = []
    for kv in kvs:
        copy = dataclasses.replace(kv, k=kv.k.clone(), v=kv.v.clone())
        out.append(dataclasses.replace(copy, ready=PoisonedUntilReady(copy)))
    return out


@pytest.mark.parametrize("mode,options", [
    (Mode.REUSE, BlendOptions()),
    (Mode.BLEND, BlendOptions(0.3, selector="query")),
    (Mode.BLEND, BlendOptions(0.3, selector="deviation", check_layer=1)),
    (Mode.BLEND, BlendOptions(0.3, context_temperature=1.5)),
    (Mode.FOCUS, BlendOptions(0.3, focus=FocusOptions(keep=0.01))),
])
def test_chunks_still_loading_give_the_same_bits_as_whole_ones(tiny_engine, mode, options):
    prefix, kvs, q, _ = _parts(tiny_engine)
    whole = tiny_engine.run(Prompt.of(prefix, kvs, q), mode, options=options)
    loading = _loading(kvs)
    res = tiny_engine.run(Prompt.of(prefix, loading, q), mode, options=options)
    assert torch.equal(res.logits, whole.logits), "layered logits differ from whole-chunk logits"
    n = whole.n_prompt_tokens
    assert torch.equal(res.cache.k[:, :, :n], whole.cache.k[:, :, :n])
    assert torch.equal(res.cache.v[:, :, :n], whole.cache.v[:, :, :n])
    layers = list(range(tiny_engine.lm.num_layers))
    for kv in loading:  # each layer waited for once, in order, as the pass reached it
        waits = kv.ready.gate.waits
        if mode is Mode.FOCUS:  # the scoring pass's cache, then the prompt's own
            cut = next((i for i in range(1, len(waits)) if waits[i] <= waits[i - 1]), len(waits))
            assert waits[:cut] == layers[:cut] and waits[cut:] in ([], layers)
        else:
            assert waits == layers


def test_fill_takes_each_layer_only_when_the_pass_reaches_it(tiny_engine):
    lm = tiny_engine.lm
    prefix_ids, kvs, _, _ = _parts(tiny_engine)
    prefix = tiny_engine.prefix_kv(prefix_ids)
    loading = _loading(kvs)
    n = sum(kv.num_tokens for kv in [prefix, *kvs])
    rope = lm.adapter.rotary(torch.arange(n), torch.empty(0))
    cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, n, lm.dtype, lm.device)
    cache.stage([prefix, *loading], rope)
    cache.fill(0)
    assert all(max(kv.ready.gate.waits) == 0 for kv in loading)
    assert not torch.isnan(cache.k[0, :, :n]).any()
    ref = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, n, lm.dtype, lm.device)
    ref.write_segments([prefix, *kvs], rope)
    cache.fill(lm.num_layers - 1)
    assert torch.equal(cache.k[:, :, :n], ref.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], ref.v[:, :, :n])


def test_a_layer_that_fails_to_load_fails_the_prompt(tiny_engine):
    prefix, kvs, q, _ = _parts(tiny_engine)
    broken = dataclasses.replace(kvs[1], ready=SlowGate(tiny_engine.lm.num_layers, fail_at=1))
    with pytest.raises(KVFormatError, match="layer 1"):
        tiny_engine.run(Prompt.of(prefix, [kvs[0], broken, *kvs[2:]], q), "blend", options=BlendOptions(0.3))


def test_a_chunk_still_loading_cannot_be_copied_whole(tiny_engine):
    _, kvs, _, _ = _parts(tiny_engine)
    with pytest.raises(RuntimeError, match="unfilled layers"):
        dataclasses.replace(kvs[0], ready=SlowGate(tiny_engine.lm.num_layers)).to("cpu")
