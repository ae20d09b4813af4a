"""Calibrated fidelity at serve time (issue 73), from outside: over HTTP and gRPC on the tiny Llama.

- a collection whose index was calibrated serves, to a request that sets no ratio, the cheapest
  ratio whose predicted KL meets --fidelity-kl, and the answer says which ratio and what KL;
- an explicit --default-recompute-ratio wins; an index without a calibration serves the default;
- a request's own target maps to a ratio, and one no ratio meets runs full prefill and says so;
- a target with a ratio, outside (0, inf), on an uncalibrated collection, or in a mode without
  a ratio is INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import openai
import pytest

from ragkv.client import RagClient
from ragkv.retriever.manifest import read_manifest
from ragkv.server.fidelity import DEFAULT_RECOMPUTE_RATIO, served_ratio
from ragkv.server.settings import CollectionSpec
from tests.server.fakes import ServerThread, settings

QUESTION = [{"role": "user", "content": "What is the launch code of project Bluebird?"}]


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> tuple[Path, Path]:
    """(a calibrated index, the same index as one built before calibration)."""
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig, run_index
    from tests.indexer.helpers import CHUNK_SIZE, OVERLAP, write_corpus

    root = tmp_path_factory.mktemp("fidelity")
    run_index(IndexJobConfig(corpus=write_corpus(root / "corpus"), out=root / "calibrated", model=str(tiny_llama_dir),
                             chunking=ChunkingConfig(CHUNK_SIZE, OVERLAP), progress=False, calibrate=True))
    shutil.copytree(root / "calibrated", root / "old")
    manifest = json.loads((root / "old" / "manifest.json").read_text())
    manifest.pop("calibration")  # as an index written before calibration
    (root / "old" / "manifest.json").write_text(json.dumps(manifest))
    return root / "calibrated", root / "old"


def _server(indexes: tuple[Path, Path], **kw: object) -> ServerThread:
    from ragkv.server.assembly import build_pipeline

    calibrated, old = indexes
    specs = (CollectionSpec("docs", calibrated), CollectionSpec("old", old))
    return ServerThread(settings(indexes=specs, http_port=0, **kw), build_pipeline)


@pytest.fixture(scope="module")
def server(indexes: tuple[Path, Path]):
    st = _server(indexes, fidelity_kl=0.05)
    yield st
    st.stop()


def _ask(st: ServerThread, model: str = "docs", **extra: object):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="none", max_retries=0,
                           timeout=120)
    return client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, extra_body=extra)


def _calibration(indexes: tuple[Path, Path]):
    cal = read_manifest(indexes[0]).calibration
    assert cal is not None, "the fixture's index was built with calibrate=True"
    return cal


def test_a_request_without_a_ratio_gets_the_calibrated_choice_and_is_told(server, indexes) -> None:
    import math

    expected = served_ratio("docs", _calibration(indexes), 0.05, None)
    reg = server.server.metrics.registry  # and /metrics says it per collection
    assert reg.get_sample_value("ragkv_served_recompute_ratio", {"collection": "docs"}) == expected.ratio
    assert reg.get_sample_value("ragkv_served_predicted_kl", {"collection": "docs"}) == pytest.approx(expected.predicted_kl)
    assert reg.get_sample_value("ragkv_served_recompute_ratio", {"collection": "old"}) == DEFAULT_RECOMPUTE_RATIO
    assert math.isnan(reg.get_sample_value("ragkv_served_predicted_kl", {"collection": "old"}))
    extra = _ask(server, mode="blend").model_extra["ragkv"]
    assert extra["recompute_ratio"] == expected.ratio
    assert extra["predicted_kl"] == pytest.approx(expected.predicted_kl)
    assert abs(extra["recompute_fraction"] - expected.ratio) < 0.1
    old = _ask(server, "old", mode="blend").model_extra["ragkv"]  # no calibration: the default, nothing predicted
    assert old["recompute_ratio"] == DEFAULT_RECOMPUTE_RATIO and old["predicted_kl"] is None
    # a ratio the client sets runs as set, with the calibration's KL when it measured that ratio
    chosen = _ask(server, mode="blend", recompute_ratio=0.3).model_extra["ragkv"]
    assert chosen["recompute_ratio"] == 0.3
    assert chosen["predicted_kl"] == pytest.approx(_calibration(indexes).setting(0.3).kl_mean)
    full = _ask(server, mode="full").model_extra["ragkv"]  # full prefill has no ratio
    assert full["recompute_ratio"] is None and full["mode"] == "full"


def test_a_fidelity_target_maps_to_a_ratio_and_one_no_ratio_meets_runs_full_prefill(server, indexes) -> None:
    cal = _calibration(indexes)
    loose = max(s.kl_mean for s in cal.settings) + 1.0
    extra = _ask(server, mode="blend", fidelity_kl=loose).model_extra["ragkv"]
    assert extra["recompute_ratio"] == cal.settings[0].recompute_ratio  # the cheapest
    middle = sorted(s.kl_mean for s in cal.settings)[len(cal.settings) // 2]
    chosen = cal.choose(middle)
    assert chosen is not None
    extra = _ask(server, mode="blend", fidelity_kl=middle).model_extra["ragkv"]
    assert (extra["recompute_ratio"], extra["predicted_kl"]) == (chosen.recompute_ratio, pytest.approx(chosen.kl_mean))
    tight = min(s.kl_mean for s in cal.settings) / 2 or 1e-12
    strict = _ask(server, mode="blend", fidelity_kl=tight).model_extra["ragkv"]
    assert strict["mode"] == "full" and strict["recompute_fraction"] == 1.0
    assert strict["recompute_ratio"] is None and strict["predicted_kl"] == 0.0
    # over gRPC too: the request field, and the stats' ratio and prediction
    with RagClient(f"127.0.0.1:{server.port}") as client:
        stream = client.query("What is the launch code?", collection="docs", mode="blend", fidelity_kl=middle,
                              max_new_tokens=2)
        list(stream)
        stats = stream.result()
    assert (stats.recompute_ratio, stats.predicted_kl) == (chosen.recompute_ratio, pytest.approx(chosen.kl_mean))


@pytest.mark.parametrize(("model", "extra", "names"), [
    ("docs", {"fidelity_kl": 0.01, "recompute_ratio": 0.2}, "not both"),
    ("docs", {"fidelity_kl": 0}, "> 0"),
    ("docs", {"fidelity_kl": -1}, "> 0"),
    ("docs", {"fidelity_kl": 0.01, "mode": "reuse"}, "has none"),
    ("old", {"fidelity_kl": 0.01, "mode": "blend"}, "no calibration"),
])
def test_a_bad_fidelity_target_is_invalid_argument(server, model: str, extra: dict, names: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _ask(server, model, **extra)
    assert "fidelity_kl" in str(err.value) and names in str(err.value)


def test_grpc_refuses_a_target_on_an_uncalibrated_collection_with_invalid_argument(server) -> None:
    with RagClient(f"127.0.0.1:{server.port}") as client:
        stream = client.query("What is the launch code?", collection="old", mode="blend", fidelity_kl=0.01)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "no calibration" in err.value.details()


def test_an_explicit_default_ratio_wins_over_the_calibration(indexes, caplog) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="ragkv.server.assembly")
    st = _server(indexes, default_recompute_ratio=0.2, fidelity_kl=0.05)
    logged = [r.getMessage() for r in caplog.records if "recompute ratio" in r.getMessage()]
    assert any("'docs'" in m and "0.2 (--default-recompute-ratio)" in m for m in logged), logged
    assert any("'old'" in m and "0.2" in m for m in logged), logged
    try:
        extra = _ask(st, mode="blend").model_extra["ragkv"]
        assert extra["recompute_ratio"] == 0.2
        assert extra["predicted_kl"] == pytest.approx(_calibration(indexes).setting(0.2).kl_mean)
    finally:
        st.stop()


def test_start_up_says_which_ratio_each_collection_serves_and_why(indexes) -> None:
    cal = _calibration(indexes)
    chosen = served_ratio("docs", cal, 0.05, None)
    assert "cheapest" in chosen.reason or "no calibrated ratio" in chosen.reason
    assert f"{chosen.ratio:g}" in chosen.reason and "over" in chosen.reason
    assert "no calibration" in served_ratio("old", None, 0.05, None).reason
    assert "--default-recompute-ratio" in served_ratio("docs", cal, 0.05, 0.2).reason
    none_meets = served_ratio("docs", cal, 1e-12, None)
    assert "no calibrated ratio meets" in none_meets.reason
    assert none_meets.ratio == min(cal.settings, key=lambda s: (s.kl_mean, -s.recompute_ratio)).recompute_ratio
