"""Disk tier: atomic writes, restart, budget across restarts, quarantine, a writer process beside a reader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ragkv.errors import StoreError
from ragkv.kvstore import DiskTier, Policy
from ragkv.kvstore.fileformat import encode
from ragkv.kvstore.tiers import disk as disk_module
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry

REPO = Path(__file__).resolve().parents[2]


def _open(root, budget=None, policy=Policy.LRU):
    return DiskTier(root, MODEL_FP, TOKENIZER_FP, budget, policy)


def test_layout_is_root_model_shard_key(tmp_path):
    t = _open(tmp_path)
    e = make_entry(1)
    t.put(e)
    assert t.path(e.key) == tmp_path / MODEL_FP / e.key.hex[:2] / f"{e.key.hex}.safetensors"
    assert t.path(e.key).is_file()
    assert [p.name for p in t.path(e.key).parent.iterdir()] == [f"{e.key.hex}.safetensors"]


def test_restart_rebuilds_index_and_keeps_recency(tmp_path):
    t = _open(tmp_path)
    entries = [make_entry(i) for i in range(3)]
    t.put_many(entries)
    now = time.time()
    for i, e in enumerate(entries):  # mtimes in put order, a minute apart
        os.utime(t.path(e.key), (now - 300 + 60 * i, now - 300 + 60 * i))
    t2 = _open(tmp_path)
    assert t2.keys_by_eviction_order() == [e.key for e in entries]
    assert t2.get(entries[0].key) is not None  # a hit refreshes recency, on disk too
    t3 = _open(tmp_path)
    assert t3.keys_by_eviction_order() == [entries[1].key, entries[2].key, entries[0].key]
    assert t3.stats().entries == 3 and t3.stats().bytes_used == t.stats().bytes_used
    for e in entries:
        assert_same(t3.get(e.key), e)


def test_budget_holds_across_restarts(tmp_path):
    entries = [make_entry(i) for i in range(6)]
    one = len(encode(entries[0]))
    t = _open(tmp_path, budget=4 * one)
    t.put_many(entries)
    assert t.stats().entries == 4 and t.stats().bytes_used <= 4 * one
    assert t.stats().evictions == 2
    again = _open(tmp_path, budget=4 * one)
    assert again.stats().entries == 4 and again.stats().evictions == 0
    smaller = _open(tmp_path, budget=2 * one)  # enforced at open, oldest first
    assert smaller.stats().entries == 2 and smaller.stats().evictions == 2
    files = list((tmp_path / MODEL_FP).glob("*/*.safetensors"))
    assert sum(f.stat().st_size for f in files) <= 2 * one and len(files) == 2


def test_failed_write_leaves_no_partial_file_and_loses_nothing(tmp_path, monkeypatch):
    t = _open(tmp_path)
    keep, fail = make_entry(1), make_entry(2)
    t.put(keep)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_module.os, "replace", crash)
    with pytest.raises(StoreError, match=fail.key.hex):
        t.put(fail)
    monkeypatch.undo()
    assert not t.path(fail.key).exists() and t.get(fail.key) is None
    assert list(t.path(fail.key).parent.glob(".*.tmp")) == []
    assert_same(t.get(keep.key), keep)
    assert t.stats().errors == 1


def test_temp_files_are_invisible_and_stale_ones_cleaned(tmp_path):
    t = _open(tmp_path)
    e = make_entry(1)
    data = encode(e)
    shard = t.path(e.key).parent
    shard.mkdir(parents=True)
    fresh = shard / f".{e.key.hex}.999.aaaa.tmp"
    stale = shard / f".{e.key.hex}.998.bbbb.tmp"
    fresh.write_bytes(data[: len(data) // 2])  # a writer mid-way
    stale.write_bytes(data[:10])  # a writer that died
    old = time.time() - 2 * disk_module.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    t2 = _open(tmp_path)
    assert t2.get(e.key) is None and not t2.contains(e.key)
    assert t2.stats().entries == 0
    assert fresh.exists() and not stale.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_model"])
def test_damaged_file_is_a_counted_miss_and_quarantined(tmp_path, damage):
    t = _open(tmp_path)
    e = make_entry(1)
    t.put(e)
    path = t.path(e.key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) - 3]
    else:
        data = bytearray(encode(make_entry(1, model_fp="model-b")))
    path.write_bytes(data)
    assert t.get(e.key) is None
    s = t.stats()
    assert (s.rejected, s.misses, s.hits, s.entries) == (1, 1, 0, 0)
    assert not path.exists()
    assert len(list((tmp_path / disk_module.QUARANTINE_DIR).iterdir())) == 1
    t.put(e)  # the slot is free again
    assert_same(t.get(e.key), e)


def test_foreign_names_in_the_tree_are_ignored(tmp_path):
    d = tmp_path / MODEL_FP / "ab"
    d.mkdir(parents=True)
    (d / "notakey.safetensors").write_bytes(b"x")
    (d / ("ab" + "0" * 62 + ".safetensors")).write_bytes(b"x")  # a key name in its shard
    (tmp_path / MODEL_FP / "cd").mkdir()
    (tmp_path / MODEL_FP / "cd" / ("ab" + "1" * 62 + ".safetensors")).write_bytes(b"x")  # wrong shard
    t = _open(tmp_path)
    assert t.stats().entries == 1  # only the well-placed key name is indexed (it fails on read)


def test_unwritable_root_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreError, match="cannot create"):
        _open(blocker / "sub")


_WRITER = textwrap.dedent(
    """
    import sys
    from ragkv.kvstore import DiskTier
    from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, make_entry
    t = DiskTier(sys.argv[1], MODEL_FP, TOKENIZER_FP)
    for i in range(int(sys.argv[2])):
        t.put(make_entry(i, shape=(4, 4, 128, 64)))
    """
)


def test_writer_process_beside_reader_process(tmp_path):
    """An indexer process writes while this (server) process reads: every read is a miss or exact."""
    n = 12
    expected = [make_entry(i, shape=(4, 4, 128, 64)) for i in range(n)]
    reader = _open(tmp_path)  # opened before the writer starts: its index is empty
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(n)], cwd=REPO)
    seen: set[int] = set()
    reads = 0
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        for i, e in enumerate(expected):
            got = reader.get(e.key)
            reads += 1
            if got is not None:
                assert_same(got, e)
                seen.add(i)
        time.sleep(0.005)  # leave the (shared) CPU to the writer
    assert proc.wait(timeout=60) == 0
    assert len(seen) == n
    s = reader.stats()
    assert s.rejected == 0 and s.errors == 0 and s.entries == n
