"""The Spot watcher against a local fake IMDSv2 server, and shard resolution."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragkv.indexer.sharding import resolve_shard, shard_of
from ragkv.indexer.spot import SpotWatcher, StopReason, StopSignal
from ragkv.retriever.manifest import ShardSpec

NOTICE = '{"action": "terminate", "time": "2026-11-21T23:50:00Z"}'


class FakeIMDS:
    """IMDSv2: PUT /latest/api/token, then GET spot/instance-action with the token (404 until armed)."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.polls = 0
        self.tokenless = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def do_PUT(self):
                ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                self._reply(200 if ok else 400, "tok-123" if ok else "")

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                    fake.tokenless += 1
                    return self._reply(401, "")
                if self.path != "/latest/meta-data/spot/instance-action":
                    return self._reply(404, "")
                fake.polls += 1
                self._reply(200, NOTICE) if fake.armed.is_set() else self._reply(404, "not found")

            def _reply(self, code, body):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def imds():
    fake = FakeIMDS()
    yield fake
    fake.close()


def test_watcher_stops_on_interruption_notice(imds):
    stop = StopSignal()
    with SpotWatcher(stop, imds.url, interval_s=0.02):
        for _ in range(200):
            if imds.polls >= 3:
                break
            stop.wait(0.02)
        assert imds.polls >= 3 and not stop.is_set()  # 404: keep going
        imds.armed.set()
        assert stop.wait(5)
    assert stop.reason is StopReason.SPOT_NOTICE and "terminate" in stop.detail
    assert imds.tokenless == 0  # every poll carried the IMDSv2 token


def test_watcher_tolerates_an_unreachable_endpoint():
    stop = StopSignal()
    with SpotWatcher(stop, "http://127.0.0.1:9", interval_s=0.01, timeout_s=0.2):
        assert not stop.wait(0.2)


def test_job_stops_on_notice_with_exit_75(imds, job_config, tmp_path, capsys):
    import threading as th

    from ragkv.cli.main import main
    from tests.indexer.helpers import CHUNK_SIZE, dump_index, kv_files

    out = tmp_path / "spot"

    def arm_when_kv_starts():
        while not kv_files(out / "kv"):
            stop_wait.wait(0.01)
        imds.armed.set()

    stop_wait = th.Event()
    th.Thread(target=arm_when_kv_starts, daemon=True).start()
    rc = main(["index", str(job_config.corpus), "--out", str(out), "--model", job_config.model,
               "--chunk-size", str(CHUNK_SIZE), "--kv-batch", "1", "--no-progress",
               "--imds-endpoint", imds.url, "--imds-interval", "0.02"])
    assert rc == 75
    assert "spot_notice" in capsys.readouterr().err
    d = dump_index(out)
    # stopped mid-KV (the default index's plain pass comes first, then the neighbour KV): KV on disk
    # for the next run to resume from, and not every chunk done
    assert d["manifest"]["state"] == "building" and sum(c[9] for c in d["chunks"]) < len(d["chunks"])
    assert kv_files(out / "kv")


def test_shards_partition_documents_stably():
    ids = [f"doc-{i}" for i in range(200)]
    owners = [shard_of(i, 4) for i in ids]
    assert owners == [shard_of(i, 4) for i in ids]
    assert set(owners) == {0, 1, 2, 3}


def test_resolve_shard_from_flag_and_batch_env():
    assert resolve_shard("1/3", {}) == ShardSpec(1, 3)
    assert resolve_shard(None, {}) is None
    env = {"AWS_BATCH_JOB_ARRAY_INDEX": "2", "AWS_BATCH_JOB_ARRAY_SIZE": "5"}
    assert resolve_shard(None, env) == ShardSpec(2, 5)
    assert resolve_shard("0/1", env) == ShardSpec(0, 1)  # the flag wins
    with pytest.raises(ValueError, match="AWS_BATCH_JOB_ARRAY_SIZE=None"):
        resolve_shard(None, {"AWS_BATCH_JOB_ARRAY_INDEX": "2"})
    for bad in ("3/3", "a/b", "1", "-1/2"):
        with pytest.raises(ValueError, match=bad.split("/")[0]):
            resolve_shard(bad, {})
