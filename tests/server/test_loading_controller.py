"""The loading controller: read a chunk's KV or recompute it, whichever is cheaper, and
never wait on a read that overruns its estimate (real pipeline, tiny model, disk tier with
injected latency). Answers are the same whichever way each chunk's KV came."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.kvstore.tiers.disk import DiskTier
from ragkv.kvstore.timing import ReadEstimate
from ragkv.server.loading_controller import ControllerConfig, LoadingController
from ragkv.server.settings import CollectionSpec
from ragkv.types import KVSource, Mode, Tier
from tests.server.fakes import ServerThread, settings
from tests.server.test_pipeline import QUESTION, _copy, tiny_index  # noqa: F401 - the session fixture

TOP_K = 3


class _Store:
    """What the controller asks of a store: where a key is, its tier's measured speed, how many
    reads run at once."""

    def __init__(self, tiers: dict[str, Tier | None], est: dict[Tier, ReadEstimate | None], workers: int = 4) -> None:
        self.tiers, self.est, self.prefetch_workers = tiers, est, workers

    def where_many(self, keys: list[str]) -> list[Tier | None]:
        return [self.tiers[k] for k in keys]

    def read_estimate(self, tier: Tier) -> ReadEstimate | None:
        return self.est[tier]


_SLOW = ReadEstimate(latency_s=0.2, bytes_per_s=1e6, bytes_per_token=4096, reads=3)  # 500 tokens: 2.25 s
_FAST = ReadEstimate(latency_s=0.001, bytes_per_s=1e9, bytes_per_token=4096, reads=3)  # 500 tokens: ~3 ms


def _sources(decisions) -> list[KVSource]:
    return [d.source for d in decisions]


def test_decisions_follow_the_measured_costs() -> None:
    c = LoadingController()
    c.speed.observe(1000, 1.0)  # 1000 tokens/s: 500 tokens take 0.5 s to compute
    slow, fast = _Store({"a": Tier.S3}, {Tier.S3: _SLOW}), _Store({"a": Tier.DISK}, {Tier.DISK: _FAST})
    assert _sources(c.decide(slow, ["a"], [500])) == [KVSource.COMPUTED_CHEAPER]
    (d,) = c.decide(fast, ["a"], [500])
    assert d.load and d.source is KVSource.LOADED and d.load_s < d.compute_s
    assert _sources(c.decide(_Store({"a": None}, {}), ["a"], [500])) == [KVSource.COMPUTED_MISSING]
    assert c.decide(_Store({"a": Tier.S3}, {Tier.S3: None}), ["a"], [500])[0].load  # unmeasured: read it
    assert LoadingController(ControllerConfig(enabled=False)).decide(slow, ["a"], [500])[0].load
    # a read races its chunk's compute once it overruns its estimate (+50 ms), never later than
    # the hard limit; unmeasured, once computing the chunk would have been done (0.5 s x 1.2)
    assert c.wait_limit([d], 120.0) == pytest.approx(d.load_s + 0.05)
    assert c.wait_limit(c.decide(_Store({"a": Tier.S3}, {Tier.S3: None}), ["a"], [500]), 120.0) == \
        pytest.approx(1.2 * 0.5 + 0.05)
    assert LoadingController().wait_limit(c.decide(_Store({"a": Tier.S3}, {Tier.S3: None}), ["a"], [500]), 9.0) \
        == pytest.approx(0.65)
    unknown = LoadingController()  # neither the read nor the compute measured: the hard limit
    assert unknown.wait_limit(unknown.decide(_Store({"a": Tier.S3}, {Tier.S3: None}), ["a"], [500]), 120.0) == 120.0


def test_reads_run_in_parallel_computes_in_series() -> None:
    """Eight 2.25 s reads, four at a time, take 4.5 s; computing a chunk takes 0.5 s (0.6 s with
    the margin). Computing all eight (4.8 s) would be slower than reading them: the controller
    computes the slowest reads only while that brings the request's ready time down."""
    c = LoadingController()
    c.speed.observe(1000, 1.0)
    keys = list("abcdefgh")
    store = _Store({k: Tier.S3 for k in keys}, {Tier.S3: _SLOW}, workers=4)
    out = c.decide(store, keys, [500] * 8)
    computed = _sources(out).count(KVSource.COMPUTED_CHEAPER)
    assert 0 < computed < 8
    # the split it chose: reads in rounds of 4, computes one after another
    reads = 8 - computed
    ready = max(2.25 * -(-reads // 4) if reads else 0.0, 1.2 * 0.5 * computed)
    assert ready < 4.5 and ready < 1.2 * 0.5 * 8
    # a chunk already missing adds its compute to the serial side
    store.tiers["h"] = None
    with_missing = c.decide(store, keys, [500] * 8)
    assert with_missing[-1].source is KVSource.COMPUTED_MISSING


# an 8B model on an H100 (docs/results/gpu-bench-h100-8b.json): 512-token chunks prefilled at
# 11.9k tokens/s, 8,256-token prompts at 32k (full) and 72k (blend 0.15 over KV at hand), KV of
# 128 KiB a token read from local disk at 250 MB/s a read, four reads at once
_GPU_DISK = ReadEstimate(latency_s=0.02, bytes_per_s=2.5e8, bytes_per_token=131072, reads=3)
_GPU_PINNED = ReadEstimate(latency_s=0.0, bytes_per_s=4.8e10, bytes_per_token=131072, reads=3)


def _gpu_controller(**rates: float) -> LoadingController:
    c = LoadingController()
    c.speed.observe(512, 512 / 11_900)
    for mode, tokens_per_s in {"full": 32_000, "blend": 72_000, **rates}.items():
        c.speed.observe_prompt(Mode(mode), 8256, 8256 / tokens_per_s)
    return c


def test_full_prefill_is_chosen_when_it_is_sooner_than_reading() -> None:
    """From a slow disk, reading (or computing chunk by chunk) and then blending takes longer than
    one full prefill on a fast engine: the controller serves the request by full prefill. From
    pinned memory it reads. Never without measured rates, nor when a chunk is in no tier."""
    keys = [f"k{i}" for i in range(16)]
    disk = _Store(dict.fromkeys(keys, Tier.DISK), {Tier.DISK: _GPU_DISK}, workers=4)
    cpu = _Store(dict.fromkeys(keys, Tier.CPU), {Tier.CPU: _GPU_PINNED}, workers=4)
    c = _gpu_controller()
    on_disk = c.decide(disk, keys, [512] * 16)
    assert c.prefers_full(on_disk, Mode.BLEND, 8256, workers=4)
    assert c.prefers_full(on_disk, Mode.BLEND, 8256, workers=4, layered=False)
    in_memory = c.decide(cpu, keys, [512] * 16)
    assert all(d.load for d in in_memory) and not c.prefers_full(in_memory, Mode.BLEND, 8256, workers=4)
    assert not c.prefers_full(on_disk, Mode.FULL, 8256, workers=4)  # already full
    assert not c.prefers_full(on_disk, Mode.REUSE, 8256, workers=4)  # reuse's pass never measured
    assert not _gpu_controller(full=1e-9).prefers_full(on_disk, Mode.BLEND, 8256, workers=4)  # full is slow here
    assert not LoadingController(ControllerConfig(enabled=False), c.speed).prefers_full(on_disk, Mode.BLEND, 8256, 4)
    disk.tiers["k3"] = None  # computing a missing chunk writes its KV back: the chunk plan stays
    assert not c.prefers_full(c.decide(disk, keys, [512] * 16), Mode.BLEND, 8256, workers=4)
    # a small prompt saves milliseconds at most: no switch on timing noise
    small = _Store({"a": Tier.DISK}, {Tier.DISK: ReadEstimate(0.01, 1e9, 4096, 3)})
    assert not c.prefers_full(c.decide(small, ["a"], [64]), Mode.BLEND, 120, workers=4)


@pytest.fixture()
def slow_disk(monkeypatch: pytest.MonkeyPatch):
    """Every disk read sleeps `delay[0]` seconds first (its latency), on the prefetch thread."""
    delay = [0.0]
    real = DiskTier.read

    def slow(self, *args, **kw):
        time.sleep(delay[0])
        return real(self, *args, **kw)

    monkeypatch.setattr(DiskTier, "read", slow)
    return delay


@pytest.fixture()
def server(tiny_index: Path, tmp_path: Path):  # noqa: F811
    from ragkv.server.assembly import build_pipeline

    index = _copy(tiny_index, tmp_path / "index")
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1, kv_controller=True),
                      build_pipeline)
    yield st
    st.stop()


