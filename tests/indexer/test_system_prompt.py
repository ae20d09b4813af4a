"""ragkv index --system-prompt TEXT|@FILE: stored in the manifest; another prompt on an existing index is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.cli.index import read_system_prompt
from ragkv.errors import IndexMismatchError
from tests.indexer.helpers import write_corpus


def test_read_system_prompt_text_file_and_errors(tmp_path: Path) -> None:
    assert read_system_prompt(None) is None
    assert read_system_prompt("Be brief.") == "Be brief."
    (tmp_path / "p.txt").write_text("  From a file.\n")
    assert read_system_prompt(f"@{tmp_path / 'p.txt'}") == "From a file."
    with pytest.raises(ValueError, match="cannot read"):
        read_system_prompt(f"@{tmp_path / 'missing.txt'}")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_system_prompt(f"@{tmp_path / 'empty.txt'}")
    with pytest.raises(ValueError, match="empty"):
        read_system_prompt("   ")


def test_system_prompt_in_manifest_and_a_change_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from ragkv.indexer.job import IndexJobConfig, run_index
    from ragkv.retriever.manifest import read_manifest

    corpus = write_corpus(tmp_path / "corpus", {"a.txt": "Cats sleep a lot. Dogs are loyal."}, jsonl=[])
    config = IndexJobConfig(corpus=corpus, out=tmp_path / "index", model=str(tiny_llama_dir), progress=False,
                            precompute_kv=False, system_prompt="Answer in haiku.")
    run_index(config)
    assert read_manifest(tmp_path / "index").system_prompt == "Answer in haiku."
    with pytest.raises(IndexMismatchError) as info:
        run_index(IndexJobConfig(corpus=corpus, out=tmp_path / "index", model=str(tiny_llama_dir), progress=False,
                                 precompute_kv=False, system_prompt="Answer in prose."))
    assert "Answer in haiku." in str(info.value) and "Answer in prose." in str(info.value)
