"""A refreshed answer (`ragkv eval --refresh K:R`): its first K tokens from the method's blend,
the rest decoded after a second blend at ratio R that has them in its question segment. At
R = 1.0 the rest is full prefill's own continuation of the prompt and those K tokens."""

from __future__ import annotations

import pytest

from ragkv.cli import eval as cli_eval
from ragkv.cli.main import build_parser
from ragkv.engine import BlendOptions, Engine, Prompt, SamplingParams, load_model
from ragkv.evals.evaluate import Method, Refresh, decode_logged, refreshed
from ragkv.types import Mode

CHUNKS = ["The observatory on Mount Kerr was built in 1931 by the astronomer Ada Lind.",
          "Its main telescope has a mirror of 2.4 metres and is still used for surveys.",
          "A cable car to the summit opened in 1978; it carries forty people per cabin."]
QUESTION = "Who built the observatory, and when did the cable car open?"


def test_a_refresh_at_ratio_one_continues_as_full_prefill_of_the_prompt_and_the_first_tokens(tiny_llama_dir) -> None:
    engine = Engine(load_model(str(tiny_llama_dir)))
    p = engine.prompt
    prefix, q = p.prefix_ids(), p.question_ids(QUESTION)
    kvs = [engine.prefill(prefix, p.chunk_ids(c)) for c in CHUNKS]
    low = BlendOptions(recompute_ratio=0.1)

    def first_pass():  # a pass's cache is decoded once (the decode appends to it)
        return engine.run(Prompt.of(prefix, kvs, q), Mode.BLEND, options=low)

    _, plain, _ = decode_logged(engine, first_pass(), SamplingParams(max_new_tokens=8))
    assert len(plain) == 8  # the random model runs on: the refresh has tokens after it
    method = Method("blend", Mode.BLEND, low, Refresh(after=3, ratio=1.0))
    answer, tokens, steps, secs = refreshed(engine, method, first_pass(), prefix, kvs, q, SamplingParams(max_new_tokens=8))
    assert tokens[:3] == plain[:3] and len(tokens) == 8 and secs > 0
    full = engine.run(Prompt([*p.prompt_ids(CHUNKS, QUESTION), *tokens[:3]]), Mode.FULL)
    _, continued, _ = decode_logged(engine, full, SamplingParams(max_new_tokens=5))
    assert tokens[3:] == continued
    assert answer == engine.lm.tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(steps) == len(tokens)  # the logits before each token (it ran to max_new_tokens, no EOS)
    # an answer no longer than the refresh point is the first pass's own
    short = refreshed(engine, method, first_pass(), prefix, kvs, q, SamplingParams(max_new_tokens=3))
    assert short[1] == plain[:3] and short[3] == 0.0


@pytest.mark.parametrize("after, ratio", [(0, 0.3), (4, 0.0), (4, 1.5)])
def test_a_refresh_out_of_range_is_refused(after: int, ratio: float) -> None:
    with pytest.raises(ValueError, match="a refresh needs"):
        Refresh(after, ratio)


def test_the_cli_adds_a_refreshed_copy_of_each_blend_method_and_names_a_bad_spec() -> None:
    args = build_parser().parse_args(["eval", "--synthetic", "niah", "--modes", "full,blend", "--ratio", "0.1,0.3",
                                      "--refresh", "8:0.3"])
    cli_eval.served_defaults(args)
    methods = {m.name: m for m in cli_eval._methods(args)}
    assert set(methods) == {"full", "blend-query-0.1", "blend-query-0.3",
                            "blend-query-0.1+refresh8@0.3", "blend-query-0.3+refresh8@0.3"}
    refreshed_low = methods["blend-query-0.1+refresh8@0.3"]
    assert refreshed_low.refresh == Refresh(8, 0.3) and refreshed_low.options == methods["blend-query-0.1"].options
    for bad in ("8", "x:0.3", "8:2"):
        args = build_parser().parse_args(["eval", "--synthetic", "niah", "--modes", "blend", "--refresh", bad])
        cli_eval.served_defaults(args)
        with pytest.raises(ValueError, match="--refresh takes K:R"):
            cli_eval._methods(args)


def test_eval_reports_a_refreshed_blend_beside_the_plain_one(tiny_llama_dir, tmp_path, capsys) -> None:
    """At ratio 1.0 both passes are full prefill: the refreshed answer is full prefill's, and
    its second pass is timed apart from its TTFT."""
    import json

    from ragkv.cli.main import main

    rows = [{"question": f"Who owns vault {i}?", "answers": [f"Owner {i}"],
             "ctxs": [{"title": "", "text": f"Passage {j} of row {i}. Vault {i} is owned by Owner {i}."}
                      for j in range(2)]} for i in range(2)]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(rows))
    rc = main(["eval", "--dataset", str(path), "--n", "2", "--ctxs", "2", "--model", str(tiny_llama_dir),
               "--modes", "full,blend", "--ratio", "1.0", "--refresh", "2:1.0", "--max-new-tokens", "5",
               "--pool-embeddings", str(tmp_path / "pool.npy"), "--json"])
    assert rc == 0
    modes = json.loads(capsys.readouterr().out.strip())["modes"]
    (name,) = [n for n in modes if "refresh2@1" in n]
    assert modes[name]["n"] == 2 and modes[name]["f1_vs_full"] == 1.0 and modes[name]["kl_answer_max"] < 1e-5
    assert modes[name]["refresh_median_s"] > 0
    assert all(m["refresh_median_s"] == 0 for n, m in modes.items() if n != name)
