"""The host-threads bench: its command lines as the docs cite them parse, and bad input is refused
before any arm runs (the arms themselves: tests/engine/test_host_threads.py checks the threads)."""

from __future__ import annotations

import pytest

from tests.bench.cited import cited_args


def test_every_host_threads_bench_command_in_the_docs_parses() -> None:
    from bench.host_threads_bench import build_parser

    for args in cited_args("host_threads_bench.py"):
        build_parser().parse_args(args)


def test_no_timed_round_is_refused_before_any_arm_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.host_threads_bench as b

    monkeypatch.setattr(b, "_arm", lambda *a: pytest.fail("an arm ran"))
    with pytest.raises(SystemExit, match="--repeats must be >= 1, got 0"):
        b.main(["--repeats", "0"])
