"""`ragkv eval`: answer quality and TTFT of each mode against full prefill.

Three sources of questions: `--synthetic TASK` builds RULER-style cases over stdlib text
at a given context length; `--dataset FILE.json` reads CacheBlend's QA format (MuSiQue:
`--ctxs N` passages per question); `--index DIR --questions FILE.jsonl` retrieves the
top-k chunks of a built index for each `{"id", "question", "answer"}` line.

`--neighbours 0,2` compares plain chunk KV with neighbour-conditioned KV (each chunk
prefilled after its m most similar chunks: indexer.neighbours) on the same cases; the
neighbours come from every passage of the dataset file, every chunk of the synthetic
run, or the index's own embeddings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ragkv.types import Mode

if TYPE_CHECKING:
    from ragkv.evals.evaluate import Refresh


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="measure answer quality of each mode against full prefill",
        description="For each question and mode: blend, decode greedily, and report accuracy, "
        "agreement with full prefill, next-token KL to full prefill, median TTFT and the fraction "
        "of tokens recomputed. Example: ragkv eval --synthetic niah --context 2048 --n 20 "
        "--modes full,reuse,blend --ratio 0.15,0.3 --selector deviation,query --json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", metavar="TASK",
                     help="niah, multikey, multivalue or twohop; with --retrieval-only: facts")
    src.add_argument("--index", type=Path, metavar="DIR", help="a built index (with --questions)")
    src.add_argument("--dataset", type=Path, metavar="FILE.json",
                     help="CacheBlend's QA format: a JSON list of {question, answers, ctxs: [{title, text}]} "
                          "(e.g. MuSiQue); scored by SQuAD token F1")
    src.add_argument("--from-cases", type=Path, metavar="FILE.jsonl",
                     help="score a recorded run again (its --cases-out), no model loaded: its methods' "
                          "reports, with --split, --folds and --replay-focus")
    p.add_argument("--ctxs", type=int, default=5, help="dataset: passages per question (default 5)")
    p.add_argument("--instruction", default=None,
                   help="the instruction before the passages (the system prompt); default: the dataset "
                        "default with --dataset, the engine's system prompt otherwise")
    p.add_argument("--question-suffix", default=None,
                   help="text appended to every question; default: a short-answer request with "
                        "--dataset, nothing otherwise")
    p.add_argument("--neighbours", default=None,
                   help="neighbour-conditioned KV: comma list of m (neighbours each chunk is prefilled "
                        "after; 0 = plain KV), each compared on the same cases (default: what ragkv index "
                        "builds, m = 1)")
    p.add_argument("--neighbour-budget", type=int, default=None,
                   help="most context tokens before a chunk (default: ragkv index's)")
    p.add_argument("--neighbour-context", default=None, metavar="tokens,kv",
                   help="neighbours before a chunk as their tokens (prefilled with it) or as their plain KV "
                        "(ragkv index's default: only the chunk is computed, the same KV for m = 1; the "
                        "prompt's first chunk then reads its own plain KV, int8 as the index stores it); "
                        "tokens,kv compares both (rows +nbM and +nbMkv)")
    p.add_argument("--pool-embeddings", type=Path, metavar="FILE.npy",
                   help="neighbours: keep the pool's embeddings in FILE.npy and reuse them on the next run")
    p.add_argument("--neighbour-choice", default="nearest", choices=("nearest", "random"),
                   help="neighbours by embedding similarity, or at random (the control)")
    p.add_argument("--questions", type=Path, metavar="FILE.jsonl", help='lines of {"id", "question", "answer"}')
    p.add_argument("--top-k", type=int, default=4, help="chunks per question with --index (default 4)")
    p.add_argument("--context", type=int, default=2048, help="synthetic: context tokens (default 2048)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="synthetic: tokens per chunk (default 512)")
    p.add_argument("--n", type=int, default=20, help="synthetic, dataset: number of cases (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="full,reuse,blend", help="comma list of full, prefix, reuse, blend, focus")
    p.add_argument("--ratio", default=None,
                   help="blend recompute ratio(s), comma list (default: ragkv serve's --default-recompute-ratio)")
    p.add_argument("--selector", default="query", help="blend selector(s): query (default), deviation")
    p.add_argument("--budget", default="global",
                   help="blend: how the recompute budget spreads: global (the best tokens anywhere) or chunk "
                        "(each chunk its length's share); comma list to compare")
    p.add_argument("--check-layer", type=int, default=1, help="deviation: check layer (default 1)")
    p.add_argument("--sink-tokens", default="0",
                   help="always recompute each chunk's first tokens (EPIC); comma list to compare (default 0)")
    p.add_argument("--score-depths", default=None, metavar="F+F[,...]",
                   help="query selector: the layers whose attention scores tokens, as fractions of the depth "
                        "joined by + (0.5 = the middle layer), averaged; comma list to compare (default: the "
                        "engine's, which ragkv serve serves)")
    p.add_argument("--refresh", default=None, metavar="K:R[,K:R]",
                   help="blend: also run each blend method refreshed: after the answer's first K tokens the "
                        "prompt is blended again at ratio R with them after the question, and the rest decoded "
                        "from that (TTFT stays the first pass's; the second is reported as refresh_median_s). "
                        "A study: the server does not refresh")
    p.add_argument("--window", type=int, default=1, help="recompute whole windows of this many tokens")
    p.add_argument("--adaptive-mass", type=float, default=None,
                   help="recompute the fewest tokens holding this share of the selector's score")
    p.add_argument("--fallback-full", action="store_true",
                   help="blend quality guard (with --adaptive-mass, query selector): run a request as full "
                        "prefill when holding that mass needs more than --ratio")
    p.add_argument("--focus-keep", default=None,
                   help="focus: keep chunks scoring at least this x the best; comma list (default: ragkv "
                        "serve's --focus-keep)")
    p.add_argument("--focus-handover", default=None, metavar="on,off",
                   help="focus: when several chunks are kept, blend over all of them instead (on), or over "
                        "the kept ones (off); on,off compares both in one run (default: ragkv serve's "
                        "--focus-handover)")
    p.add_argument("--focus-spread", default=None, metavar="S[,S]",
                   help="focus handover: hand over only when the two runners-up score on average at least S "
                        "x the best (0 = whenever several are kept); comma list (default: ragkv serve's "
                        "--focus-spread)")
    p.add_argument("--focus-several", default=None, metavar="N[,N]",
                   help="focus handover: hand over also when at least N chunks score within --focus-keep of the "
                        "best (0 = never); comma list (default: ragkv serve's --focus-several)")
    p.add_argument("--focus-rules", default=None, metavar="S:N[,S:N]",
                   help="focus handover rules as spread:several pairs, each one focus method named focus@sSnN "
                        "(in place of --focus-spread x --focus-several); 1:0 looks up on every question, which "
                        "with blend's rows lets --from-cases --replay-focus replay any rule")
    p.add_argument("--focus-lookup-ratio", default=None, metavar="R[,R]",
                   help="focus answering a lookup over neighbour KV: the share of its kept chunks' tokens "
                        "recomputed (1 = all: exact over them; 'request' = the request's --ratio); "
                        "comma list (default: ragkv serve's --focus-lookup-ratio)")
    p.add_argument("--focus-lookup-keep", default=None, metavar="K[,K]",
                   help="focus answering a lookup: keep chunks scoring at least K x the best (1 = the best "
                        "alone; 'keep' = --focus-keep); comma list (default: ragkv serve's --focus-lookup-keep)")
    o = p.add_argument_group(
        "out of sample (tune on one part of the questions, report on the other)",
        "A question's part is fixed by its id and the seed (a hash), so it is the same in every run and "
        "for any --n (--n counts questions before the split). Example: tune a threshold with --split tune, "
        "then report the pick with --split report and the same --split-seed; or --folds 2 to have the "
        "eval pick, per fold, the fastest method within --tune-kl-slack of the best KL on the other "
        "folds and report it on the held-out one.")
    o.add_argument("--split", choices=("tune", "report"), default=None,
                   help="run only this part of a fixed seeded split of the questions")
    o.add_argument("--split-seed", type=int, default=0, help="which split (default 0)")
    o.add_argument("--split-frac", type=float, default=0.5,
                   help="the tune part's share of the questions, in (0, 1) (default 0.5)")
    o.add_argument("--folds", type=int, default=None, metavar="K",
                   help="k-fold tuning over the methods run (full aside): each fold is reported by the method "
                        "tuned on the others; adds 'held_out' to the output")
    o.add_argument("--fold-seed", type=int, default=0, help="which assignment of questions to folds (default 0)")
    o.add_argument("--tune-kl-slack", type=float, default=0.005,
                   help="tuning picks the fastest method whose mean KL to full is within this of the best "
                        "(default 0.005 nats)")
    o.add_argument("--replay-focus", default=None, metavar="S:N[,S:N]",
                   help="with --from-cases: add focus rules replayed from the recorded rows (handover when "
                        "the runners-up average >= S x the best or N chunks are kept), named replay@sSnN; "
                        "the run must hold the two --replay-methods")
    o.add_argument("--replay-methods", default="blend,focus@s1n0", metavar="HANDOVER,LOOKUP",
                   help="the recorded methods a replayed rule reads: a handover's (blend at the focus ratio) and "
                        "a lookup's (a focus that always looks up: --focus-rules 1:0) (default blend,focus@s1n0)")
    p.add_argument("--cases-out", type=Path, metavar="FILE.jsonl",
                   help="write one JSON line per case: each method's answer, scores, TTFT and, for focus, "
                        "the chunks kept and every chunk's relevance")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--partial", type=Path, metavar="FILE.json",
                   help="rewrite FILE.json with the results so far after every case (long runs)")
    p.add_argument("--kv-compression", default=None, metavar="int8,fp8",
                   help="measure KV file compression instead: KL, agreement and accuracy of each mode over "
                        "compressed against uncompressed KV, file bytes and read time (synthetic cases)")
    c = p.add_argument_group("calibration (ragkv index --calibrate) against held-out questions")
    c.add_argument("--calibration", action="store_true",
                   help="calibrate on --dataset's passages as `ragkv index` does (chunk sets from their embeddings, "
                        "questions made from the passages), then measure blend at the same ratios on the held-out "
                        "real questions (--split, default report): predicted against measured KL per ratio, and "
                        "the ratio --fidelity-kl serves")
    c.add_argument("--calibration-sets", type=int, default=None, metavar="N",
                   help="chunk sets to calibrate on (default: as many as ragkv index takes for the corpus)")
    c.add_argument("--calibration-questions", choices=("entity+cloze", "entity", "cloze"), default="entity+cloze",
                   help="the questions calibration makes from the chunks, to compare their predictions: "
                        "entity+cloze (what ragkv index makes: the two kinds in turn, each setting predicted by the "
                        "worse kind's mean), entity ('Who or what is NAME?' of a name or number of the set's seed "
                        "chunk) or cloze (a sentence of it with its key words blanked, the first method)")
    c.add_argument("--fidelity-kl", type=float, default=0.01, help="the serving target whose pick is reported "
                                                                   "(ragkv serve --fidelity-kl; default 0.01)")
    r = p.add_argument_group("retrieval only (no LLM decoding)")
    r.add_argument("--retrieval-only", action="store_true",
                   help="report retrieval_recall and mrr per search mode as one JSON object: "
                        "--synthetic facts (a generated corpus) or --index DIR --questions FILE.jsonl")
    r.add_argument("--docs", type=int, default=40, help="facts: documents in the corpus (default 40)")
    r.add_argument("--search-modes", default="dense,lexical,hybrid", help="comma list of dense, lexical, hybrid")
    r.add_argument("--reranker", type=Path, metavar="DIR", help="a cross-encoder folder: adds a 'reranked' row")
    r.add_argument("--fusion", default="rrf", choices=("rrf", "weighted"), help="hybrid fusion (default rrf)")
    r.add_argument("--dense-weight", type=float, default=1.0, help="hybrid: weight of dense results")
    r.add_argument("--lexical-weight", type=float, default=1.0, help="hybrid: weight of lexical results")
    p.set_defaults(func=run_eval)


def served_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with what the command line left out taken from `ragkv serve`'s and `ragkv index`'s
    defaults, so the eval a user runs is the path they are served. ServerSettings is the one
    source of the default ratio and the focus settings (ServerSettings.focus); the selector's
    layers are the engine's (BlendOptions.score_depths), which the server serves as they are;
    the chunk KV is what `ragkv index` builds (indexer.neighbours.INDEX_DEFAULT)."""
    from ragkv.engine.blend import BlendOptions
    from ragkv.indexer.neighbours import INDEX_DEFAULT
    from ragkv.server.settings import ServerSettings

    served = ServerSettings()
    focus = served.focus()
    for dest, value in (("ratio", f"{served.limits().default_recompute_ratio:g}"), ("focus_keep", f"{focus.keep:g}"),
                        ("focus_handover", "on" if focus.handover else "off"), ("focus_spread", f"{focus.spread:g}"),
                        ("focus_several", str(focus.several)),
                        ("focus_lookup_ratio", "request" if focus.lookup_ratio is None else f"{focus.lookup_ratio:g}"),
                        ("focus_lookup_keep", "keep" if focus.lookup_keep is None else f"{focus.lookup_keep:g}"),
                        ("score_depths", "+".join(f"{f:g}" for f in BlendOptions().score_depths)),
                        ("neighbours", str(INDEX_DEFAULT.m)), ("neighbour_budget", INDEX_DEFAULT.budget_tokens),
                        ("neighbour_context", INDEX_DEFAULT.context.value)):
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    return args


