"""Calibration (issue 73): `ragkv index` measures blend against full prefill on its own corpus.

- questions made from the chunks ("Who or what is NAME?" of a name or number of the chunk; the
  first method's sentence with its key words blanked) and chunk sets made from the index's
  embeddings are fixed by their seed;
- the measured prompt is the one full prefill runs: at ratio 1.0 blend is full prefill, KL 0;
- the manifest keeps the calibration (and reads one without it), a rerun that changed nothing
  keeps it (one made by an older method is measured again), and a second build of the same
  corpus measures the same KLs;
- a corpus that changes keeps it until the chunks whose KV changed since reach
  `--recalibrate-after` of those it was measured on, the changes adding up across runs;
- a model whose chunks interact more gets a higher ratio for the same target: a one-layer
  model's KV depends on no other token, so blend is exact at any ratio, and four layers are not.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from ragkv.indexer.calibrate import (
    BLANK,
    CHUNKS_PER_SET,
    METHOD,
    RATIOS,
    REDRAWS,
    chunk_sets,
    cloze,
    entity_question,
    key_terms,
    sample_prompts,
    sample_size,
)
from ragkv.indexer.job import run_index
from ragkv.retriever.manifest import Calibration, Manifest, read_manifest


def test_cloze_blanks_a_name_or_a_number_and_is_fixed_by_its_seed() -> None:
    text = ("Mars is the fourth planet from the Sun and it is red. The probe landed on Mars in 1976 after "
            "a long trip. Short one.")
    q = cloze(text, random.Random(0))
    assert q is not None and BLANK in q
    masked = q.split('"')[1]
    assert "1976" not in masked or "Sun" not in masked  # a key word is gone
    assert masked.count(BLANK) == 1 and len(masked.split()) >= 8
    assert cloze(text, random.Random(0)) == q  # the same seed, the same question
    assert cloze("Too short. Also short.", random.Random(0)) is None
    plain = cloze("the cat sat on the warm mat all day long today", random.Random(0))
    assert plain is not None and plain.endswith(f'long {BLANK}"')  # no key word: the last one


def test_the_entity_question_asks_of_a_name_or_number_of_the_chunk_fixed_by_its_seed() -> None:
    text = ("Mars is the fourth planet from the Sun. The probe landed on Mars in 1976, after Viking One "
            "left orbit. It cost 1,696 dollars. He said so.")
    # runs of capitalized words and numbers, not a sentence's first word, cut at punctuation; short ones out
    assert key_terms(text) == ["Mars", "1976", "Viking One", "1,696"]
    q = entity_question(text, random.Random(0))
    assert q is not None and q.startswith("Who or what is ") and q.endswith("? Answer in at most five words.")
    assert q[len("Who or what is "):q.index("?")] in key_terms(text)
    assert entity_question(text, random.Random(0)) == q  # the same seed, the same question
    asked = {entity_question(text, random.Random(s)) for s in range(20)}
    assert len(asked) > 1  # the seed chooses among the terms
    assert entity_question("the cat sat on the warm mat. it was all day long.", random.Random(0)) is None
    # the sample skips a set whose seed chunk holds no term, and the method chooses the question
    xb = np.eye(6, dtype=np.float32) + 0.1
    texts = [text] * 3 + ["no names here at all."] * 3
    by_entity = sample_prompts(xb, 6, texts.__getitem__, "entity")
    assert by_entity and all(q.startswith("Who or what is ") and kind == "entity" for _, q, kind in by_entity)
    assert len(by_entity) < 6  # the seeds without a term gave no set
    assert all(q.startswith("Fill in the blank") for _, q, _ in sample_prompts(xb, 6, texts.__getitem__, "cloze"))
    # the index's method: the two kinds take the sets in turn
    both = sample_prompts(xb, 6, lambda row: text)
    assert METHOD == "entity+cloze" and [kind for _, _, kind in both] == ["entity", "cloze"] * 3
    with pytest.raises(ValueError, match="unknown calibration question kind 'riddle'"):
        sample_prompts(xb, 6, texts.__getitem__, "entity+riddle")


def test_a_seed_that_gives_no_question_gives_way_to_another_and_the_kinds_keep_their_shares() -> None:
    """A set whose seed chunk has no name or number is drawn again from the other chunks, asked the same
    kind; the sets whose seeds gave a question stay as they were drawn; the redraws are bounded."""
    rng = np.random.default_rng(7)
    xb = rng.normal(size=(40, 8)).astype(np.float32)
    named = "The probe landed on Mars in 1976, after Viking One left orbit. It cost 1,696 dollars in all."
    plain = "the cat sat on the warm mat. it was there for the whole of a long and quiet day."
    first = chunk_sets(xb, 6)
    nameless = {first[0][0], first[2][0]}  # two entity seeds (the kinds alternate: entity, cloze, ...)
    texts = [plain if row in nameless else named for row in range(40)]
    got = sample_prompts(xb, 6, texts.__getitem__)
    assert len(got) == 6 and [kind for _, _, kind in got] == ["entity", "cloze"] * 3
    assert all(q.startswith("Who or what is ") for _, q, kind in got if kind == "entity")
    kept = [rows for (_, rows), (rows2, _, _) in zip(first, got) if rows == rows2]
    assert len(kept) == 4 and got[0][0] != first[0][1] and got[2][0] != first[2][1]  # only the two redrawn
    assert sample_prompts(xb, 6, texts.__getitem__) == got  # fixed by the seed
    # a corpus with no name or number anywhere: the entity sets are left out, after a bounded search
    asked: list[int] = []

    def text_of(row: int) -> str:
        asked.append(row)
        return plain

    only_cloze = sample_prompts(xb, 6, text_of)
    assert [kind for _, _, kind in only_cloze] == ["cloze"] * 3
    assert len(asked) <= 6 + REDRAWS * 6


def test_each_setting_is_predicted_by_the_kind_of_question_blend_serves_worse(calibrated) -> None:
    """Two kinds of question, one set each: a setting's KL is the worse kind's mean, not the mean of both."""
    from ragkv.engine import Engine
    from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT
    from ragkv.indexer.calibrate import CalibrationSet, measure

    engine = Engine(calibrated[1], system_prompt=DEFAULT_SYSTEM_PROMPT)
    p = engine.prompt
    texts = ["Mars has two small moons named Phobos and Deimos.", "Jupiter is the largest planet of all.",
             "The launch code of project Bluebird is 4721."]
    ids = [p.chunk_ids(t) for t in texts]
    kvs = tuple(engine.prefill(p.prefix_ids(), x) for x in ids)
    chunk_ids = tuple(tuple(x) for x in ids)
    a = CalibrationSet(chunk_ids, kvs, "What is the launch code of project Bluebird?", "cloze")
    b = CalibrationSet(chunk_ids, kvs, "Who or what is Phobos? Answer in at most five words.", "entity")
    ka, kb = (measure(engine, [one], ratios=(0.05,)).setting(0.05).kl_mean for one in (a, b))
    assert ka != kb
    both = measure(engine, [a, b], ratios=(0.05,), method="entity+cloze")
    assert both.setting(0.05).kl_mean == max(ka, kb) and both.setting(0.05).kl_max == max(ka, kb)
    assert both.sets == 2 and both.method == "entity+cloze"
    # one kind: every set counts, as before
    same = measure(engine, [a, dataclasses.replace(b, kind="cloze")], ratios=(0.05,))
    assert abs(same.setting(0.05).kl_mean - (ka + kb) / 2) < 1e-12


def test_chunk_sets_are_a_seed_and_its_nearest_chunks_fixed_by_the_seed() -> None:
    rng = np.random.default_rng(1)
    xb = rng.normal(size=(40, 8)).astype(np.float32)
    sets = chunk_sets(xb, 6, k=4, seed=3)
    assert len(sets) == 6 and len({s for s, _ in sets}) == 6
    norm = xb / np.linalg.norm(xb, axis=1, keepdims=True)
    for seed, rows in sets:
        assert len(rows) == 4 and len(set(rows)) == 4 and seed in rows
        nearest = set(np.argsort(-(norm @ norm[seed]))[:4].tolist())
        assert set(rows) == nearest
    assert chunk_sets(xb, 6, k=4, seed=3) == sets
    assert chunk_sets(xb, 6, k=4, seed=4) != sets
    assert chunk_sets(xb[:3], 6, k=4) == []  # fewer chunks than a set
    assert sample_size(10) >= 4 and sample_size(10**6) <= 32


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path):
    from ragkv.engine import load_model
    from ragkv.indexer.chunking import ChunkingConfig
    from ragkv.indexer.job import IndexJobConfig
    from ragkv.retriever.embedder import Embedder
    from tests.indexer.helpers import CHUNK_SIZE, OVERLAP, write_corpus

    root = tmp_path_factory.mktemp("calibrated")
    lm = load_model(str(tiny_llama_dir), device="cpu", dtype="float32")
    embedder = Embedder.load()

    def build(name: str, model: Path = tiny_llama_dir, lm=lm):
        config = IndexJobConfig(corpus=write_corpus(root / f"corpus-{name}"), out=root / name, model=str(model),
                                chunking=ChunkingConfig(CHUNK_SIZE, OVERLAP), progress=False, kv_batch=2,
                                calibrate=True)
        return config, run_index(config, lm=lm, embedder=embedder)

    return build, lm, embedder


def test_the_index_records_its_calibration_and_a_rebuild_measures_the_same(calibrated) -> None:
    build, _, _ = calibrated
    config, summary = build("a")
    cal = read_manifest(config.out).calibration
    assert summary.calibration == cal and any(line.startswith("calibration (") for line in summary.lines())
    assert cal is not None and cal.method == METHOD and cal.sets >= 1 and cal.chunks_per_set == CHUNKS_PER_SET
    assert [s.recompute_ratio for s in cal.settings] == sorted(RATIOS)
    assert all(s.kl_mean >= 0 and s.kl_max >= s.kl_mean and s.kl_stderr >= 0 for s in cal.settings)
    assert all(0 <= s.top_token_agreement <= 1 and s.seconds_median > 0 for s in cal.settings)
    assert cal.settings[0].kl_mean > 0  # four random layers: blend at 0.05 is not full prefill
    # the manifest round-trips it
    m = read_manifest(config.out)
    assert Manifest.from_json(m.to_json()) == m
    # a rerun that changes nothing keeps it as it was (not measured again)
    run_index(config, lm=calibrated[1], embedder=calibrated[2])
    assert read_manifest(config.out).calibration == cal
    # one an older method made is measured again by this one
    d = json.loads((config.out / "manifest.json").read_text())
    d["calibration"]["method"] = "cloze"
    (config.out / "manifest.json").write_text(json.dumps(d))
    assert read_manifest(config.out).calibration.method == "cloze"
    run_index(config, lm=calibrated[1], embedder=calibrated[2])
    again = read_manifest(config.out).calibration
    assert again is not None and again.method == METHOD and again.full_seconds_median != cal.full_seconds_median
    assert [s.kl_mean for s in again.settings] == [s.kl_mean for s in cal.settings]
    # another build of the same corpus: the same sets and questions, so the same KLs and choice
    other, _ = build("b")
    again = read_manifest(other.out).calibration
    assert again is not None
    assert [(s.recompute_ratio, s.kl_mean, s.kl_max) for s in again.settings] == \
        [(s.recompute_ratio, s.kl_mean, s.kl_max) for s in cal.settings]


def test_calibration_sets_asks_its_sample_size_and_another_size_is_measured_again(calibrated) -> None:
    """`ragkv index --calibration-sets N`: the manifest records N sets, the summary says the share of the
    run calibration took, a rerun asking the same keeps it, and the option is checked."""
    from dataclasses import replace

    from ragkv.indexer.job import IndexJobConfig

    build, lm, embedder = calibrated
    config, first = build("sets")
    assert first.calibration is not None and first.calibration.sets != 2
    two = replace(config, calibration_sets=2)
    summary = run_index(two, lm=lm, embedder=embedder)
    cal = read_manifest(config.out).calibration
    assert cal is not None and cal.sets == 2 and summary.calibration == cal
    line = next(x for x in summary.lines() if x.startswith("calibration ("))
    assert "2 chunk sets of 4" in line and "% of this run)" in line
    run_index(two, lm=lm, embedder=embedder)  # the same size asked again: kept
    assert read_manifest(config.out).calibration == cal
    with pytest.raises(ValueError, match="calibration_sets must be >= 1"):
        IndexJobConfig(corpus=config.corpus, out=config.out, calibration_sets=0)


def test_a_manifest_from_before_calibration_reads_as_uncalibrated(calibrated) -> None:
    config, _ = calibrated[0]("old")
    d = json.loads((config.out / "manifest.json").read_text())
    d.pop("calibration")
    m = Manifest.from_json(json.dumps(d))
    assert m.calibration is None
    assert Calibration.from_dict(None) is None


def test_blend_at_ratio_one_measures_zero_kl_against_the_same_full_prompt(calibrated) -> None:
    """The calibration compares blend with full prefill of the same prompt: at ratio 1.0 they are equal."""
    from ragkv.engine import Engine
    from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT
    from ragkv.indexer.calibrate import CalibrationSet, measure

    lm = calibrated[1]
    engine = Engine(lm, system_prompt=DEFAULT_SYSTEM_PROMPT)
    p = engine.prompt
    texts = ["Mars has two small moons named Phobos and Deimos.", "Jupiter is the largest planet of all.",
             "The launch code of project Bluebird is 4721."]
    ids = [p.chunk_ids(t) for t in texts]
    kvs = tuple(engine.prefill(p.prefix_ids(), x) for x in ids)
    one = CalibrationSet(tuple(tuple(x) for x in ids), kvs, "What is the launch code of project Bluebird?")
    cal = measure(engine, [one, one], ratios=(0.05, 1.0))
    assert cal.setting(1.0).kl_mean < 1e-6 and cal.setting(1.0).top_token_agreement == 1.0
    assert cal.setting(0.05).kl_mean > 1e-4  # and a small ratio is not


def test_a_model_whose_chunks_interact_more_is_served_a_higher_ratio(calibrated, tmp_path: Path) -> None:
    from ragkv.engine import load_model
    from ragkv.evals.testing import tiny_model_dir
    from ragkv.server.fidelity import served_ratio

    build = calibrated[0]
    one_layer = tiny_model_dir(tmp_path / "one-layer", num_layers=1)
    config, _ = build("one-layer", one_layer, load_model(str(one_layer), device="cpu", dtype="float32"))
    exact = read_manifest(config.out).calibration
    deep = read_manifest(build("four-layers")[0].out).calibration
    assert exact is not None and deep is not None
    assert max(s.kl_mean for s in exact.settings) < 1e-6  # layer 0's KV depends on its token alone
    target = (deep.settings[0].kl_mean + min(s.kl_mean for s in deep.settings)) / 2  # between its ends
    low = served_ratio("a", exact, target, None)
    high = served_ratio("b", deep, target, None)
    assert low.ratio == min(RATIOS)
    assert high.ratio > low.ratio, (high, deep)
    # and without the calibration's say the two would be served alike
    assert served_ratio("a", None, target, None).ratio == served_ratio("b", None, target, None).ratio
    # the choice is the cheapest setting within the target
    chosen = deep.choose(target)
    assert chosen is not None and chosen.kl_mean <= target
    assert all(s.kl_mean > target for s in deep.settings if s.recompute_ratio < chosen.recompute_ratio)
    assert dataclasses.replace(deep, settings=()).choose(target) is None


def test_the_cli_takes_a_positive_number_of_calibration_sets(capsys) -> None:
    from ragkv.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["index", "demo", "--out", "x", "--calibration-sets", "3"]).calibration_sets == 3
    assert parser.parse_args(["index", "demo", "--out", "x"]).calibration_sets is None
    with pytest.raises(SystemExit):
        parser.parse_args(["index", "demo", "--out", "x", "--calibration-sets", "0"])
    assert "--calibration-sets: must be at least 1, got 0" in capsys.readouterr().err


def test_the_cli_takes_a_share_to_recalibrate_after(capsys) -> None:
    from ragkv.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["index", "demo", "--out", "x"]).recalibrate_after == 0.5
    assert parser.parse_args(["index", "demo", "--out", "x", "--recalibrate-after", "0"]).recalibrate_after == 0.0
    for bad, said in (("1.5", "must be a share in [0, 1], got 1.5"), ("half", "not a number: 'half'")):
        with pytest.raises(SystemExit):
            parser.parse_args(["index", "demo", "--out", "x", "--recalibrate-after", bad])
        assert f"--recalibrate-after: {said}" in capsys.readouterr().err


def test_a_calibration_is_kept_until_half_its_chunks_changed_and_the_changes_add_up(calibrated) -> None:
    """A corpus that changes a little keeps its calibration (measuring again would cost more than the
    change's own indexing); the changes add up across runs until they reach --recalibrate-after of the
    chunks it was measured on, and then it is measured again; at 0 any change measures it again."""
    from dataclasses import replace

    from ragkv.indexer.job import IndexJobConfig

    build, lm, embedder = calibrated
    config, first = build("drift")
    cal = first.calibration
    assert cal is not None and first.calibration_seconds > 0 and first.calibration_changed is None
    corpus = config.corpus

    (corpus / "extra-1.txt").write_text("Owls hunt at night. The barn owl nests in old barns.", "utf-8")
    one = run_index(config, lm=lm, embedder=embedder)
    assert one.documents_added == 1 and one.calibration == cal == read_manifest(config.out).calibration
    assert one.calibration_seconds == 0 and one.calibration_changed is not None and 0 < one.calibration_changed < 0.5
    line = next(x for x in one.lines() if x.startswith("calibration ("))
    assert f"kept: {one.calibration_changed:.0%} of its chunks' KV changed" in line and "--recalibrate-after" in line

    (corpus / "space.txt").unlink()  # a deletion counts too, and adds to the change before it
    two = run_index(config, lm=lm, embedder=embedder)
    assert two.documents_deleted == 1 and two.calibration == cal and two.calibration_seconds == 0
    assert two.calibration_changed is not None and two.calibration_changed > one.calibration_changed

    for i in range(2, 16):  # the changes reach half the chunks it was measured on: measured again
        (corpus / f"extra-{i}.txt").write_text(f"Note {i}: the river Tamsin{i} floods every spring near Orlay.", "utf-8")
    three = run_index(config, lm=lm, embedder=embedder)
    assert three.calibration_seconds > 0 and three.calibration_changed is None
    assert three.calibration == read_manifest(config.out).calibration and three.calibration.sets == cal.sets
    same = run_index(config, lm=lm, embedder=embedder)  # nothing changed since it was measured
    assert same.calibration == three.calibration and same.calibration_seconds == 0 and same.calibration_changed == 0
    assert next(x for x in same.lines() if x.startswith("calibration (")).split(": blend")[0].endswith(", kept)")

    eager = replace(config, recalibrate_after=0.0)  # 0: any change measures it again
    (corpus / "extra-1.txt").write_text("Owls hunt at night, and sleep by day.", "utf-8")
    again = run_index(eager, lm=lm, embedder=embedder)
    assert again.documents_added == 1 and again.calibration_seconds > 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"recalibrate_after must be a share of the chunks in \[0, 1\]"):
            IndexJobConfig(corpus=config.corpus, out=config.out, recalibrate_after=bad)


def test_an_index_calibrated_before_its_keys_were_recorded_keeps_it_until_a_change(calibrated) -> None:
    """An index calibrated before the chunks' keys were recorded: a run that changes nothing keeps the
    calibration and records the keys; from then on its changes are counted."""
    import sqlite3

    build, lm, embedder = calibrated
    config, first = build("legacy")
    with sqlite3.connect(config.out / "chunks.sqlite") as conn:
        conn.execute("DELETE FROM calibrated_keys")
    kept = run_index(config, lm=lm, embedder=embedder)
    assert kept.calibration == first.calibration and kept.calibration_seconds == 0 and kept.calibration_changed is None
    with sqlite3.connect(config.out / "chunks.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM calibrated_keys").fetchone()[0] > 0
    (config.out.parent / "corpus-legacy" / "extra.txt").write_text("Owls hunt at night.", "utf-8")
    counted = run_index(config, lm=lm, embedder=embedder)
    assert counted.calibration == first.calibration and counted.calibration_changed and counted.calibration_changed > 0
    with sqlite3.connect(config.out / "chunks.sqlite") as conn:  # with no record, a change measures it again
        conn.execute("DELETE FROM calibrated_keys")
    (config.out.parent / "corpus-legacy" / "extra.txt").write_text("Owls hunt at night, and sleep by day.", "utf-8")
    assert run_index(config, lm=lm, embedder=embedder).calibration_seconds > 0
