"""ResponseStore with a directory: stored responses survive a restart (a new store over the same
directory), stay their tenant's, expire by age, and a torn or corrupt file costs only itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ragkv.server.response_store import ResponseStore

ITEMS = ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},)
DAY = 86400.0


class Clock:
    """Unix seconds the test sets."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _store(directory: Path, clock: Clock | None = None, **bounds: object) -> ResponseStore:
    return ResponseStore(directory=directory, clock=clock or Clock(), **bounds)  # type: ignore[arg-type]


def _response(response_id: str, text: str = "an answer") -> dict[str, object]:
    return {"id": response_id, "object": "response", "output": [{"type": "message", "text": text}]}


def test_a_new_store_over_the_same_directory_finds_its_tenants_responses(tmp_path: Path) -> None:
    first = _store(tmp_path)
    assert first.put("resp_a", "alice", ITEMS, _response("resp_a"))
    assert first.put("resp_b", "bob\x1fsalt", ITEMS, _response("resp_b", "bob's"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_a.json", "resp_b.json"]

    again = _store(tmp_path)  # the restart
    assert len(again) == 2
    entry = again.get("resp_a", "alice")
    assert entry is not None and entry.items == ITEMS and entry.response == _response("resp_a")
    assert entry.size == first.get("resp_a", "alice").size  # type: ignore[union-attr]
    # another tenant finds nothing, as under an unknown id; the salt is part of the tenant
    assert again.get("resp_a", "bob") is None and again.get("resp_b", "bob") is None
    assert again.get("resp_b", "bob\x1fsalt") is not None
    assert not again.delete("resp_a", "bob") and (tmp_path / "resp_a.json").exists()


def test_delete_removes_the_file_so_a_restart_does_not_find_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("resp_a", "alice", ITEMS, _response("resp_a"))
    store.put("resp_b", "alice", ITEMS, _response("resp_b"))
    assert store.delete("resp_a", "alice") and not store.delete("resp_a", "alice")
    assert not (tmp_path / "resp_a.json").exists()
    again = _store(tmp_path)
    assert again.get("resp_a", "alice") is None and again.get("resp_b", "alice") is not None


def test_responses_past_their_age_are_not_found_and_their_files_go(tmp_path: Path) -> None:
    clock = Clock()
    store = _store(tmp_path, clock, max_age_s=7 * DAY)
    store.put("resp_old", "alice", ITEMS, _response("resp_old"))
    clock.now += 5 * DAY
    store.put("resp_new", "alice", ITEMS, _response("resp_new"))
    clock.now += 3 * DAY  # resp_old is 8 days old, resp_new 3
    assert store.get("resp_old", "alice") is None and store.get("resp_new", "alice") is not None
    assert not (tmp_path / "resp_old.json").exists() and len(store) == 1
    # using a response does not make it younger: its age counts from when it was stored
    clock.now += 4.5 * DAY
    assert store.get("resp_new", "alice") is None and not list(tmp_path.glob("*.json"))


def test_a_restart_drops_what_expired_while_it_was_down(tmp_path: Path) -> None:
    clock = Clock()
    store = _store(tmp_path, clock, max_age_s=DAY)
    store.put("resp_a", "alice", ITEMS, _response("resp_a"))
    clock.now += 0.5 * DAY
    store.put("resp_b", "alice", ITEMS, _response("resp_b"))
    clock.now += 0.75 * DAY
    again = _store(tmp_path, clock, max_age_s=DAY)
    assert again.get("resp_a", "alice") is None and again.get("resp_b", "alice") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_b.json"]


def test_count_and_byte_bounds_hold_across_a_restart_and_delete_the_files_they_drop(tmp_path: Path) -> None:
    clock = Clock()
    store = _store(tmp_path, clock, max_entries=3)
    for i in range(5):
        clock.now += 1
        store.put(f"resp_{i}", "alice", ITEMS, _response(f"resp_{i}"))
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["resp_2", "resp_3", "resp_4"]
    smaller = _store(tmp_path, clock, max_entries=2)  # restarted with a smaller bound: the oldest go
    assert len(smaller) == 2 and smaller.get("resp_2", "alice") is None
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["resp_3", "resp_4"]
    size = smaller.get("resp_3", "alice").size  # type: ignore[union-attr]
    by_bytes = _store(tmp_path, clock, max_bytes=size + 1)
    assert len(by_bytes) == 1 and by_bytes.get("resp_4", "alice") is not None


def test_a_corrupt_or_foreign_file_is_skipped_with_a_warning_not_a_failed_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _store(tmp_path)
    store.put("resp_good", "alice", ITEMS, _response("resp_good"))
    good = json.loads((tmp_path / "resp_good.json").read_text())
    (tmp_path / "resp_torn.json").write_text('{"format": 1, "id": "resp_torn", "ten')
    (tmp_path / "resp_binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "resp_list.json").write_text("[1, 2]")
    (tmp_path / "resp_renamed.json").write_text(json.dumps(good))  # holds resp_good's id
    (tmp_path / "resp_typed.json").write_text(json.dumps({**good, "id": "resp_typed", "items": "not a list"}))
    (tmp_path / "notes.txt").write_text("an operator's note: not ours, left alone")
    with caplog.at_level(logging.WARNING, logger="ragkv.server.response_store"):
        again = _store(tmp_path)
    assert len(again) == 1 and again.get("resp_good", "alice") is not None
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("resp_torn", "resp_binary", "resp_list", "resp_renamed", "resp_typed"):
        assert f"{name}.json skipped" in warned, warned
        assert (tmp_path / f"{name}.json").exists()  # left for whoever wants to look
    assert (tmp_path / "notes.txt").exists()


def test_a_write_cut_short_leaves_only_a_temporary_file_and_the_next_start_removes_it(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    import ragkv.atomic as module  # where the store's writes happen

    store = _store(tmp_path)
    store.put("resp_a", "alice", ITEMS, _response("resp_a"))
    before = (tmp_path / "resp_a.json").read_bytes()

    def crash(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.os, "replace", crash)
    with pytest.raises(OSError, match="No space"):  # over resp_a itself, and a new one
        store.put("resp_a", "alice", ITEMS, _response("resp_a", "a new text"))
    with pytest.raises(OSError):
        store.put("resp_b", "alice", ITEMS, _response("resp_b"))
    monkeypatch.undo()
    assert (tmp_path / "resp_a.json").read_bytes() == before and not (tmp_path / "resp_b.json").exists()
    assert store.get("resp_a", "alice").response == _response("resp_a")  # type: ignore[union-attr]
    assert store.get("resp_b", "alice") is None  # not kept when its file could not be written

    (tmp_path / ".resp_c.json.0123abcd.tmp").write_bytes(b'{"format": 1, "id": "resp_c", "te')  # a crash mid-write
    again = _store(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_a.json"]
    assert again.get("resp_a", "alice") is not None and len(again) == 1


def test_ids_that_cannot_name_a_file_are_refused_and_never_looked_up_on_disk(tmp_path: Path) -> None:
    store = _store(tmp_path / "responses")  # created when missing
    with pytest.raises(ValueError, match="cannot name a file"):
        store.put("../escape", "alice", ITEMS, _response("x"))
    assert store.get("../escape", "alice") is None and not store.delete("../../etc/passwd", "alice")
    assert not (tmp_path / "escape.json").exists()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        _store(not_a_dir)


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_age_s"):
        ResponseStore(max_age_s=0)
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)


def test_the_directory_is_the_servers_only_and_a_wider_one_is_tightened(tmp_path: Path) -> None:
    import stat

    folder = tmp_path / "responses"
    folder.mkdir()
    folder.chmod(0o755)
    store = _store(folder)
    assert store.put("resp_a", "alice", ITEMS, _response("resp_a"))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "resp_a.json").stat().st_mode) == 0o600
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(ValueError, match="--responses-dir .* is not a directory"):
        _store(not_a_folder)


def test_one_keys_flood_drops_its_own_responses_not_every_keys() -> None:
    """Issue 71: the store's LRU was global, so one key's store=true flood dropped every tenant's
    responses. Past its share (while others hold some) a key makes room from its own; salts of
    one key count as that key."""
    store = ResponseStore(max_entries=10, clock=Clock(), key_share=0.5)
    for i in range(3):
        assert store.put(f"resp_bob_{i}", "bob", ITEMS, _response(f"resp_bob_{i}"))
    for i in range(30):  # alice, a new salt each time
        assert store.put(f"resp_alice_{i}", f"alice\x1fsalt-{i}", ITEMS, _response(f"resp_alice_{i}"))
    assert len(store) == 10
    assert all(store.get(f"resp_bob_{i}", "bob") is not None for i in range(3))
    assert store.get("resp_alice_29", "alice\x1fsalt-29") is not None  # her newest is kept
    # a key alone in the store may fill it
    solo = ResponseStore(max_entries=4, clock=Clock(), key_share=0.5)
    for i in range(6):
        solo.put(f"resp_{i}", "alice", ITEMS, _response(f"resp_{i}"))
    assert len(solo) == 4
    with pytest.raises(ValueError, match="key_share"):
        ResponseStore(key_share=0)
