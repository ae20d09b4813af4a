"""Damaged KV never fails a request that recomputing can serve (real pipeline, tiny model).

- a layered read that fails while the retry of another failed read runs (the race that
  once ended a blend request with DATA_LOSS), in every mode that reads chunk KV, both
  blend selectors: made deterministic by a gate that holds one layer back, then fails it;
- bit-flipped and truncated files on disk, whole and layered loading: every answer OK and
  equal to the clean one; the rewritten files are on disk again, and the next server
  start reads them instead of computing them (also when quarantine is slow).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.errors import KVFormatError
from ragkv.kvstore import ChunkKey, LayerGate
from ragkv.server.settings import CollectionSpec
from ragkv.types import Tier
from tests.server.fakes import ServerThread, settings
from tests.server.test_pipeline import QUESTION, _copy, tiny_index  # noqa: F401 - the session fixture

TOP_K = 4
_MODES = [("reuse", "query"), ("blend", "query"), ("blend", "deviation"), ("focus", "query")]


class _FailsLate(LayerGate):
    """Layers [0, good) are ready; a wait on a later one is answered, `delay` s later and from
    another thread, by that layer's checksum failing (as a slow read of a bad block would)."""

    def __init__(self, num_layers: int, good: int, delay: float) -> None:
        super().__init__(num_layers)
        self.publish(good)
        self._delay = delay
        self._armed = threading.Lock()

    def _arm(self, layer: int) -> None:
        if layer >= self.ready and self._armed.acquire(blocking=False):
            err = KVFormatError(f"checksum mismatch in block of layer {layer} (test, after {self._delay} s)")
            threading.Timer(self._delay, self.fail, [err]).start()

    def wait(self, layer: int, timeout: float | None = None) -> None:
        self._arm(layer)
        super().wait(layer, timeout)

    def when_ready(self, layer: int):  # the scheduler parks on it instead of waiting
        self._arm(layer)
        return super().when_ready(layer)


def _query(addr: str, mode: str, top_k: int = TOP_K, **kw: object):
    with RagClient(addr, timeout=60) as client:
        stream = client.query(QUESTION, mode=mode, top_k=top_k, max_new_tokens=6, recompute_ratio=0.3, **kw)
        stats = stream.result()
        return stream, stats


@pytest.fixture(scope="module")
def gated_server(tiny_index: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    """A server whose layered hits pass through `arm`'s gates while it holds a plan."""
    import ragkv.server.pipeline as sp
    from ragkv.server.assembly import build_pipeline

    real = sp.ChunkKV.from_stored
    plan: list = []  # one gate factory per layered chunk, consumed in order; empty = real gates
    used: list[LayerGate] = []

    def gated(entry, device, dtype, ready=None):
        kv = real(entry, device, dtype, ready)
        if ready is None or not plan:
            return kv
        ready.wait_all()  # the real read is whole; the gate replays it as the plan says
        gate = plan.pop(0)(entry.k.shape[0])
        used.append(gate)
        return dataclasses.replace(kv, ready=gate)

    mp = pytest.MonkeyPatch()
    mp.setattr(sp.ChunkKV, "from_stored", gated)
    index = _copy(tiny_index, tmp_path_factory.mktemp("gated") / "index")
    # no CPU tier to speak of: every request reads layered from disk
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1), build_pipeline)
    st.plan, st.used = plan, used
    yield st
    st.stop()
    mp.undo()


