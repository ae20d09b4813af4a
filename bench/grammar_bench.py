"""Constrained decoding's cost: decode tokens/s with and without a JSON-schema constraint,
in one run, and the grammar libraries side by side.

    python -m bench.grammar_bench                      # SmolLM2, batches of 1 and 4
    python -m bench.grammar_bench --model DIR --batch 1,8 --tokens 64 --json

Engine part: B requests decode together through the scheduler, free and then held to a
JSON schema (the same prompts); tokens/s counts generated tokens over the decode's wall
time, and `mask wait` is how long decode steps waited for a mask that the worker thread
had not finished while the forward ran (engine/constrain.py).

Library part: for the model's tokenizer, the time to wrap it, to compile the schema, and
to compute one step's mask along a fixed JSON document, for llguidance (what ragkv uses)
and xgrammar (`pip install xgrammar` to include it; it is not a ragkv dependency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lind", "age": 31, "city": "Paris", "tags": ["astronomer", "telescope", "mountain"]}
PASSAGES = [
    "The observatory on Mount Kerr was built in 1931 by the astronomer Ada Lind.",
    "Its main telescope has a mirror of 2.4 metres and is still used for surveys.",
]
QUESTIONS = ["Who built the observatory? Describe her as JSON.", "Give the telescope's builder as JSON.",
             "Who is Ada Lind? Answer as JSON.", "Describe the astronomer as JSON."]


def _engine_run(engine: Any, batch: int, tokens: int, constrained: bool) -> dict[str, float]:
    from ragkv.engine import SamplingParams
    from ragkv.engine.constrain import json_schema_grammar
    from ragkv.engine.request import Finished, LoadedKV, PromptChunk, Request, TokenOut
    from ragkv.engine.scheduler import Scheduler
    from ragkv.types import Mode, Tier

    grammar = json_schema_grammar(SCHEMA)
    prefix = engine.prompt.prefix_ids()
    chunks = [engine.prompt.chunk_ids(p) for p in PASSAGES]
    kvs = [engine.prefill(prefix, ids) for ids in chunks]
    requests = [Request(mode=Mode.REUSE, prefix_ids=tuple(prefix), sampling=SamplingParams(max_new_tokens=tokens),
                        chunks=tuple(PromptChunk(tuple(ids), LoadedKV(kv, Tier.CPU, kv.nbytes))
                                     for ids, kv in zip(chunks, kvs)),
                        question_ids=tuple(engine.prompt.question_ids(QUESTIONS[i % len(QUESTIONS)])),
                        constraint=engine.grammars.compile(grammar, closing=True) if constrained else None)
                for i in range(batch)]
    generated = [0] * batch
    first_token: list[float] = []
    ends = [threading.Event() for _ in range(batch)]

    def sink(i: int):
        def take(out: object) -> None:
            if isinstance(out, TokenOut):
                generated[i] += 1
                if generated[i] == 1:
                    first_token.append(time.perf_counter())
            elif isinstance(out, Finished):
                ends[i].set()
        return take

    sched = Scheduler()
    for i, req in enumerate(requests):
        sched.submit(req, engine.work(req), sink(i))
    for d in ends:
        d.wait(600)
    t_end = time.perf_counter()
    sched.close()
    wall = t_end - min(first_token)
    wait = sum(r.constraint.mask_seconds for r in requests if r.constraint is not None)
    steps = sched.stats.steps
    return {"tokens": sum(generated), "seconds": wall, "tokens_per_s": sum(generated) / wall, "mask_wait_s": wait,
            "steps": steps, "step_ms": 1e3 * wall / max(1, steps)}


def _library_run(tokenizer: Any, vocab: int) -> dict[str, dict[str, float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    text = json.dumps(DOCUMENT, separators=(",", ":"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    compile_s = []
    for _ in range(3):
        t = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar)
        compile_s.append(time.perf_counter() - t)
    mask = llt.allocate_token_bitmask(1, vocab)
    steps = []
    for token in ids:
        t = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        steps.append(time.perf_counter() - t)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
    out["llguidance"] = {"tokenizer_s": t1 - t0, "compile_first_s": compile_s[0], "compile_warm_s": compile_s[-1],
                         "mask_p50_ms": 1e3 * statistics.median(steps), "mask_max_ms": 1e3 * max(steps)}
    try:
        import xgrammar as xgr
    except ImportError:
        return out
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compile_s = []
    for _ in range(3):
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        compile_s.append(time.perf_counter() - t)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    steps = []
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        steps.append(time.perf_counter() - t)
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")
    out["xgrammar"] = {"tokenizer_s": t1 - t0, "compile_first_s": compile_s[0], "compile_warm_s": compile_s[-1],
                       "mask_p50_ms": 1e3 * statistics.median(steps), "mask_max_ms": 1e3 * max(steps)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model spec or HF directory")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes (requests decoding together)")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per request")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = ap.parse_args(argv)

    from ragkv.engine import Engine, load_model, tune_host_allocator
    from ragkv.engine.constrain import json_schema_grammar

    tune_host_allocator()
    lm = load_model(args.model)
    engine = Engine(lm)
    engine.grammars.compile(json_schema_grammar(SCHEMA))  # warm: the tokenizer wrap is paid once, at start
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "engine": {}, "ratios": {}}
    for b in (int(x) for x in args.batch.split(",")):
        _engine_run(engine, b, args.tokens, False)  # warm-up
        free = _engine_run(engine, b, args.tokens, False)
        held = _engine_run(engine, b, args.tokens, True)
        result["engine"][str(b)] = {"free": free, "json_schema": held}
        result["ratios"][f"batch {b}: tokens/s json_schema/free"] = held["tokens_per_s"] / free["tokens_per_s"]
        result["ratios"][f"batch {b}: ms per decode step json_schema/free"] = held["step_ms"] / free["step_ms"]
    result["libraries"] = _library_run(lm.tokenizer, engine.grammars.vocab_size)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for b, runs in result["engine"].items():
        for name, r in runs.items():
            print(f"batch {b:>2} {name:>11}: {r['tokens']:4d} tokens in {r['seconds']:.2f} s = "
                  f"{r['tokens_per_s']:.1f} tokens/s, {r['steps']} steps of {r['step_ms']:.1f} ms, "
                  f"mask wait {1e3 * r['mask_wait_s']:.1f} ms")
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.3f}")
    for lib, r in result["libraries"].items():
        print(f"{lib:>10}: tokenizer {r['tokenizer_s']:.2f} s, compile {1e3 * r['compile_first_s']:.1f} ms first / "
              f"{1e3 * r['compile_warm_s']:.2f} ms warm, mask p50 {r['mask_p50_ms']:.3f} ms max {r['mask_max_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