def _score_depths(value: str) -> tuple[float, ...]:
    """One --score-depths entry: fractions of the depth joined by + (e.g. 0.25+0.5+0.75)."""
    try:
        return tuple(float(x) for x in value.split("+"))
    except ValueError:
        raise ValueError(f"--score-depths takes fractions of the depth joined by + (e.g. 0.25+0.5+0.75), "
                         f"got {value!r}") from None


def _number_or(value: str, word: str, option: str) -> float | None:
    """One entry of a comma list of numbers where `word` means None (the default it names)."""
    if value.strip() == word:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{option} takes numbers or '{word}', got {value!r}") from None


def _on_off(value: str, option: str) -> bool:
    if value.strip() not in ("on", "off"):
        raise ValueError(f"{option} takes on, off or on,off; got {value!r}")
    return value.strip() == "on"


def _methods(args: argparse.Namespace):
    from ragkv.engine import BlendOptions, FocusOptions
    from ragkv.evals.evaluate import Method

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ratios = [float(r) for r in args.ratio.split(",")]
    sink_list = [int(x) for x in str(args.sink_tokens).split(",")]
    layer_sets = [_score_depths(x) for x in args.score_depths.split(",")]
    selectors = [s.strip() for s in args.selector.split(",")]
    methods = []
    for mode in modes:
        try:
            bm = Mode(mode)
        except ValueError:
            raise ValueError(f"unknown mode {mode!r} in --modes; use full, prefix, reuse, blend, focus") from None
        if bm is Mode.FOCUS:  # several chunks kept: blended at each ratio, first selector
            keeps = [float(k) for k in args.focus_keep.split(",")]
            handovers = [_on_off(h, "--focus-handover") for h in args.focus_handover.split(",")]
            spreads = [float(x) for x in args.focus_spread.split(",")]
            severals = [int(x) for x in str(args.focus_several).split(",")]
            lookups = [_number_or(x, "request", "--focus-lookup-ratio") for x in args.focus_lookup_ratio.split(",")]
            lookup_keeps = [_number_or(x, "keep", "--focus-lookup-keep") for x in args.focus_lookup_keep.split(",")]
            variants = [(h, sp, sev) for h in handovers for sp in (spreads if h else [0.0])
                        for sev in (severals if h else [0])]  # spread and several: handover only
            if args.focus_rules:  # explicit pairs, each named by its rule
                from ragkv.evals.replay import parse_rules

                variants = [(True, r.spread, r.several) for r in parse_rules(args.focus_rules)]
            for handover, sp, sev in variants:
                for keep in keeps:
                    for r in ratios:
                        for lk, lkeep in ((lk, lkeep) for lk in lookups for lkeep in lookup_keeps):
                            opts = BlendOptions(recompute_ratio=r, selector=selectors[0], sink_tokens=sink_list[0],
                                                score_depths=layer_sets[0],
                                                focus=FocusOptions(keep=keep, handover=handover, spread=sp, several=sev,
                                                                   lookup_ratio=lk, lookup_keep=lkeep))
                            name = (f"focus@s{sp:g}n{sev}" if args.focus_rules else "focus")
                            named = bool(args.focus_rules)  # the rule is in the name already
                            name = (name + ("-handover" if handover and len(handovers) > 1 and not named else "")
                                    + (f"-s{sp:g}" if handover and len(spreads) > 1 and not named else "")
                                    + (f"-several{sev}" if handover and len(severals) > 1 and not named else "")
                                    + (f"-{keep:g}" if len(keeps) > 1 else "") + (f"-r{r:g}" if len(ratios) > 1 else "")
                                    + (f"-lookup{'r' if lk is None else f'{lk:g}'}" if len(lookups) > 1 else "")
                                    + (f"-lkeep{'k' if lkeep is None else f'{lkeep:g}'}" if len(lookup_keeps) > 1 else ""))
                            methods.append(Method(name, bm, opts))
            continue
        if bm is not Mode.BLEND:
            methods.append(Method(mode, bm))
            continue
        budgets = [b.strip() for b in args.budget.split(",")]
        for sel in selectors:
            for budget in budgets:
                for r in ratios:
                    for sinks in sink_list:
                        for layers in layer_sets:
                            opts = BlendOptions(recompute_ratio=r, selector=sel, check_layer=args.check_layer,
                                                sink_tokens=sinks, window=args.window, budget=budget,
                                                adaptive_mass=args.adaptive_mass, fallback_full=args.fallback_full,
                                                score_depths=layers)
                            name = "blend" if len(selectors) == len(ratios) == len(budgets) == 1 else (
                                f"blend-{sel}-{r:g}" + (f"-{budget}" if len(budgets) > 1 else ""))
                            name += (f"-sink{sinks}" if len(sink_list) > 1 else "") + (
                                f"-L{'+'.join(f'{f:g}' for f in layers)}" if len(layer_sets) > 1 else "")
                            methods.append(Method(name, bm, opts))
    for spec in [x.strip() for x in (args.refresh or "").split(",") if x.strip()]:
        refresh = _refresh(spec)
        methods += [dataclasses.replace(m, name=f"{m.name}+refresh{refresh.after}@{refresh.ratio:g}", refresh=refresh)
                    for m in methods if m.mode is Mode.BLEND and m.refresh is None]
    return methods


