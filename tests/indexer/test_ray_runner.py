"""The Ray runner: on a local Ray instance it builds the same index and KV files as the local job."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ragkv.cli.main import main
from ragkv.indexer.job import Runner, run_index
from ragkv.indexer.spot import IndexInterrupted, StopReason, StopSignal
from tests.indexer.helpers import assert_same_index, dump_index, kv_files

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


# Ray's worker process runs the same model on its own thread count, and float sums differ
# with the number of threads: the KV is the same within this tolerance, not bit for bit.
KV_ATOL, KV_RTOL = 1e-5, 1e-4


def _assert_same_kv(a_dir: Path, b_dir: Path) -> None:
    """Same KV files (names are content keys), same token ids and positions, K/V within tolerance."""
    import torch
    from safetensors import safe_open

    a = {p.name: p for p in a_dir.rglob("*.safetensors")}
    b = {p.name: p for p in b_dir.rglob("*.safetensors")}
    assert sorted(a) == sorted(b) and a
    for name in a:
        with safe_open(str(a[name]), "pt") as fa, safe_open(str(b[name]), "pt") as fb:
            assert sorted(fa.keys()) == sorted(fb.keys())
            meta_a, meta_b = fa.metadata(), fb.metadata()
            same = {k for k in meta_a if "checksum" not in k and "crc" not in k}
            assert {k: meta_a[k] for k in same} == {k: meta_b.get(k) for k in same}, name
            for t in fa.keys():
                x, y = fa.get_tensor(t), fb.get_tensor(t)
                if x.is_floating_point():
                    torch.testing.assert_close(x, y, atol=KV_ATOL, rtol=KV_RTOL, msg=f"{name}:{t}")
                else:
                    assert torch.equal(x, y), f"{name}:{t}"


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
    _assert_same_kv(ray_config.out / "kv", job_config.out / "kv")
    assert local_ray.is_initialized(), "a runner that joined a running Ray leaves it running"


def test_ray_runner_stop_then_resume(local_ray, job_config, tiny_lm, embedder, tmp_path):
    import ragkv.indexer.ray_runner

    stop = StopSignal()
    real_run = ragkv.indexer.ray_runner.RayKVRunner.run

    def run_then_stop(self, batches, on_done, should_stop):
        def first_then_stop(batch, nbytes):
            on_done(batch, nbytes)
            stop.set(StopReason.REQUESTED)  # as SIGTERM would, once one batch is durable
        return real_run(self, batches, first_then_stop, should_stop)

    cfg = dataclasses.replace(job_config, runner=Runner.RAY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ragkv.indexer.ray_runner.RayKVRunner, "run", run_then_stop)
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
    _assert_same_kv(cfg.out / "kv", clean.out / "kv")


def test_missing_ray_names_the_extra(job_config, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    args = ["index", str(job_config.corpus), "--out", str(job_config.out), "--runner", "ray", "--no-progress"]
    assert main(args) == 1
    assert "pip install 'ragkv[ray]'" in capsys.readouterr().err
    assert not job_config.out.exists(), "fails before any work"


def test_parsing_runner_flags_does_not_import_ray():
    code = ("import sys, ragkv.cli.main as c; a = c.build_parser().parse_args(['index', 'x', '--out', 'y', "
            "'--runner', 'ray', '--ray-address', 'auto', '--ray-workers', '2']); "
            "print(a.runner, a.ray_address, a.ray_workers, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ray", "auto", "2", "False"]
