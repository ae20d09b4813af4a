"""`ragkv eval` runs the path `ragkv serve` serves by default (issue 39): one source of
defaults, ServerSettings, read by both."""

from __future__ import annotations

import pytest

from ragkv.cli.eval import _methods, served_defaults
from ragkv.cli.main import build_parser
from ragkv.engine import BlendOptions
from ragkv.server.settings import ServerSettings
from ragkv.types import Mode


def _eval_methods(*flags: str) -> dict:
    args = served_defaults(build_parser().parse_args(["eval", "--synthetic", "niah", "--modes", "blend,focus", *flags]))
    return {m.name: m for m in _methods(args)}


def test_the_evals_default_focus_is_the_servers() -> None:
    served = ServerSettings()
    methods = _eval_methods()
    focus = methods["focus"]
    assert focus.mode is Mode.FOCUS
    assert focus.options.focus == served.focus(), (focus.options.focus, served.focus())
    assert focus.options.recompute_ratio == served.limits().default_recompute_ratio
    assert focus.options == BlendOptions(recompute_ratio=served.limits().default_recompute_ratio, focus=served.focus())
    assert methods["blend"].options.recompute_ratio == served.limits().default_recompute_ratio
    assert served.default_mode is Mode.BLEND  # blend served by default (issue 53); focus a mode asked for


def test_flags_still_override_the_served_defaults() -> None:
    opts = _eval_methods("--ratio", "0.15", "--focus-spread", "0.5", "--focus-keep", "0.4")["focus"].options
    assert (opts.recompute_ratio, opts.focus.spread, opts.focus.keep) == (0.15, 0.5, 0.4)
    assert opts.focus.handover is ServerSettings().focus().handover is True  # not given: the server's
    off = _eval_methods("--focus-handover", "off")["focus"].options.focus
    assert off.handover is False


def test_the_lookup_ratio_is_the_servers_and_compares_in_one_run() -> None:
    assert _eval_methods()["focus"].options.focus.lookup_ratio == ServerSettings().focus_lookup_ratio
    methods = _eval_methods("--focus-lookup-ratio", "1,request,0.1")
    got = {name: m.options.focus.lookup_ratio for name, m in methods.items() if m.mode is Mode.FOCUS}
    assert got == {"focus-lookup1": 1.0, "focus-lookupr": None, "focus-lookup0.1": 0.1}
    with pytest.raises(ValueError, match="focus-lookup-ratio"):
        _eval_methods("--focus-lookup-ratio", "most")


def test_the_lookup_keep_is_the_servers_and_compares_in_one_run() -> None:
    assert _eval_methods()["focus"].options.focus.lookup_keep == ServerSettings().focus_lookup_keep
    methods = _eval_methods("--focus-lookup-keep", "keep,1")
    got = {name: m.options.focus.lookup_keep for name, m in methods.items() if m.mode is Mode.FOCUS}
    assert got == {"focus-lkeepk": None, "focus-lkeep1": 1.0}
    with pytest.raises(ValueError, match="focus-lookup-keep"):
        _eval_methods("--focus-lookup-keep", "best")


def test_the_chunk_count_that_hands_over_is_the_servers_and_compares_in_one_run() -> None:
    assert _eval_methods()["focus"].options.focus.several == ServerSettings().focus_several == 3
    methods = _eval_methods("--focus-several", "3,0")
    got = {name: m.options.focus.several for name, m in methods.items() if m.mode is Mode.FOCUS}
    assert got == {"focus-several3": 3, "focus-several0": 0}
    off = _eval_methods("--focus-handover", "off", "--focus-several", "3,0")  # no handover: one method
    assert [m.options.focus.several for m in off.values() if m.mode is Mode.FOCUS] == [0]
    with pytest.raises(ValueError, match="focus_several"):
        _eval_methods("--focus-several", "1")


def test_the_evals_default_chunk_kv_is_what_ragkv_index_builds() -> None:
    from ragkv.indexer.neighbours import INDEX_DEFAULT

    def parsed(*flags: str):
        return served_defaults(build_parser().parse_args(["eval", "--synthetic", "niah", *flags]))

    args = parsed()
    got = (args.neighbours, args.neighbour_budget, args.neighbour_context)
    assert got == (str(INDEX_DEFAULT.m), INDEX_DEFAULT.budget_tokens, INDEX_DEFAULT.context.value)
    index = build_parser().parse_args(["index", "docs", "--out", "idx"])
    assert (str(index.neighbours), index.neighbour_budget) == (args.neighbours, args.neighbour_budget)
    assert index.neighbour_context == args.neighbour_context
    args = parsed("--neighbours", "0,2", "--neighbour-budget", "64", "--neighbour-context", "tokens")
    assert (args.neighbours, args.neighbour_budget, args.neighbour_context) == ("0,2", 64, "tokens")