def _refresh(spec: str) -> Refresh:
    """One --refresh entry, K:R."""
    from ragkv.evals.evaluate import Refresh

    after, _, ratio = spec.partition(":")
    try:
        return Refresh(int(after), float(ratio))
    except ValueError as exc:
        raise ValueError(f"--refresh takes K:R (answer tokens before the refresh, its recompute ratio in "
                         f"(0, 1]), e.g. 8:0.3; got {spec!r}: {exc}") from None


def _cases(args: argparse.Namespace, engine):
    """The cases and the pool of chunk texts neighbours are chosen from (None: the index's)."""
    from dataclasses import replace

    from ragkv.evals.synthetic import make_cases

    if args.dataset:
        from ragkv.cli.dataset import DEFAULT_QUESTION_SUFFIX, load_dataset

        suffix = DEFAULT_QUESTION_SUFFIX if args.question_suffix is None else args.question_suffix
        return load_dataset(args.dataset, args.n, args.ctxs, suffix)
    if args.synthetic:
        tok = engine.lm.tokenizer
        n_chunks = max(1, args.context // args.chunk_tokens)
        cases = make_cases(args.synthetic, args.n, n_chunks, args.chunk_tokens,
                           lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), args.seed)
        pool = list(dict.fromkeys(c for case in cases for c in case.chunks))
    else:
        if not args.questions:
            raise ValueError("--index needs --questions FILE.jsonl")
        cases, pool = index_cases(engine, args.index, args.questions, args.top_k), None
    if args.question_suffix:
        cases = [replace(c, question=c.question + args.question_suffix) for c in cases]
    return cases, pool


