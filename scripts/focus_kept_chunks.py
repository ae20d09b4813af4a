"""Which retrieved chunks `focus` keeps, against where the answer is: a diagnostic.

    python scripts/focus_kept_chunks.py --index DIR --questions FILE.jsonl [--top-k 4] [--focus-keep 0.5]

For each question ({"question", "answer"} lines): retrieve top-k chunks, run focus,
and count the questions whose answer string is in some retrieved chunk, in some kept
chunk, and those where the last chunk (nearest the question) was kept. Accuracy of
the decoded answer is `ragkv eval`'s job; this says whether focus kept the right
evidence, which a 135M model's answers cannot show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, required=True, help="a built index (ragkv index / ragkv demo)")
    ap.add_argument("--questions", type=Path, required=True, help='lines of {"question", "answer"}')
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--focus-keep", type=float, default=0.5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()

    from ragkv.cli.eval import index_cases
    from ragkv.engine import BlendOptions, Engine, FocusOptions, Prompt, load_model

    eng = Engine(load_model(args.model))
    p, opts = eng.prompt, BlendOptions(focus=FocusOptions(keep=args.focus_keep))
    cases = index_cases(eng, args.index, args.questions, args.top_k)
    retrieved = kept = last = n_kept = 0
    for case in cases:
        prefix_ids = p.prefix_ids()
        kvs = [eng.prefill(prefix_ids, ids) for ids in [p.chunk_ids(c) for c in case.chunks]]
        res = eng.run(Prompt.of(prefix_ids, kvs, p.question_ids(case.question)), "focus", options=opts)
        has = [any(a in c for a in case.answers) for c in case.chunks]
        retrieved += any(has)
        kept += any(has[i] for i in res.used_chunks)
        last += (len(case.chunks) - 1) in res.used_chunks
        n_kept += len(res.used_chunks)
    n = len(cases)
    print(f"{n} questions, top-{args.top_k}, focus_keep {args.focus_keep}: answer in a retrieved chunk {retrieved}, "
          f"in a kept chunk {kept}; last chunk kept {last}; chunks kept {n_kept / max(1, n):.2f} on average")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
