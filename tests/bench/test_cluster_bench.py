"""The cluster bench's own arithmetic: the placement bounds it prints beside each policy."""

from __future__ import annotations

import pytest

from ragkv.cli.cluster_bench import TOPIC_MODULES, _ask, _build_index, _Tally, lru_hit_rate, plain_reads
from ragkv.evals.synthetic import module_paragraphs
from ragkv.types import Mode, RetrievedChunk, Tier, Usage


def test_lru_hit_rate_counts_hits_of_a_byte_bounded_lru():
    loads = [("a", 10), ("b", 10), ("a", 10), ("c", 10), ("b", 10), ("a", 10)]
    # 20 tokens hold two chunks: a b [a hit] c (evicts b) [b miss, evicts a] [a miss]
    assert lru_hit_rate(loads, 20) == round(1 / 6, 3)
    # 30 tokens hold all three: a b [a] c [b] [a]
    assert lru_hit_rate(loads, 30) == 0.5
    assert lru_hit_rate(loads, 5) == 0.0  # a chunk larger than the cache is never held
    assert lru_hit_rate([], 100) is None


def test_pooled_tiers_bound_is_never_below_one_tier():
    loads = [(f"c{i % 7}", 3) for i in range(50)]
    assert lru_hit_rate(loads, 9) <= lru_hit_rate(loads, 18) <= lru_hit_rate(loads, 27)


def test_topics_are_distinct_modules_with_text_enough_for_four_chunks():
    assert len(set(TOPIC_MODULES)) == len(TOPIC_MODULES) >= 24
    for name in TOPIC_MODULES:
        assert len(" ".join(module_paragraphs(name))) >= 3500, name


def test_build_index_refuses_more_topics_than_modules(tmp_path):
    with pytest.raises(ValueError, match="--topics must be in"):
        _build_index(tmp_path, "unused", None, None, len(TOPIC_MODULES) + 1)


class _Stream:
    def __init__(self, chunks):
        self.chunks = chunks

    def __iter__(self):
        return iter(())

    def result(self):
        class _Stats:
            ttft_seconds = 0.1
            usage = Usage(10, 1, 0)
        return _Stats()


