"""CPU threads of a serving process: torch's own against engine.host_threads', in the same run.

A server loads its model on the main thread and computes on the scheduler's. Each arm runs in
its own process (torch's thread counts hold for a whole process) and does just that: it loads
SmolLM2 and computes the chunks' KV on the main thread, then, on another thread (the
scheduler's stand-in), times blend passes over 4 prompts of 5 chunks (a needle case each)
and a 32-token decode. One arm with RAGKV_HOST_THREADS=default (every thread on torch's
count), one as `ragkv serve` starts (`compute_on_one_thread`, and the computing thread
`take_cores`). Prints each arm's medians over --repeats and the ratio default / engine.

    python bench/host_threads_bench.py [--repeats 5] [--model smollm2-135m-instruct] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_ARM = r"""
import json, statistics, sys, threading, time
sys.path.insert(0, {root!r})
from ragkv.engine.kv.host_allocator import tune_host_allocator
from ragkv.engine.host_threads import compute_on_one_thread, take_cores
tune_host_allocator()
compute_on_one_thread()  # with RAGKV_HOST_THREADS=default: nothing
from ragkv.engine import Engine, Prompt, SamplingParams, load_model
from ragkv.evals.synthetic import make_cases
from ragkv.types import Mode

engine = Engine(load_model({model!r}))
fmt, tok = engine.prompt, engine.lm.tokenizer
pre = fmt.prefix_ids()
prompts = []
for case in make_cases("niah", 4, 5, 128, lambda t: len(tok.encode(t)), 0):
    ids = [fmt.chunk_ids(x) for x in case.chunks]
    prompts.append(Prompt(fmt.question_ids(case.question), pre, ids, [engine.prefill(pre, i) for i in ids]))

def timed():
    take_cores()
    passes, decodes = [], []
    for rep in range({repeats} + 1):  # the first round warms up
        t = time.perf_counter()
        for p in prompts:
            res = engine.run(p, Mode.BLEND)
        passes.append(time.perf_counter() - t)
        t = time.perf_counter()
        "".join(engine.decode(res, SamplingParams(max_new_tokens=32)))
        decodes.append(time.perf_counter() - t)
    out.update(blend_s=statistics.median(passes[1:]), decode_s=statistics.median(decodes[1:]))

out = {{}}
worker = threading.Thread(target=timed, name="scheduler")
worker.start()
worker.join()
print(json.dumps(out))
"""


def _arm(env_value: str, repeats: int, model: str) -> dict[str, float]:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "RAGKV_HOST_THREADS": env_value}
    code = _ARM.format(root=root, repeats=repeats, model=model)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per arm, after one to warm up (default 5)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model to load (default: the shipped SmolLM2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    default = _arm("default", args.repeats, args.model)
    engine = _arm("engine", args.repeats, args.model)
    ratios = {k: default[k] / engine[k] for k in default}
    if args.json:
        print(json.dumps({"default": default, "engine": engine, "default_over_engine": ratios}))
    else:
        for name, arm in (("torch's threads (default)", default), ("one computing thread (engine)", engine)):
            print(f"{name:32s} 4 blend passes {arm['blend_s']:.3f} s   32-token decode {arm['decode_s']:.3f} s")
        print(f"default / engine: blend {ratios['blend_s']:.2f}x, decode {ratios['decode_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
