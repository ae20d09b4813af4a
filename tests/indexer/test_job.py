"""The index job: end to end, incremental re-index, resume after kill -9, SIGTERM exit 75."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragkv.errors import IndexMismatchError
from ragkv.indexer.job import run_index
from ragkv.indexer.spot import EXIT_INTERRUPTED, IndexInterrupted, StopReason, StopSignal
from tests.indexer.helpers import CHUNK_SIZE, OVERLAP, assert_same_index, dump_index, index_chunks, kv_files

REPO = Path(__file__).resolve().parents[2]


def test_index_end_to_end(job_config, tiny_lm, embedder):
    s = run_index(job_config, lm=tiny_lm, embedder=embedder)
    out = job_config.out
    assert {p.name for p in out.iterdir()} >= {"manifest.json", "chunks.sqlite", "vectors.faiss", "kv"}
    assert not list(out.glob("chunks.sqlite-*")), "WAL files are folded back at the end"
    assert s.documents == 6 and s.chunks >= 8 and s.kv_chunks == s.chunks and s.kv_bytes > 0
    d = dump_index(out)
    assert d["manifest"]["state"] == "complete" and d["manifest"]["kv_precomputed"]
    assert len(kv_files(out / "kv")) == len({c[8] for c in d["chunks"]})
    assert all(c[7] <= CHUNK_SIZE for c in d["chunks"])

    again = run_index(job_config, lm=tiny_lm, embedder=embedder)  # nothing changed: nothing to do
    assert (again.documents_added, again.chunks_embedded, again.kv_chunks) == (0, 0, 0)


def test_incremental_reindex_touches_only_changes(job_config, tiny_lm, embedder):
    run_index(job_config, lm=tiny_lm, embedder=embedder)
    before = {c[1]: c for c in dump_index(job_config.out)["chunks"]}
    corpus = job_config.corpus
    (corpus / "space.txt").write_text("Venus is the hottest planet. Its clouds are made of sulfuric acid.")
    (corpus / "animals.txt").unlink()
    (corpus / "new.md").write_text("# New\n\nOctopuses have three hearts and blue blood.")
    s = run_index(job_config, lm=tiny_lm, embedder=embedder)
    assert (s.documents_added, s.documents_deleted) == (2, 2)  # space changed, new added; space + animals out
    after = {c[1]: c for c in dump_index(job_config.out)["chunks"]}
    docs = {c[2] for c in after.values()}
    assert "animals.txt" not in docs and "new.md" in docs
    new_ids = set(after) - set(before)
    assert {after[i][2] for i in new_ids} == {"space.txt", "new.md"}
    assert s.chunks_embedded == len(new_ids) and s.kv_chunks == len(new_ids)
    for i in set(after) & set(before):  # untouched chunks kept their rows, vectors and KV
        assert after[i] == before[i]


def test_other_model_in_same_folder_is_refused(job_config, tiny_lm, embedder, tmp_path):
    from ragkv.engine import load_model
    from ragkv.evals.testing import tiny_model_dir

    run_index(dataclasses.replace(job_config, precompute_kv=False), lm=tiny_lm, embedder=embedder)
    other = load_model(str(tiny_model_dir(tmp_path / "other", seed=1)), device="cpu", dtype="float32")
    with pytest.raises(IndexMismatchError, match="model_fp.*new --out"):
        run_index(job_config, lm=other, embedder=embedder)


def test_stop_signal_saves_progress_and_resume_finishes(job_config, tiny_lm, embedder, tmp_path, monkeypatch):
    import ragkv.indexer.job

    stop = StopSignal()
    real_run = ragkv.indexer.job.KVWriter.run

    def run_then_stop(self, batches, on_done, should_stop):
        def counted(batch, nbytes):
            on_done(batch, nbytes)
            counted.n += 1
            if counted.n == 2:
                stop.set(StopReason.REQUESTED)  # as SIGTERM would, after two batches are durable
        counted.n = 0
        return real_run(self, batches, counted, should_stop)

    monkeypatch.setattr(ragkv.indexer.job.KVWriter, "run", run_then_stop)
    with pytest.raises(IndexInterrupted, match="requested"):
        run_index(job_config, stop, lm=tiny_lm, embedder=embedder)
    monkeypatch.undo()
    d = dump_index(job_config.out)
    assert d["manifest"]["state"] == "building"
    done = sum(c[9] for c in d["chunks"])
    assert 4 <= done < len(d["chunks"])  # batches in flight were finished, the rest left
    assert len(kv_files(job_config.out / "kv")) == done  # every written file is checkpointed
    s = run_index(job_config, lm=tiny_lm, embedder=embedder)
    assert s.kv_chunks == s.chunks - done and s.chunks_embedded == 0

    clean = dataclasses.replace(job_config, out=tmp_path / "clean")
    run_index(clean, lm=tiny_lm, embedder=embedder)
    assert_same_index(job_config.out, clean.out)


def _cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "ragkv.cli", "index", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _cli_args(job_config, out: Path) -> list[str]:
    """`ragkv index` arguments that build what `job_config` builds (the CLI's own neighbour and
    KV-compression defaults differ from the library's: name the config's)."""
    nb = job_config.neighbours
    return [str(job_config.corpus), "--out", str(out), "--model", job_config.model, "--chunk-size",
            str(CHUNK_SIZE), "--chunk-overlap", str(OVERLAP), "--kv-batch", "1", "--no-progress",
            "--neighbours", str(nb.m), "--neighbour-budget", str(nb.budget_tokens),
            "--neighbour-context", nb.context.value, "--kv-compression", job_config.kv_compression]


def _wait_for_kv_files(kv_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kv_dir.exists() and len(kv_files(kv_dir)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"indexer exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError("indexer made no KV progress in time")


def test_kill_9_mid_run_then_rerun_equals_clean_run(job_config, tmp_path, tiny_lm, embedder):
    out = tmp_path / "killed"
    proc = _cli(_cli_args(job_config, out))
    _wait_for_kv_files(out / "kv", 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    partial = dump_index(out)
    assert partial["manifest"]["state"] == "building"
    n_done = sum(c[9] for c in partial["chunks"])
    assert 0 < n_done < len(partial["chunks"]), "kill should land in the KV phase"

    rerun = run_index(dataclasses.replace(job_config, out=out), lm=tiny_lm, embedder=embedder)
    assert rerun.kv_chunks <= len(partial["chunks"]) - n_done  # finished chunks were not recomputed
    assert rerun.chunks_embedded == 0

    clean = dataclasses.replace(job_config, out=tmp_path / "clean")
    run_index(clean, lm=tiny_lm, embedder=embedder)
    assert_same_index(out, clean.out)
    assert kv_files(out / "kv") == kv_files(clean.out / "kv")


def test_sigterm_checkpoints_and_exits_75(job_config, tmp_path, capsys):
    import threading

    from ragkv.cli.main import main

    out = tmp_path / "termed"
    args = _cli_args(job_config, out)

    def term_when_kv_starts():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not kv_files(out / "kv"):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # the watcher's handler is installed by now

    killer = threading.Thread(target=term_when_kv_starts, daemon=True)
    killer.start()
    assert main(["index", *args]) == EXIT_INTERRUPTED
    killer.join()
    assert "stopped (sigterm)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the old handler is back
    d = dump_index(out)
    assert d["manifest"]["state"] == "building"
    # every chunk marked done has its file: the batch in flight was finished, not lost
    done_keys = {c[8] for c in d["chunks"] if c[9]}
    assert done_keys and {k + ".safetensors" for k in done_keys} <= kv_files(out / "kv")
    assert len(done_keys) < len(d["chunks"])


def test_rerun_after_a_kvstore_format_change_rekeys_and_writes_the_kv_anew(job_config, tiny_lm, embedder,
                                                                            monkeypatch):
    import ragkv.kvstore.keys

    first = run_index(job_config, lm=tiny_lm, embedder=embedder)
    old_keys = {c[8] for c in dump_index(job_config.out)["chunks"]}
    monkeypatch.setattr(ragkv.kvstore.keys, "FORMAT_VERSION", ragkv.kvstore.keys.FORMAT_VERSION + 1)
    again = run_index(job_config, lm=tiny_lm, embedder=embedder)
    new_keys = {c[8] for c in dump_index(job_config.out)["chunks"]}
    assert again.documents_added == 0 and again.kv_chunks == first.kv_chunks  # nothing re-chunked, all KV anew
    assert new_keys.isdisjoint(old_keys) and len(new_keys) == len(old_keys)
    assert (run_index(job_config, lm=tiny_lm, embedder=embedder).kv_chunks) == 0  # and then it is done


def _wanted_kv_files(out: Path) -> set[str]:
    """The KV files the index at `out` reads: every chunk's KV and its plain copy's key."""
    from ragkv.retriever.chunk_keys import chunk_key
    from ragkv.retriever.manifest import read_manifest

    m = read_manifest(out)
    chunks = index_chunks(out)
    keys = {c.kv_key for c in chunks} | {chunk_key(m.model_fp, m.tokenizer_fp, m.prefix_ids, c.token_ids) for c in chunks}
    return {f"{k.to_str()}.safetensors" for k in keys}


@pytest.mark.parametrize("neighbours", ["plain", "default"])
def test_a_reindex_removes_the_kv_of_deleted_and_changed_documents(job_config, tiny_lm, embedder, neighbours):
    """The index's own KV folder holds only what its chunks read: a changed or deleted document's
    KV (neighbour KV and int8 plain copies alike) goes with its chunks; the rest stays untouched."""
    from ragkv.indexer.neighbours import INDEX_DEFAULT

    if neighbours == "default":
        job_config = dataclasses.replace(job_config, neighbours=INDEX_DEFAULT)
    kv_dir = job_config.out / "kv"
    run_index(job_config, lm=tiny_lm, embedder=embedder)
    first = kv_files(kv_dir)
    assert first == _wanted_kv_files(job_config.out)
    written = {p.name: p.stat().st_mtime_ns for p in kv_dir.rglob("*.safetensors")}
    (job_config.corpus / "space.txt").write_text("Venus is the hottest planet. Its clouds are made of sulfuric acid.")
    (job_config.corpus / "animals.txt").unlink()
    run_index(job_config, lm=tiny_lm, embedder=embedder)
    after, wanted = kv_files(kv_dir), _wanted_kv_files(job_config.out)
    assert after == wanted  # every file a chunk reads is there, and nothing else
    assert first - after, "the deleted and changed documents' KV should be gone"
    kept = {p.name: p.stat().st_mtime_ns for p in kv_dir.rglob("*.safetensors") if p.name in first}
    assert kept and all(written[f] == t for f, t in kept.items())  # the others' KV was not written again


def test_a_store_named_by_kv_is_never_swept(job_config, tiny_lm, embedder, tmp_path):
    """A store the user names (`--kv-store`) may be shared with other indexes: a reindex leaves the KV
    of deleted documents there."""
    shared = tmp_path / "shared-kv"
    job_config = dataclasses.replace(job_config, kv_uris=(f"disk:{shared}",))
    run_index(job_config, lm=tiny_lm, embedder=embedder)
    first = kv_files(shared)
    (job_config.corpus / "animals.txt").unlink()
    run_index(job_config, lm=tiny_lm, embedder=embedder)
    assert first <= kv_files(shared)


def test_shards_sharing_their_kv_folder_never_sweep_each_other(job_config, tiny_lm, embedder):
    """Shards of one --out write one KV folder (`<out>/kv`): a shard's rerun leaves the other's KV."""
    from ragkv.retriever.manifest import ShardSpec

    s1 = dataclasses.replace(job_config, shard=ShardSpec(1, 2))
    run_index(s1, lm=tiny_lm, embedder=embedder)
    theirs = kv_files(job_config.out / "kv")
    assert theirs
    run_index(dataclasses.replace(job_config, shard=ShardSpec(0, 2)), lm=tiny_lm, embedder=embedder)
    assert theirs <= kv_files(job_config.out / "kv")
