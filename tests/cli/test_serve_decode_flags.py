"""`ragkv serve --decode-pool auto|on|off --cuda-graphs auto|off`: parsed into the engine's decode
settings; a bad value is refused naming the setting."""

from __future__ import annotations

import pytest

from ragkv.cli.main import build_parser
from ragkv.cli.serve import settings_from_args


def _settings(*flags: str):
    return settings_from_args(build_parser().parse_args(["serve", "--index", "docs=./idx", *flags]), env={})


def test_decode_flags_reach_the_engines_decode_settings() -> None:
    default = _settings().decode()
    assert (default.pool, default.cuda_graphs) == ("auto", "auto")
    chosen = _settings("--decode-pool", "on", "--cuda-graphs", "off", "--kv-budget-bytes", str(1 << 30),
                       "--kv-tree-bytes", str(256 << 20)).decode()
    assert (chosen.pool, chosen.cuda_graphs, chosen.pool_bytes) == ("on", "off", 1 << 30)  # the tree's share within


@pytest.mark.parametrize(("flag", "value", "named"), [("--decode-pool", "yes", "decode pool"),
                                                      ("--cuda-graphs", "on", "cuda graphs")])
def test_a_bad_decode_setting_is_refused_by_name(flag: str, value: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _settings(flag, value)