def _ask(addr: str, mode: str = "reuse", max_new_tokens: int = 6):
    with RagClient(addr, timeout=60) as client:
        stream = client.query(QUESTION, mode=mode, top_k=TOP_K, max_new_tokens=max_new_tokens)
        stats = stream.result()
        return stream, stats


def _pipeline(st: ServerThread):
    return st.server.service.backend  # the test reaches the controller it configures


def test_a_tier_slower_than_recompute_is_not_read(server: ServerThread, slow_disk: list[float]) -> None:
    slow_disk[0] = 0.4  # a slow tier: each read takes 0.4 s, a tiny model computes a chunk in ms
    first_stream, first = _ask(server.addr)
    # not measured yet: read, but waited for no longer than computing the chunks takes; then
    # each read races its chunk's compute, which wins, and the reads land later and are measured
    assert first.kv_sources == {KVSource.COMPUTED_OVERRUN: TOP_K}
    assert first.phase_seconds["kv_wait"] < 0.3
    deadline = time.monotonic() + 10
    while _pipeline(server)._collections["default"].store.read_estimate(Tier.DISK) is None:
        assert time.monotonic() < deadline, "the abandoned reads were never measured"
        time.sleep(0.05)
    _, second = _ask(server.addr)
    assert second.kv_sources == {KVSource.COMPUTED_CHEAPER: TOP_K}
    assert second.text == first.text
    assert second.phase_seconds["kv_wait"] < 0.2  # nothing waited on the slow tier


