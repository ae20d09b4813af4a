"""`ragkv demo`: the command lines it runs parse, and what it prints of an answer says what ran."""

from __future__ import annotations

from pathlib import Path

from ragkv.cli.demo import demo_commands, describe_run
from ragkv.cli.main import build_parser
from ragkv.types import FinishReason, Mode, QueryStats, Usage


def test_the_demos_command_lines_are_ones_the_cli_parses(tmp_path: Path) -> None:
    index, serve = demo_commands(tmp_path / "idx", "smollm2-135m-instruct", 50123)
    parser = build_parser()
    a = parser.parse_args(index)
    assert a.command == "index" and a.corpus == "demo" and Path(a.out) == tmp_path / "idx"
    b = parser.parse_args(serve)
    assert b.command == "serve" and b.port == 50123 and b.host == "127.0.0.1"
    # blend is asked at the server's calibrated default: the demo fixes no ratio for the server
    assert not any("ratio" in arg for arg in serve)


def _stats(mode: Mode, ratio: float | None, kl: float | None) -> QueryStats:
    return QueryStats(usage=Usage(prompt_tokens=10, completion_tokens=3, cached_prompt_tokens=8), ttft_seconds=0.25,
                      total_seconds=1.0, phase_seconds={}, recompute_fraction=0.1, mode=mode,
                      finish_reason=FinishReason.STOP, text="x", used_chunk_ids=("a", "b"), recompute_ratio=ratio,
                      predicted_kl=kl)


def test_an_answer_says_the_ratio_it_ran_at_and_the_kl_calibration_predicts() -> None:
    line = describe_run(_stats(Mode.BLEND, 0.1, 0.0123))
    assert "ran blend at ratio 0.1 (calibrated KL to full prefill 0.0123)" in line and "over 2 chunks" in line
    assert "ran full;" in describe_run(_stats(Mode.FULL, None, 0.0))
    assert "calibrated" not in describe_run(_stats(Mode.BLEND, 0.15, None))  # an index without a calibration
