"""`ragkv check-model MODEL`: does ragkv compute this model as transformers does?

Runs the correctness gate (engine.check) on the user's own model directory, .gguf file
or hub id and prints a verdict per check with its numbers; exits 1 when any fails.
"""

from __future__ import annotations

import argparse

from ragkv.types import DType


def add_check_model_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-model",
        help="check that ragkv computes a model as transformers does (logits, blend, reuse, decode)",
        description="Run a short RAG prompt through transformers' forward and through ragkv's engine: "
        "last logits (max abs difference, top-1), blend at ratio 1.0 against full prefill, a chunk "
        "reused at its own positions against full prefill, and greedy decode against generate. "
        "Prints PASS or FAIL per check; exit code 1 when any fails. `ragkv serve` and `ragkv index` "
        "run the quick form at start.",
    )
    p.add_argument("model", help="HF model directory, .gguf file, hub id, or a shipped model: "
                                 "smollm2-135m-instruct, gemma3-270m (the gemma extra)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, choices=[d.value for d in DType],
                   help="float32, bfloat16 or float16 (default: float32 on cpu, "
                                                 "bfloat16 on cuda)")
    p.add_argument("--quick", action="store_true", help="the start-up form: a shorter prompt and 4 decode steps")
    p.set_defaults(func=run_check_model)
    return p


def run_check_model(args: argparse.Namespace) -> int:
    from ragkv.engine import load_model
    from ragkv.engine.check import check_model

    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    print(f"{args.model}: family {lm.adapter.family.model_type}, {lm.num_layers} layers, "
          f"{str(lm.dtype).removeprefix('torch.')} on {lm.device}")
    checks = check_model(lm, quick=args.quick)
    for c in checks:
        print(c.line())
    ok = all(c.passed for c in checks)
    print("verdict: " + ("served (every check passed)" if ok else "REFUSED: ragkv serve and index will not "
                         "take this model without --skip-model-check"))
    return 0 if ok else 1
