"""`ragkv demo`: the main job on the embedded defaults, for a new user's first run.

Loads the shipped SmolLM2 model, precomputes the KV of a few built-in chunks (what
the indexer does), then answers a question with full prefill and with blended KV
reuse, printing both answers and their time to first token.
"""

from __future__ import annotations

import sys
import time

DEMO_CHUNKS = [
    "The Kerr Observatory stands on Mount Kerr, 2,150 metres above sea level. It was founded "
    "in 1931 by the astronomer Ada Lind, who chose the site for its dry, still air.",
    "The observatory's main instrument is a reflecting telescope with a 2.4-metre mirror. It "
    "was cast in 1954 and is still used for sky surveys every clear night.",
    "Visitors can tour the observatory on Saturdays from April to October. Tours start at the "
    "visitor centre at the foot of the mountain and take about three hours.",
    "In 1987 the observatory discovered the comet Lind-Haro, named after its founder and the "
    "engineer Tomas Haro, who built the observatory's first electronic camera.",
]
DEMO_QUESTION = "Who founded the Kerr Observatory?"


def run_demo(model_spec: str, max_new_tokens: int, out=sys.stdout) -> int:
    from engine import BlendMode, Engine, SamplingParams, load_model

    t0 = time.perf_counter()
    print(f"loading {model_spec} (the first run converts the GGUF once, ~30 s) ...", file=out, flush=True)
    eng = Engine(load_model(model_spec))
    print(f"loaded in {time.perf_counter() - t0:.1f} s; fingerprint {eng.lm.fingerprint[:16]}", file=out)

    p = eng.prompt
    prefix_ids = p.prefix_ids()
    t0 = time.perf_counter()
    prefix = eng.prefix_kv(prefix_ids)
    kvs = eng.prefill_chunks(prefix_ids, [p.chunk_ids(c) for c in DEMO_CHUNKS])
    n_tokens = sum(k.num_tokens for k in kvs)
    print(f"precomputed KV of {len(kvs)} chunks ({n_tokens} tokens) in {time.perf_counter() - t0:.2f} s",
          file=out)
    question = p.question_ids(DEMO_QUESTION)
    print(f"\nQ: {DEMO_QUESTION}", file=out)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=("\n\n",))
    for label, run in [
        ("full prefill", lambda: eng.full_prefill(p.prompt_ids(DEMO_CHUNKS, DEMO_QUESTION))),
        ("blend 15%", lambda: eng.blend(prefix, kvs, question, mode=BlendMode.BLEND, recompute_ratio=0.15)),
    ]:
        res = run()
        print(f"[{label}] TTFT {res.ttft_s * 1000:.0f} ms, recomputed {res.recompute_fraction:.0%} "
              f"of chunk tokens\nA: ", end="", file=out, flush=True)
        for piece in eng.decode(res, params):
            print(piece, end="", file=out, flush=True)
        print(file=out)
    return 0
