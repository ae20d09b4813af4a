"""The Ray runner: on a local Ray instance it builds the same index and KV files as the local job."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from indexer.job import Runner, run_index
from indexer.spot import IndexInterrupted, StopReason, StopSignal
from ragkv.cli import main
from tests.indexer.helpers import assert_same_index, dump_index, kv_files

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _kv_bytes(kv_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in kv_dir.rglob("*.safetensors")}


def test_ray_runner_equals_local_run(local_ray, job_config, tiny_lm, embedder, tmp_path):
    local = run_index(job_config, lm=tiny_lm, embedder=embedder)
    ray_config = dataclasses.replace(job_config, out=tmp_path / "ray-index", runner=Runner.RAY)
    remote = run_index(ray_config, lm=tiny_lm, embedder=embedder)

    assert (remote.chunks, remote.kv_chunks, remote.kv_tokens, remote.kv_bytes) == \
        (local.chunks, local.kv_chunks, local.kv_tokens, local.kv_bytes)
    assert remote.kv_chunks == remote.chunks > 0
    assert_same_index(job_config.out, ray_config.out)  # chunks, vectors, kv_done, manifest
    assert dump_index(ray_config.out)["manifest"]["kv_precomputed"]
    assert kv_files(ray_config.out / "kv") == kv_files(job_config.out / "kv")
    assert _kv_bytes(ray_config.out / "kv") == _kv_bytes(job_config.out / "kv")
    assert local_ray.is_initialized(), "a runner that joined a running Ray leaves it running"


def test_ray_runner_stop_then_resume(local_ray, job_config, tiny_lm, embedder, tmp_path):
    import indexer.ray_runner

    stop = StopSignal()
    real_run = indexer.ray_runner.RayKVRunner.run

    def run_then_stop(self, batches, on_done, should_stop):
        def first_then_stop(batch, nbytes):
            on_done(batch, nbytes)
            stop.set(StopReason.REQUESTED)  # as SIGTERM would, once one batch is durable
        return real_run(self, batches, first_then_stop, should_stop)

    cfg = dataclasses.replace(job_config, runner=Runner.RAY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexer.ray_runner.RayKVRunner, "run", run_then_stop)
        with pytest.raises(IndexInterrupted, match="requested"):
            run_index(cfg, stop, lm=tiny_lm, embedder=embedder)
    d = dump_index(cfg.out)
    done = sum(c[9] for c in d["chunks"])
    assert d["manifest"]["state"] == "building"
    assert 2 <= done < len(d["chunks"])  # the batches already queued on the actor were finished
    assert len(kv_files(cfg.out / "kv")) == done

    s = run_index(cfg, lm=tiny_lm, embedder=embedder)
    assert s.kv_chunks == s.chunks - done
    clean = dataclasses.replace(job_config, out=tmp_path / "clean")
    run_index(clean, lm=tiny_lm, embedder=embedder)
    assert_same_index(cfg.out, clean.out)
    assert _kv_bytes(cfg.out / "kv") == _kv_bytes(clean.out / "kv")


def test_missing_ray_names_the_extra(job_config, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    args = ["index", str(job_config.corpus), "--out", str(job_config.out), "--runner", "ray", "--no-progress"]
    assert main(args) == 1
    assert "pip install 'ragkv[ray]'" in capsys.readouterr().err
    assert not job_config.out.exists(), "fails before any work"


def test_parsing_runner_flags_does_not_import_ray():
    code = ("import sys, ragkv.cli as c; a = c.build_parser().parse_args(['index', 'x', '--out', 'y', "
            "'--runner', 'ray', '--ray-address', 'auto', '--ray-workers', '2']); "
            "print(a.runner, a.ray_address, a.ray_workers, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ray", "auto", "2", "False"]