class _Client:
    """Answers each query with the chunks it was given, in order (a RagClient's shape)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def query(self, question, **_):
        return _Stream([RetrievedChunk(cid, 1.0, "", kv_tier=Tier.DISK, num_tokens=10) for cid in self.answers.pop(0)])


def _loads(plain):
    tally = _Tally()
    client = _Client([("a", "b"), ("b", "a")])  # "a" first, then "a" after "b"
    for _ in range(2):
        _ask(client, "q", tally, 1, 2, plain=plain)
    return tally.loads


def test_a_chunk_first_or_later_is_one_load_where_both_read_its_plain_kv():
    # an index built without neighbours (the cluster bench's own): every position reads the one
    # plain KV, so the bounds must see "a" first and "a" later as the same tier entry
    plain = plain_reads(None, Mode.BLEND, focus_handover=True)
    assert plain == (True, True)
    loads = _loads(plain)
    assert [k for k, _ in loads] == ["a", "b", "b", "a"]
    assert lru_hit_rate(loads, 20) == 0.5


def test_an_index_with_neighbours_reads_two_entries_of_one_chunk():
    neighbours = {"m": 1, "budget_tokens": 512, "choice": "nearest", "context": "kv"}
    plain = plain_reads(neighbours, Mode.BLEND, focus_handover=True)
    assert plain == (True, False)  # the first chunk's plain KV, a later one's neighbour KV
    loads = _loads(plain)
    assert len({k for k, _ in loads}) == 4  # a, b#neighbours, b, a#neighbours
    assert lru_hit_rate(loads, 40) == 0.0
    # focus without handover reads the plain KV everywhere on such an index
    assert plain_reads(neighbours, Mode.FOCUS, focus_handover=False) == (True, True)


def test_a_peer_read_counts_toward_local_plus_peer_not_the_fast_tiers():
    from ragkv.cli.cluster_bench import _bounds, _summary

    tally = _Tally()

    class _Mixed(_Client):
        def query(self, question, **_):
            tiers = [Tier.CPU, Tier.PEER, Tier.DISK, Tier.PEER]
            return _Stream([RetrievedChunk(c, 1.0, "", kv_tier=t, num_tokens=10)
                            for c, t in zip(self.answers.pop(0), tiers)])

    _ask(_Mixed([("a", "b", "c", "d")]), "q", tally, 1, 4)
    s = _summary(tally)
    assert (s["fast_tier_hit_rate"], s["peer_hit_rate"], s["local_plus_peer_hit_rate"]) == (0.25, 0.5, 0.75)
    assert s["chunks_by_source"] == {"cpu": 1, "peer": 2, "disk": 1}
    tally.loads = [("a", 10), ("a", 10)]  # the pooled bound holds a on its second read: 0.5
    assert _bounds(tally, 2, 20)["local_plus_peer_of_pooled"] == 1.5


def test_network_delay_holds_each_answer_back_by_its_latency_and_paces_its_bytes(monkeypatch):
    """`--s3-latency-ms` / `--s3-mbps`: the loopback S3's answers wait before their first byte and
    come at the given rate, bytes unchanged; the sleeps are what is asserted (no clock read)."""
    from ragkv.cli import cluster_bench

    slept: list[float] = []
    monkeypatch.setattr(cluster_bench.time, "sleep", slept.append)
    closed = []

    class Body(list):
        def close(self):
            closed.append(True)

    def app(environ, start_response):
        start_response("200 OK", [])
        return Body([b"x" * 1000, b"y" * 3000])

    delayed = cluster_bench.NetworkDelay(app, 0.02, 1e5)
    assert b"".join(delayed({}, lambda *a: None)) == b"x" * 1000 + b"y" * 3000
    assert slept == [0.02, 0.01, 0.03] and closed == [True]
    slept.clear()
    assert b"".join(cluster_bench.NetworkDelay(app, 0.0, 0.0)({}, lambda *a: None)) == b"x" * 1000 + b"y" * 3000
    assert slept == []  # loopback as it is
    with pytest.raises(ValueError, match="latency and bandwidth must be >= 0"):
        cluster_bench.NetworkDelay(app, -1.0, 0.0)


def test_a_delayed_moto_server_serves_s3(tmp_path):
    """The delayed server is moto's own, answering boto3 over HTTP."""
    import boto3

    from ragkv.cli.cluster_bench import _free_port, _moto_server

    port = _free_port()
    server = _moto_server(port, 0.001, 50e6)
    server.start()
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="t", aws_secret_access_key="t")
        s3.create_bucket(Bucket="ragkv-net")
        s3.put_object(Bucket="ragkv-net", Key="k", Body=b"kv" * 5000)
        assert s3.get_object(Bucket="ragkv-net", Key="k", Range="bytes=2-5")["Body"].read() == b"kvkv"
        assert s3.get_object(Bucket="ragkv-net", Key="k")["Body"].read() == b"kv" * 5000
    finally:
        server.stop()


def test_the_scrape_reads_route_decisions_and_counts_a_shared_chunk_once(monkeypatch):
    """`_scrape` over /metrics as the ingress writes it: the hosts hold the host tiers' bytes plus
    what was published, less what the host tiers hold in the published copies' memory."""
    import io
    import urllib.request

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from ragkv.cli.cluster_bench import _scrape

    def exposition(replicas: dict[str, dict[str, float]]) -> bytes:
        class Ingress:
            def collect(self):
                decisions = CounterMetricFamily("ragkv_route_decisions", "decisions", labels=["reason"])
                decisions.add_metric(["held"], 7)
                decisions.add_metric(["pow2"], 2)
                yield decisions
                for name in sorted({n for g in replicas.values() for n in g}):
                    gauge = GaugeMetricFamily(f"ragkv_replica_{name}", name, labels=["replica"])
                    for replica, gauges in replicas.items():
                        gauge.add_metric([replica], gauges[name])
                    yield gauge

        registry = CollectorRegistry()
        registry.register(Ingress())
        return generate_latest(registry)

    text = exposition({"a": {"host_tier_bytes": 100, "host_tier_shared_bytes": 80, "peer_published_bytes": 90},
                       "b": {"host_tier_bytes": 50, "host_tier_shared_bytes": 0, "peer_published_bytes": 0}})
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(text))
    got = _scrape(9)
    assert got["route_decisions"] == {"held": 7, "pow2": 2}
    assert got["host_kv_bytes"] == {"host_tier_bytes": 150, "host_tier_shared_bytes": 80,
                                    "peer_published_bytes": 90, "held": 160}
    bare = exposition({})
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(bare))
    assert "host_kv_bytes" not in _scrape(9)  # no peer tier: no gauges
