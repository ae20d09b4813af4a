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
import json
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

    from engine import BlendOptions, Engine, load_model
    from retriever import Retriever

    eng = Engine(load_model(args.model))
    retriever = Retriever.open(args.index)
    retriever.check_model(eng.lm.fingerprint, eng.lm.tokenizer_fingerprint)
    p, opts = eng.prompt, BlendOptions(focus_keep=args.focus_keep)
    rows = [json.loads(line) for line in args.questions.read_text().splitlines() if line.strip()]
    retrieved = kept = last = n_kept = 0
    for row in rows:
        chunks = [h.text for h in retriever.search(row["question"], args.top_k)]
        prefix_ids = p.prefix_ids()
        kvs = eng.prefill_chunks(prefix_ids, [p.chunk_ids(c) for c in chunks])
        res = eng.blend(eng.prefix_kv(prefix_ids), kvs, p.question_ids(row["question"]), mode="focus", options=opts)
        has = [str(row["answer"]) in c for c in chunks]
        retrieved += any(has)
        kept += any(has[i] for i in res.used_chunks)
        last += (len(chunks) - 1) in res.used_chunks
        n_kept += len(res.used_chunks)
    n = len(rows)
    print(f"{n} questions, top-{args.top_k}, focus_keep {args.focus_keep}: answer in a retrieved chunk {retrieved}, "
          f"in a kept chunk {kept}; last chunk kept {last}; chunks kept {n_kept / max(1, n):.2f} on average")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
