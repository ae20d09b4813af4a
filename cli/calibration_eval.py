"""`ragkv eval --calibration`: does an index's calibration predict blend's fidelity on real questions?

`ragkv index` calibrates on its own corpus with no question from anyone (`indexer.calibrate`):
chunk sets made from its embeddings, questions made from the chunks. This eval does
exactly that on a QA file's passages (`--dataset`, CacheBlend's MuSiQue format: every passage
of the `--n` questions is the corpus), then measures blend at the same ratios on the file's
real questions, none of which calibration saw (the report part of the seeded split, or
`--split tune`), with the KV the served index would hold (neighbour KV as `ragkv index`
builds it, plain for the first chunk). Per ratio:

- predicted: the calibration's mean KL (and its standard error over the chunk sets);
- measured: mean next-token KL to full prefill on the real questions, F1 of the answers
  against full prefill's, top-token agreement, TTFT against full prefill;
- measured / predicted, and whether it is within a factor of 2;

and the setting `ragkv serve --fidelity-kl` would pick from the calibration, with what it
measures. Deterministic: the same file, `--n` and model give the same sets and questions.

    ragkv eval --calibration --dataset musique_dev.json --n 30 --model smollm2-135m-instruct --json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvalInputs:
    """What `ragkv eval` (cli/eval.py) prepares for this eval: the engine, the file's questions, the
    held-out ones, and how it computes neighbours and the served KV for any cases."""

    engine: Any  # engine.Engine, with the dataset's instruction as its system prompt
    cases: Sequence[Any]  # every question of --n (evals.synthetic.EvalCase)
    held_out: Sequence[Any]  # the ones measured on (--split, default report)
    neighbour_pool: Callable[[Sequence[Any]], tuple[list[str], Any]]  # cases -> (corpus texts, [n, d] embeddings)
    variants: Callable[[Sequence[Any]], list[Any]]  # cases -> the KV variants `ragkv index` builds for them


def run_calibration_eval(args: argparse.Namespace, inputs: EvalInputs) -> dict[str, Any]:
    """Calibrate on the dataset's passages, measure on its held-out questions; returns the report."""
    from tqdm import tqdm

    from ragkv.engine import BlendOptions
    from ragkv.evals.evaluate import Method, evaluate, variant_kvs
    from ragkv.evals.synthetic import EvalCase
    from ragkv.indexer.calibrate import RATIOS, CalibrationSet, measure, sample_prompts, sample_size
    from ragkv.server.fidelity import served_ratio
    from ragkv.types import Mode

    engine, cases = inputs.engine, inputs.cases
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    # calibration, as the index does it: chunk sets from the corpus's embeddings, questions from the chunks
    started = time.perf_counter()
    texts, xb = inputs.neighbour_pool(cases)
    n_sets = args.calibration_sets or sample_size(len(texts))
    drawn = sample_prompts(xb, n_sets, texts.__getitem__, args.calibration_questions)
    sample = [EvalCase(f"calibration-{i}", tuple(texts[j] for j in rows), question, ())
              for i, (rows, question, _) in enumerate(drawn)]
    # the KV `ragkv index` builds (served defaults), for the questions' chunks and the sample's
    variants = inputs.variants([*cases, *sample])
    if len(variants) != 1:
        raise ValueError("--calibration measures one KV variant: give one --neighbours and --neighbour-context")
    variant = variants[0]
    sets = []
    for case, (_, _, kind) in zip(sample, drawn):
        kvs = variant_kvs(engine, variant, case)
        sets.append(CalibrationSet(tuple(tuple(kv.token_ids.tolist()) for kv in kvs), tuple(kvs), case.question, kind))
    say(f"calibrating on {len(sets)} chunk sets of {len(texts)} passages")
    calibration = measure(engine, sets, RATIOS, method=args.calibration_questions,
                          progress=lambda x: tqdm(x, desc="calibrate", disable=args.json))
    calibration_s = time.perf_counter() - started

    # the real questions, held out
    held_out = inputs.held_out
    methods = [Method("full", Mode.FULL), *(Method(f"blend@{r:g}", Mode.BLEND, BlendOptions(recompute_ratio=r))
                                            for r in RATIOS)]
    say(f"measuring on {len(held_out)} held-out questions")
    reports = evaluate(engine, held_out, methods, args.max_new_tokens, variants=[variant],
                       progress=lambda x: tqdm(x, desc="measure", disable=args.json))

    def name(r: float) -> str:
        return f"blend@{r:g}" + (f"+{variant.name}" if variant.name else "")

    full_ttft = reports["full"].ttft_median_s
    rows = []
    for s in calibration.settings:
        m = reports[name(s.recompute_ratio)]
        ratio = m.kl_mean / s.kl_mean if s.kl_mean > 0 else float("inf")
        rows.append({"recompute_ratio": s.recompute_ratio, "predicted_kl": s.kl_mean, "predicted_stderr": s.kl_stderr,
                     "predicted_top_token_agreement": s.top_token_agreement,
                     "measured_kl": m.kl_mean, "measured_top_token_agreement": m.first_token_agreement,
                     "f1_vs_full": m.f1_vs_full, "speedup_vs_full": full_ttft / m.ttft_median_s,
                     "measured_over_predicted": ratio, "within_2x": 0.5 <= ratio <= 2.0})
    served = served_ratio("eval", calibration, args.fidelity_kl, None)
    chosen = next(r for r in rows if r["recompute_ratio"] == served.ratio)
    return {
        "model": args.model, "dataset": str(args.dataset), "n": len(cases), "ctxs": args.ctxs,
        "held_out_questions": len(held_out), "variant": variant.name or "plain",
        "calibration": {**calibration.as_dict(), "seconds": calibration_s, "corpus_passages": len(texts)},
        "settings": rows,
        "within_2x_share": sum(r["within_2x"] for r in rows) / len(rows),
        "served": {"fidelity_kl": args.fidelity_kl, "reason": served.reason, **chosen},
        "full_ttft_median_s": full_ttft,
    }


def print_report(report: dict[str, Any]) -> None:
    print(f"{report['model']}: calibrated on {report['calibration']['sets']} chunk sets, measured on "
          f"{report['held_out_questions']} held-out questions ({report['variant']} KV)")
    print(f"{'ratio':>6} {'predicted KL':>14} {'measured KL':>12} {'x':>6} {'F1 vs full':>10} {'speedup':>8}")
    for r in report["settings"]:
        print(f"{r['recompute_ratio']:>6g} {r['predicted_kl']:>8.4f}+-{r['predicted_stderr']:.4f} "
              f"{r['measured_kl']:>12.4f} {r['measured_over_predicted']:>6.2f} {r['f1_vs_full']:>10.2f} "
              f"{r['speedup_vs_full']:>7.2f}x")
    print(f"within 2x: {report['within_2x_share']:.0%} of settings; served: {report['served']['reason']}")
    print(f"  measured there: KL {report['served']['measured_kl']:.4f}, F1 vs full {report['served']['f1_vs_full']:.2f}, "
          f"{report['served']['speedup_vs_full']:.2f}x full prefill's TTFT")