def neighbour_variants(args: argparse.Namespace, engine, cases, pool):
    """One evaluate.KVVariant per m of --neighbours: plain KV for 0, else neighbour-conditioned."""
    from dataclasses import replace

    from ragkv.engine.prefill import context_segments
    from ragkv.evals.evaluate import PLAIN, KVVariant
    from ragkv.indexer.neighbours import PLAIN_COPY_COMPRESSION, context_ids, select_neighbours
    from ragkv.kvstore.compression import Compression, dequantize, quantize
    from ragkv.retriever.chunk_keys import NeighbourContext, NeighbourOptions

    ms = [int(m) for m in args.neighbours.split(",") if m.strip()]
    if not ms or any(m < 0 for m in ms):
        raise ValueError(f"--neighbours must be a comma list of m >= 0, got {args.neighbours!r}")
    if all(m == 0 for m in ms):
        return [PLAIN]
    names = [c.strip() for c in args.neighbour_context.split(",") if c.strip()]
    known = [c.value for c in NeighbourContext]
    if not names or any(n not in known for n in names):
        raise ValueError(f"--neighbour-context takes a comma list of {', '.join(known)}, "
                         f"got {args.neighbour_context!r}")
    contexts = [NeighbourContext(n) for n in names]
    texts, xb = _neighbour_pool(args, cases, pool)
    row_of = {t: i for i, t in enumerate(texts)}
    p = engine.prompt
    # pool row -> its plain KV (what an index stores anyway), for the case at hand only: each
    # case's KV prefill time then includes its neighbours' plain prefill once, and memory stays flat
    plain_kv: dict[int, object] = {}

    def stored_plain(kv):  # a plain KV as the index stores its plain copy
        c = Compression(PLAIN_COPY_COMPRESSION)
        if c is Compression.NONE:
            return kv
        return replace(kv, k=dequantize(*quantize(kv.k, c), kv.k.dtype), v=dequantize(*quantize(kv.v, c), kv.v.dtype))

    def neighbour_kv(j: int, prefix_ids):
        if j not in plain_kv:
            plain_kv[j] = stored_plain(engine.prefill(prefix_ids, p.chunk_ids(texts[j])))
        return plain_kv[j]

    wanted = sorted({row_of[c] for case in cases for c in case.chunks})
    variants = []
    for m in ms:
        if m == 0:
            variants.append(PLAIN)
            continue
        choice = NeighbourOptions(m, args.neighbour_budget, args.neighbour_choice, args.seed)
        nbrs = dict(zip(wanted, select_neighbours(xb, choice, wanted)))  # the same for either context
        for how in contexts:
            opts = replace(choice, context=how)
            if how is NeighbourContext.KV:  # the plain KV is stored too: the prompt's first chunk reads it
                def context_kv(case, prefix_ids, nbrs=nbrs, opts=opts):
                    plain_kv.clear()
                    return [None if i == 0 and opts.plain_first else
                            context_segments([neighbour_kv(j, prefix_ids) for j in nbrs[row_of[c]]], opts.budget_tokens)
                            for i, c in enumerate(case.chunks)]

                variants.append(KVVariant(f"nb{m}kv", context_kv=context_kv, stored_plain=stored_plain))
                continue

            def context(case, nbrs=nbrs, opts=opts):
                return [context_ids([p.chunk_ids(texts[j]) for j in nbrs[row_of[c]]], opts.budget_tokens)
                        for c in case.chunks]

            variants.append(KVVariant(f"nb{m}", context))
    return variants