@pytest.mark.parametrize("mode, selector", _MODES)
def test_a_read_failing_during_the_retry_is_recomputed_too(
    gated_server: ServerThread, mode: str, selector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 1 fails at layer 1 at once; chunk 2 holds layer 2 back and fails it only once the
    first retry waits on it. Before the fix the retry's failure escaped as DATA_LOSS."""
    import ragkv.server.pipeline as sp
    from ragkv.engine import BlendOptions

    monkeypatch.setattr(sp, "BlendOptions", functools.partial(BlendOptions, selector=selector))
    clean_stream, clean = _query(gated_server.addr, mode)
    assert {c.kv_tier for c in clean_stream.chunks} == {Tier.DISK}

    def at_once(n: int) -> LayerGate:
        gate = LayerGate(n)
        gate.publish(1)
        gate.fail(KVFormatError("checksum mismatch in block of layer 1 (test)"))
        return gate

    gated_server.used.clear()
    gated_server.plan[:] = [at_once, functools.partial(_FailsLate, good=2, delay=0.2)]
    try:
        broken_stream, broken = _query(gated_server.addr, mode)
    finally:
        gated_server.plan.clear()
    assert len(gated_server.used) == 2, "the gates never reached the engine"
    late = gated_server.used[1]
    assert late.error is not None, f"{mode}/{selector}: the late gate was never waited on past layer 1"
    assert broken.text == clean.text, f"{mode}/{selector}: {broken.text!r} != clean {clean.text!r}"
    assert broken.usage.cached_prompt_tokens < clean.usage.cached_prompt_tokens


def _key_of(f: Path) -> ChunkKey:
    return ChunkKey.from_str(f.name.removesuffix(".safetensors"))


def _reblock(kv_dir: Path, manifest: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite every chunk file with 1 KiB checksum blocks (the tiny model's files are ~25 KB,
    one 1 MiB block: a layered read would check all of it before handing out layer 0)."""
    import ragkv.kvstore.fileformat as ff
    import ragkv.kvstore.tiers.disk as disk

    monkeypatch.setattr(ff, "CHECKSUM_BLOCK_BYTES", 1024)
    monkeypatch.setattr(ff, "_MIN_BLOCK_BYTES", 1024)
    monkeypatch.setattr(disk, "CHECKSUM_BLOCK_BYTES", 1024)
    for f in kv_dir.rglob("*.safetensors"):
        entry = ff.decode(bytearray(f.read_bytes()), expected_key=_key_of(f), model_fp=manifest["model_fp"],
                          tokenizer_fp=manifest["tokenizer_fp"])
        f.write_bytes(ff.encode(entry))


def _corrupt(kv_dir: Path) -> dict[str, list[Path]]:
    """Flip a bit deep in every other file (a late layer), truncate the rest."""
    files = sorted(f for f in kv_dir.rglob("*.safetensors") if ".quarantine" not in f.parts)
    assert len(files) >= 4, f"expected >= 4 chunk files under {kv_dir}, found {len(files)}"
    done: dict[str, list[Path]] = {"flipped": [], "truncated": []}
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 2 == 0:
            data[len(data) * 9 // 10] ^= 0x10
            f.write_bytes(bytes(data))
            done["flipped"].append(f)
        else:
            f.write_bytes(bytes(data[: len(data) * 2 // 3]))
            done["truncated"].append(f)
    return done


def _answers(addr: str, top_k: int) -> dict[str, tuple[str, set[Tier]]]:
    out = {}
    for mode in ("reuse", "blend", "focus", "full"):
        stream, stats = _query(addr, mode, top_k=top_k)
        out[mode] = (stats.text, {c.kv_tier for c in stream.chunks})
    return out


@pytest.mark.parametrize("layered", [True, False], ids=["layered", "whole"])
def test_corrupted_files_are_recomputed_and_rewritten(
    tiny_index: Path, tmp_path: Path, layered: bool, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from ragkv.kvstore.fileformat import decode
    from ragkv.kvstore.tiers.disk import DiskTier
    from ragkv.server.assembly import build_pipeline

    # quarantine takes its time: a write-back racing it must not lose the rewritten file
    slow = DiskTier._discard

    def slow_discard(self, *args, **kwargs):
        time.sleep(0.3)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "_discard", slow_discard)
    index = _copy(tiny_index, tmp_path / "index")
    manifest = json.loads((index / "manifest.json").read_text())
    _reblock(index / "kv", manifest, monkeypatch)
    n = len(list((index / "kv").rglob("*.safetensors")))  # every chunk, in every request
    conf = dict(indexes=(CollectionSpec("default", index),), kv_layered=layered, kv_cpu_bytes=1)
    st = ServerThread(settings(**conf), build_pipeline)
    try:
        clean = _answers(st.addr, n)
    finally:
        st.stop()
    assert clean["reuse"][1] == {Tier.DISK}, f"clean run read tiers {clean['reuse'][1]}"
    assert not (index / "kv" / ".quarantine").exists(), "the clean run quarantined a file"
    for mode in ("reuse", "blend", "focus"):  # damage every file anew, then one request reads them all
        damaged = _corrupt(index / "kv")
        st = ServerThread(settings(**conf), build_pipeline)
        try:
            stream, stats = _query(st.addr, mode, top_k=n)
            st.server.service.backend.flush_writes(60)  # write-backs reach the disk on a writer thread
        finally:
            st.stop()
        assert stats.text == clean[mode][0], f"{mode}: answer over damaged KV differs"
        assert Tier.COMPUTED in {c.kv_tier for c in stream.chunks}, f"{mode}: no damaged file was detected"
        for f in damaged["flipped"] + damaged["truncated"]:  # after this one request, not a later one
            assert f.exists(), f"{mode}: {f.name} was not written back after its damaged copy was quarantined"
            decode(bytearray(f.read_bytes()), expected_key=_key_of(f),
                   model_fp=manifest["model_fp"], tokenizer_fp=manifest["tokenizer_fp"])  # KVFormatError if bad
    quarantined = list((index / "kv" / ".quarantine").glob("*.safetensors"))
    assert len(quarantined) >= 3 * len(damaged["flipped"] + damaged["truncated"]), "damaged copies not quarantined"
    st = ServerThread(settings(**conf), build_pipeline)  # the next start reads them, computes none
    try:
        restarted = _answers(st.addr, n)
    finally:
        st.stop()
    for mode in ("reuse", "blend", "focus"):
        assert restarted[mode][1] == {Tier.DISK}, f"{mode} after restart: tiers {restarted[mode][1]}"
        assert restarted[mode][0] == clean[mode][0]
