"""S3 down does not fail requests: disk or recompute serves them, and the metrics count the S3 errors.

A real moto S3 server on loopback is stopped under a serving server (disk + S3 tiers),
then started again on the same port.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import boto3
import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from ragkv.types import Tier
from tests.server.fakes import ServerThread, settings
from tests.server.test_pipeline import QUESTION, _copy, tiny_index  # noqa: F401 - the session fixture

BUCKET = "ragkv-s3-down"


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch):
    """A moto S3 server that the test may stop and start again on the same port."""
    from moto.server import ThreadedMotoServer

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    first = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    first.start()
    host, port = first.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    # one try per call and a short connect timeout: a down endpoint costs milliseconds, not backoff
    import ragkv.kvstore.config as kv_config
    monkeypatch.setattr(kv_config, "S3Settings",
                        functools.partial(kv_config.S3Settings, max_attempts=1, connect_timeout_s=1.0))
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)

    class Handle:
        server = first
        url = endpoint

        def stop(self) -> None:
            self.server.stop()

        def start(self) -> None:
            self.server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
            self.server.start()

    h = Handle()
    yield h
    h.stop()


def _delete_kv(index: Path) -> None:
    files = list((index / "kv").rglob("*.safetensors"))
    assert files, f"no chunk files under {index / 'kv'}"
    for f in files:
        f.unlink()


def _errors(st: ServerThread, tier: str) -> float:
    value = st.server.metrics.registry.get_sample_value("ragkv_kv_tier_errors_total",
                                                        {"tier": tier, "collection": "default"})
    assert value is not None, "ragkv_kv_tier_errors_total is not exported"
    return value


def _ask(st: ServerThread, mode: str):
    with RagClient(st.addr, timeout=60) as client:
        stream = client.query(QUESTION, mode=mode, top_k=3, max_new_tokens=6, recompute_ratio=0.3)
        stats = stream.result()
    return stats.text, [c.kv_tier for c in stream.chunks], [c.chunk_id for c in stream.chunks]


def test_s3_down_requests_are_served_and_errors_counted(moto, tiny_index: Path, tmp_path: Path) -> None:  # noqa: F811
    from ragkv.server.assembly import build_pipeline

    index = _copy(tiny_index, tmp_path / "index")
    st = ServerThread(settings(indexes=(CollectionSpec("default", index),), kv_cpu_bytes=1,
                               kv_s3_uri=f"s3://{BUCKET}/kv"), build_pipeline)
    try:
        clean = {m: _ask(st, m) for m in ("reuse", "blend", "focus")}
        assert set(clean["reuse"][1]) == {Tier.DISK}
        assert _errors(st, "s3") == 0

        moto.stop()
        disk_only = {m: _ask(st, m) for m in clean}  # the disk tier serves; S3 is never needed
        assert all(set(t) == {Tier.DISK} for _, t, _ in disk_only.values()), disk_only
        down = {}
        for m in clean:  # every chunk misses the disk (the last mode's write-backs too): S3 is asked, and is down
            st.server.service.backend.flush_writes(60)
            _delete_kv(index)
            down[m] = _ask(st, m)
        for m in clean:
            assert down[m][0] == clean[m][0], f"{m}: answer with S3 down differs"
            assert set(down[m][1]) == {Tier.COMPUTED}, f"{m}: tiers {down[m][1]}"
        st.server.service.backend.flush_writes(60)
        assert _errors(st, "s3") > 0, "S3 was down for lookups and write-backs, yet no S3 error was counted"
        assert _errors(st, "disk") == 0

        moto.start()
        st.server.service.backend.flush_writes(60)
        _delete_kv(index)  # force one more computed write-back, S3 up
        time.sleep(0.1)
        back = _ask(st, "reuse")
        assert back[0] == clean["reuse"][0]
        st.server.service.backend.flush_writes(60)
        listed = boto3.client("s3", endpoint_url=moto.url).list_objects_v2(Bucket=BUCKET).get("Contents", [])
        assert listed, "after S3 came back, the write-back of a computed chunk did not reach it"
    finally:
        st.stop()
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["kv_uris"]  # the index itself was not rewritten by any of this