def _neighbour_pool(args: argparse.Namespace, cases, pool):
    """(texts, [n, d] embeddings) neighbours are chosen from; every case chunk is among the texts."""
    import numpy as np

    if pool is None:  # an index: its own embeddings
        from ragkv.retriever.chunk_db import ChunkDB

        db = ChunkDB.open(args.index, readonly=True)
        try:
            rows, texts = db.texts()
            ids, xb = db.all_vectors()
        finally:
            db.close()
        if list(ids) != rows:
            raise RuntimeError("chunk rows of texts and vectors differ: a bug")
        texts, known = list(texts), set(texts)
        missing = [c for case in cases for c in case.chunks if c not in known]
        if missing:
            raise RuntimeError(f"{len(missing)} retrieved chunks are not in {args.index}'s chunk table: a bug")
        return texts, np.asarray(xb)
    from ragkv.retriever.embedder import Embedder

    cache = args.pool_embeddings
    if cache is not None and cache.is_file():
        xb = np.load(cache)
        if xb.shape[0] == len(pool):
            return pool, xb
    xb = Embedder.load().encode_documents(pool)
    if cache is not None:
        np.save(cache, xb)
    return pool, xb


def index_cases(engine, index: Path, questions: Path, top_k: int):
    """One EvalCase per line of `questions` ({"id", "question", "answer"}), its chunks the
    top_k that the index retrieves for the question."""
    from ragkv.evals.synthetic import EvalCase
    from ragkv.retriever import Retriever

    r = Retriever.open(index)
    r.check_model(engine.lm.fingerprint, engine.lm.tokenizer_fingerprint)
    cases = []
    for i, line in enumerate(questions.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answer = row["question"], str(row["answer"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{questions}:{i + 1}: expected {{\"id\", \"question\", \"answer\"}}: {exc}") from None
        hits = r.search(question, top_k)
        cases.append(EvalCase(str(row.get("id", i)), tuple(h.text for h in hits), question, (answer,)))
    return cases


def _split(args: argparse.Namespace):
    """The --split part's Split and Part, or (None, None) without --split."""
    from ragkv.evals.split import Part, Split

    if args.folds is not None and args.split is not None:
        raise ValueError("--folds and --split are two ways to hold questions out: give one")
    if args.folds is not None and args.folds < 2:
        raise ValueError(f"--folds must be at least 2 (one part to tune on, one to report), got {args.folds}")
    Split(args.split_seed, args.split_frac)  # checks --split-frac before any model is loaded
    if args.split is None:
        return None, None
    return Split(args.split_seed, args.split_frac), Part(args.split)


def held_out(args: argparse.Namespace, rows: list[dict]) -> dict | None:
    """--folds: the cross-validated pick over the methods every row ran (full aside)."""
    from ragkv.evals.split import TuneRule, cross_validate, held_out_summary, tuned_methods

    if args.folds is None:
        return None
    results = cross_validate(rows, tuned_methods(rows), args.folds, args.fold_seed, TuneRule(args.tune_kl_slack))
    return held_out_summary(results, rows, args.folds, args.fold_seed)


def run_from_cases(args: argparse.Namespace) -> dict:
    """--from-cases: the recorded rows' reports (split, replayed, cross-validated), no model."""
    from ragkv.evals.replay import parse_rules, replay
    from ragkv.evals.split import Part, paired_speedup, report_from_rows

    rows = []
    for i, line in enumerate(args.from_cases.read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.from_cases}:{i + 1}: not a --cases-out line ({exc})") from None
    split, part = _split(args)
    rules = parse_rules(args.replay_focus) if args.replay_focus else []
    if split is not None:
        rows = split.select(rows, part, key=lambda r: r["id"])
    if rules:
        handover, _, lookup = args.replay_methods.partition(",")
        rows = replay(rows, rules, handover.strip(), lookup.strip())
    if not rows:
        raise ValueError(f"{args.from_cases}: no cases (on this side of the split)")
    names = list(dict.fromkeys(m for row in rows for m in row["methods"]))
    out: dict = {"modes": {m: {**report_from_rows(rows, m).as_dict(), "ttft_x_full_paired": paired_speedup(rows, m)}
                           for m in names},
                 "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}}
    if (h := held_out(args, rows)) is not None:
        out["held_out"] = h
    if part is Part.TUNE:  # what --folds' rule picks on this part, to report on the other
        from ragkv.evals.split import TuneRule, tuned_methods

        out["picked"] = TuneRule(args.tune_kl_slack).pick({m: report_from_rows(rows, m) for m in tuned_methods(rows)})
    return out


def _print_table(modes: dict[str, dict], held: dict | None) -> None:
    print(f"{'method':28s} {'n':>4s} {'acc':>5s} {'F1':>5s} {'agree':>5s} {'F1full':>6s} {'tok1':>5s} "
          f"{'KL':>7s} {'KLans':>7s} {'TTFT s':>7s} {'xfull':>6s} {'xpair':>6s} {'recomp':>6s} {'KV s':>6s} {'rfrsh s':>7s}")
    full = modes.get("full", {}).get("ttft_median_s", 0.0)
    for name, r in modes.items():
        x = full / r["ttft_median_s"] if full and r["ttft_median_s"] else float("nan")
        print(f"{name:28s} {r['n']:4d} {r['accuracy']:5.2f} {r['f1']:5.2f} {r['agreement']:5.2f} "
              f"{r['f1_vs_full']:6.2f} {r['first_token_agreement']:5.2f} {r['kl_mean']:7.4f} "
              f"{r.get('kl_answer', float('nan')):7.4f} {r['ttft_median_s']:7.3f} {x:6.2f} "
              f"{r.get('ttft_x_full_paired', float('nan')):6.2f} "
              f"{r['recompute_fraction']:6.2f} {r['kv_prefill_median_s']:6.2f} {r.get('refresh_median_s', 0.0):7.2f}")
    if held is not None:
        print(f"held out, {held['folds']} folds (seed {held['fold_seed']}):")
        for f in held["per_fold"]:
            print(f"  fold {f['fold']}: picked {f['picked']} on {f['n_tune']} cases; here n={f['n']} "
                  f"KL {f['kl_mean']:.4f} F1full {f['f1_vs_full']:.2f} TTFT {f['ttft_median_s']:.3f} s")
        t = held["tuned"]
        print(f"  tuned, every case held out: n={t['n']} KL {t['kl_mean']:.4f} F1full {t['f1_vs_full']:.2f} "
              f"TTFT {t['ttft_median_s']:.3f} s")


def _calibration_eval(args: argparse.Namespace) -> dict:
    """--calibration (cli/calibration_eval.py), on this command's dataset, split and served KV."""
    from ragkv.cli.calibration_eval import EvalInputs, run_calibration_eval
    from ragkv.cli.dataset import DEFAULT_INSTRUCTION
    from ragkv.engine import Engine, load_model, tune_host_allocator
    from ragkv.evals.split import Part

    if not args.dataset:
        raise ValueError("--calibration needs --dataset FILE.json (its passages are the corpus it calibrates on)")
    if args.split is None:
        args.split = Part.REPORT.value  # the questions reported on; calibration reads none of them
    split, part = _split(args)
    tune_host_allocator()
    engine = Engine(load_model(args.model), system_prompt=args.instruction or DEFAULT_INSTRUCTION)
    cases, pool = _cases(args, engine)
    return run_calibration_eval(args, EvalInputs(
        engine, cases, split.select(cases, part) if split is not None else cases,
        neighbour_pool=lambda c: _neighbour_pool(args, c, pool),
        variants=lambda c: neighbour_variants(args, engine, c, pool)))


def run_eval(args: argparse.Namespace) -> int:
    served_defaults(args)
    if args.from_cases:
        out = run_from_cases(args)
        if not args.json and "picked" in out:
            print(f"picked on the tune part: {out['picked']}")
        print(json.dumps(out)) if args.json else _print_table(out["modes"], out.get("held_out"))
        return 0
    if args.calibration:
        from ragkv.cli.calibration_eval import print_report as print_calibration

        report = _calibration_eval(args)
        print(json.dumps(report)) if args.json else print_calibration(report)
        return 0
    if args.kv_compression:
        from ragkv.cli.kv_compression_eval import print_report, run_compression_eval

        report = run_compression_eval(args)
        print(json.dumps(report)) if args.json else print_report(report)
        return 0
    if args.retrieval_only:
        from ragkv.cli.retrieval_eval import run_retrieval_eval

        print(json.dumps(run_retrieval_eval(args)))
        return 0
    from tqdm import tqdm

    from ragkv.engine import Engine, load_model, tune_host_allocator

    tune_host_allocator()  # before torch's first large allocation
    from ragkv.evals.evaluate import evaluate

    if args.instruction is not None:
        instruction = args.instruction
    elif args.dataset:
        from ragkv.cli.dataset import DEFAULT_INSTRUCTION as instruction
    else:
        from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT as instruction
    split, part = _split(args)  # its options checked before the model loads
    engine = Engine(load_model(args.model), system_prompt=instruction)
    methods = _methods(args)
    cases, pool = _cases(args, engine)
    if split is not None:  # the neighbour pool stays the whole set's: an index holds every passage
        cases = split.select(cases, part)
        if not cases:
            raise ValueError(f"no case on the {part.value} side of --split-seed {args.split_seed}: raise --n")
    variants = neighbour_variants(args, engine, cases, pool)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    config["instruction"] = instruction

    def result(reports) -> dict:
        return {"modes": {name: r.as_dict() for name, r in reports.items()}, "config": config}

    def partial(reports) -> None:
        tmp = args.partial.with_name(args.partial.name + ".tmp")
        tmp.write_text(json.dumps(result(reports)) + "\n")
        tmp.replace(args.partial)

    cases_out = args.cases_out.open("w") if args.cases_out else None
    rows: list[dict] = []

    def write_case(row: dict) -> None:
        rows.append(row)
        if cases_out:
            cases_out.write(json.dumps(row) + "\n")
            cases_out.flush()

    try:
        reports = evaluate(engine, cases, methods, args.max_new_tokens,
                           progress=lambda xs: tqdm(xs, desc="eval", unit="case", file=sys.stderr),
                           variants=variants, after_case=partial if args.partial else None,
                           on_case=write_case if cases_out or args.folds else None)
    finally:
        if cases_out:
            cases_out.close()
    out = result(reports)
    if (h := held_out(args, rows)) is not None:
        out["held_out"] = h
    print(json.dumps(out)) if args.json else _print_table(out["modes"], out.get("held_out"))
    return 0