def test_over_compressed_files_computing_instead_of_reading_changes_no_answer(
        tmp_path: Path, tiny_llama_dir: Path, slow_disk: list[float]) -> None:
    """The controller's choice is a matter of time, never of the answer: over an index of int4
    files (as `ragkv index` writes its chunks' KV), the chunks it computes because the tier is
    slow are served as their files read back, so the answer is the one reading gives."""
    from ragkv.server.assembly import build_pipeline
    from tests.server.test_pipeline import _index_of_corpus

    index = _index_of_corpus(tmp_path, tiny_llama_dir, kv_compression="int4")

    def serve(controller: bool) -> ServerThread:
        return ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1,
                                     kv_controller=controller), build_pipeline)

    st = serve(False)  # every chunk read
    try:
        _, read = _ask(st.addr, "blend", max_new_tokens=12)
    finally:
        st.stop()
    assert read.kv_sources == {KVSource.LOADED: TOP_K}
    slow_disk[0] = 0.4  # a tier 0.4 s away, a tiny model computing a chunk in milliseconds
    st = serve(True)
    try:
        _, first = _ask(st.addr, "blend", max_new_tokens=12)  # its reads overrun: computed, and measured
        deadline = time.monotonic() + 10
        while _pipeline(st)._collections["default"].store.read_estimate(Tier.DISK) is None:
            assert time.monotonic() < deadline, "the abandoned reads were never measured"
            time.sleep(0.05)
        _, computed = _ask(st.addr, "blend", max_new_tokens=12)
    finally:
        st.stop()
    assert first.kv_sources == {KVSource.COMPUTED_OVERRUN: TOP_K}
    assert computed.kv_sources == {KVSource.COMPUTED_CHEAPER: TOP_K}
    assert first.text == computed.text == read.text


