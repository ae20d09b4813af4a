"""A damaged copy leaves its tier before anyone waiting on it hears, and never takes a newer file with it.

These two orderings keep a chunk that was recomputed after a failed read on disk: the
waiter writes the fresh KV back only after the bad file is gone, and a late quarantine
(another reader's, of the same bad file) leaves the rewritten file alone.
"""

from __future__ import annotations

import pytest

from ragkv.errors import KVFormatError
from ragkv.kvstore import Tier
from ragkv.kvstore.fileformat import encode
from ragkv.kvstore.layered import read_layered
from ragkv.kvstore.tiers.disk import FileSource
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, make_entry
from tests.kvstore.test_layered import BIG, _Source


def test_on_fail_runs_before_the_gate_reports_the_failure() -> None:
    e = make_entry(3, shape=BIG)
    data = bytearray(encode(e))
    data[-10] ^= 0xFF  # the last block: the failure comes after layers were handed out
    jobs = []
    gate_seen_by_on_fail = []
    holder = {}

    def on_fail(err: BaseException) -> None:
        gate_seen_by_on_fail.append(holder["gate"].error)

    _, gate = read_layered(_Source(bytes(data)), expected_key=e.key, model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP,
                           spawn=jobs.append, on_done=lambda *_: None, on_fail=on_fail)
    holder["gate"] = gate
    jobs[0]()  # the background read, run here
    assert gate_seen_by_on_fail == [None], "the gate said 'failed' before the tier had taken the copy out"
    with pytest.raises(KVFormatError):
        gate.wait_all(timeout=1)


def test_quarantine_of_a_stale_read_keeps_the_file_written_since(make_tier) -> None:
    disk = make_tier(Tier.DISK)
    e = make_entry(4)
    disk.put(e)
    path = disk.path(e.key)
    stale = FileSource(path)  # a reader opened the (say, damaged) file
    try:
        path.unlink()  # ...meanwhile it was quarantined by another reader and rewritten
        disk.put(e)
        fresh = path.read_bytes()
        disk._discard(e.key, "test: the stale reader found a bad block", stale)
        assert path.exists() and path.read_bytes() == fresh, "quarantine took the rewritten file"
        assert disk.contains(e.key)
        same = FileSource(path)
        try:
            disk._discard(e.key, "test: this very file is bad", same)
        finally:
            same.close()
        assert not path.exists(), "a bad file that is still the one on disk must be quarantined"
    finally:
        stale.close()
