"""A restarted server finds its agents' conversations on disk (`--kv-tree-dir`): the next call
of a tool loop reads most of its prompt from the spilled tree and answers as a server
without the tree does (tiny random Llama, gRPC)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.client import RagClient
from ragkv.server.settings import CollectionSpec
from tests.server.fakes import ServerThread, build_index, settings
from tests.server.test_kv_tree import CORPUS, QUESTION, _loop_turns


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return build_index(tmp_path_factory.mktemp("restart-index"), CORPUS, tiny_llama_dir)


def _serve(index: Path, **overrides: object) -> ServerThread:
    from ragkv.server.assembly import build_pipeline

    return ServerThread(settings(indexes=(CollectionSpec("docs", index),), **overrides), build_pipeline)


def _call(server: ServerThread, step: int) -> tuple[str, int, int]:
    with RagClient(server.addr) as client:
        stream = client.query(QUESTION, collection="docs", mode="blend", top_k=3, max_new_tokens=6,
                              recompute_ratio=0.2, agent_turns=_loop_turns(step))
        text = "".join(stream)
        usage = stream.result().usage
    return text, usage.prompt_tokens, usage.tree_prompt_tokens


def test_the_next_call_after_a_restart_reads_its_prompt_from_the_spilled_tree(index: Path, tmp_path: Path) -> None:
    tree = dict(kv_tree_bytes=64 << 20, kv_tree_dir=tmp_path / "tree", kv_tree_disk_bytes=64 << 20)
    first = _serve(index, **tree)
    try:
        for step in range(5):
            _, held, _ = _call(first, step)  # the last one's prompt: what the tree holds of the conversation
    finally:
        first.stop()  # drains: the tree is written to --kv-tree-dir
    assert list((tmp_path / "tree").rglob("*.kv")), "the stop wrote no conversation to disk"

    again, plain = _serve(index, **tree), _serve(index)
    try:
        text, prompt, from_tree = _call(again, 5)
        want, want_prompt, none = _call(plain, 5)
        restored = again.server.service.backend.parts().kv_tree.stats()
    finally:
        again.stop()
        plain.stop()
    assert (text, prompt, none) == (want, want_prompt, 0), "the spilled tree changed the answer"
    assert restored.restored > 0 and restored.spilled_hit_tokens > 0
    # as a server never restarted: every earlier call's prompt but its tail (tests/server/test_kv_tree.py)
    assert from_tree >= held - 16, (from_tree, held)
    assert from_tree >= 0.8 * prompt, f"{from_tree} of {prompt} prompt tokens from the spilled tree"


def test_without_a_tree_dir_a_restart_starts_empty(index: Path) -> None:
    first = _serve(index, kv_tree_bytes=64 << 20)
    try:
        _call(first, 0)
    finally:
        first.stop()
    again = _serve(index, kv_tree_bytes=64 << 20)
    try:
        _, _, from_tree = _call(again, 1)
    finally:
        again.stop()
    assert from_tree == 0