def test_a_tier_faster_than_recompute_is_read(server: ServerThread, slow_disk: list[float]) -> None:
    controller = _pipeline(server).controller
    for _ in range(20):  # an engine computing 20 tokens a second: any disk read is cheaper
        controller.speed.observe(20, 1.0)
    _, first = _ask(server.addr)
    _, second = _ask(server.addr)
    assert first.kv_sources == second.kv_sources == {KVSource.LOADED: TOP_K}
    stream, _ = _ask(server.addr)
    assert {c.kv_tier for c in stream.chunks} == {Tier.DISK}


def test_a_read_that_overruns_is_abandoned_and_the_answer_unchanged(server: ServerThread,
                                                                      slow_disk: list[float]) -> None:
    controller = _pipeline(server).controller
    for _ in range(20):  # recompute looks slow, so the (fast, measured) tier is chosen...
        controller.speed.observe(20, 1.0)
    _, clean = _ask(server.addr)
    _, again = _ask(server.addr)
    assert clean.kv_sources == again.kv_sources == {KVSource.LOADED: TOP_K}
    slow_disk[0] = 3.0  # ...then the tier stalls: 3 s a read, far past its estimate
    t0 = time.monotonic()
    _, stalled = _ask(server.addr)
    took = time.monotonic() - t0
    assert stalled.kv_sources == {KVSource.COMPUTED_OVERRUN: TOP_K}
    assert stalled.text == clean.text
    assert took < 2.5, f"the request waited for the stalled reads ({took:.2f} s)"


def test_waiting_for_kv_parks_the_request_and_others_decode(server: ServerThread, slow_disk: list[float]) -> None:
    """A 1 s read parks its request (waiting_kv) while another request decodes to its end."""
    sched = server.server._scheduler
    # the controller off: the read is waited for whole (with it on, the slow read would race
    # its chunk's compute once past its estimate, as the test above shows)
    _pipeline(server).controller.config = ControllerConfig(enabled=False)
    _, base = _ask(server.addr)
    slow_disk[0] = 3.0
    result: dict = {}

    def slow_request() -> None:
        result["stats"] = _ask(server.addr)[1]

    t = threading.Thread(target=slow_request)
    t.start()
    deadline = time.monotonic() + 2.5  # its reads take 3 s: it is parked well before they end
    while sched.stats.waiting_kv != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    parked = sched.stats.waiting_kv
    _, other = _ask(server.addr, mode="full", max_new_tokens=24)  # a full prefill needs no KV read
    still_parked = not result
    t.join(30)
    assert parked == 1  # parked on its reads
    assert other.usage.completion_tokens > 0 and still_parked  # answered while the other waited
    assert result["stats"].text == base.text  # the same answer, only later


def test_a_slow_tier_on_a_fast_engine_is_served_by_full_prefill(server: ServerThread, slow_disk: list[float]) -> None:
    """Reads of 0.4 s against an engine whose full prefill is measured fast: the request runs as
    full prefill (its mode says so, its chunks count as cheaper computed, nothing is read) and
    answers as a full-mode request does."""
    speed = _pipeline(server).controller.speed
    for _ in range(20):  # chunk by chunk the engine is slow (20 tokens/s) ...
        speed.observe(20, 1.0)
    speed.observe_prompt(Mode.FULL, 10**6, 1.0)  # ... and a whole prompt pass fast
    slow_disk[0] = 0.4
    _, first = _ask(server.addr)
    assert first.mode is Mode.REUSE and first.kv_sources == {KVSource.LOADED: TOP_K}  # the tier unmeasured: read
    _, second = _ask(server.addr)
    assert second.mode is Mode.FULL and second.kv_sources == {KVSource.COMPUTED_CHEAPER: TOP_K}
    assert second.phase_seconds.get("kv_wait", 0.0) < 0.2
    _, full = _ask(server.addr, mode="full")
    assert second.text == full.text and full.kv_sources == {}
