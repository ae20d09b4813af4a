"""The cluster bench's own arithmetic: the placement bounds it prints beside each policy."""

from __future__ import annotations

import pytest

from ragkv.cli.cluster_bench import TOPIC_MODULES, _build_index, lru_hit_rate
from ragkv.evals.synthetic import module_paragraphs


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
