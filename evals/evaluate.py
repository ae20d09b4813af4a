"""Answer quality and TTFT of each blend method against full prefill of the same prompt.

For every case the chunk KVs are prefilled once per KV variant (the indexer's work, not
in TTFT: plain KV after the prefix, or neighbour-conditioned KV after the prefix and
context tokens); each method then runs the prompt over each variant's KV and decodes
greedily. Per method (and variant):
- accuracy:   an expected answer appears in the answer's first sentence;
- f1:         SQuAD token F1 of the answer's first sentence against the best expected answer;
- agreement:  the answer equals full prefill's answer (normalized);
- f1_vs_full: token F1 of the answer against full prefill's answer (fidelity);
- first_token_agreement: the first token equals full prefill's (argmax of the logits);
- kl_mean:    KL(full || method) of the next-token distribution at the last prompt position;
- kl_answer, kl_answer_max: the same KL at each answer position while the two answers agree,
              and at the one where they part (each fed the same tokens so far), mean and max:
              where F1 is lost (an answer that first repeats the question parts at the word
              that answers it, not at the first position);
- ttft_median_s: prompt processing up to the first token's logits;
- recompute_fraction: the mean share of chunk tokens recomputed;
- kv_prefill_median_s: the indexer's work for one case's chunks in this KV variant;
- refresh_median_s: a refreshed method's second pass (below), apart from its TTFT.

A method may refresh its answer (`Refresh`): after its first `after` answer tokens it blends the
prompt again at `ratio`, the answer so far in its question segment (its selector reads them
too), and decodes the rest from there. Its TTFT is the first pass's; the second pass is a stall
in the answer's stream, reported as `refresh_median_s`. (A study of the served blend's F1 loss,
which falls where the answer parts from full prefill's, after its first words; the server does
not refresh.)
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import string
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ragkv.engine.blend import BlendOptions, BlendResult, Prompt
from ragkv.engine.decode import SamplingParams
from ragkv.engine.kv.cache import ChunkKV
from ragkv.engine.runtime import Engine
from ragkv.evals.synthetic import EvalCase
from ragkv.indexer.calibrate import kl_divergence  # one KL for calibration and evals
from ragkv.types import Mode


@dataclass(frozen=True, slots=True)
class Method:
    """A named way of running the prompt."""

    name: str  # label in reports, e.g. "blend-query-0.30"
    mode: Mode
    options: BlendOptions = field(default_factory=BlendOptions)
    refresh: Refresh | None = None  # blend the prompt again after the answer's first tokens; None = once


@dataclass(frozen=True, slots=True)
class Refresh:
    """A second blend pass after the answer's first `after` tokens, at `ratio`, with them in its question."""

    after: int
    ratio: float

    def __post_init__(self) -> None:
        if self.after < 1 or not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"a refresh needs after >= 1 answer tokens and a ratio in (0, 1], got "
                             f"{self.after}:{self.ratio:g}")


@dataclass(frozen=True, slots=True)
class KVVariant:
    """How the chunks' KV is computed before the methods read it."""

    name: str  # suffix of the method names in reports ("" = plain KV, no suffix)
    # each chunk's context token ids (between prefix and chunk), given the case; None = plain KV
    context: Callable[[EvalCase], Sequence[Sequence[int]]] | None = None
    # or each chunk's context as computed KV (its neighbours' plain KV: `Engine.prefill(context_kv=)`),
    # given the case and the prefix's tokens; the time it takes counts as the variant's KV prefill.
    # None for a chunk: its plain KV as the index stores its plain copy (the prompt's first chunk:
    # `NeighbourOptions.plain_first`), which `stored_plain` gives from the computed one
    context_kv: Callable[[EvalCase, Sequence[int]], Sequence[Sequence[ChunkKV] | None]] | None = None
    stored_plain: Callable[[ChunkKV], ChunkKV] | None = None  # None: the plain KV as computed


PLAIN = KVVariant("")


@dataclass(slots=True)
class MethodReport:
    n: int = 0
    accuracy: float = 0.0
    f1: float = 0.0
    agreement: float = 0.0
    f1_vs_full: float = 0.0
    first_token_agreement: float = 0.0
    kl_mean: float = 0.0
    kl_answer: float = 0.0  # mean over cases of each case's mean KL along the answer (see the module doc)
    kl_answer_max: float = 0.0  # mean over cases of each case's highest KL along the answer
    ttft_median_s: float = 0.0
    recompute_fraction: float = 0.0
    kv_prefill_median_s: float = 0.0
    refresh_median_s: float = 0.0  # a refreshed method's second pass (0 for the others)
    _ttfts: list[float] = field(default_factory=list, repr=False)
    _prefills: list[float] = field(default_factory=list, repr=False)
    _refreshes: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("_ttfts"), d.pop("_prefills"), d.pop("_refreshes")
        return d


def normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


def first_sentence(text: str) -> str:
    text = " ".join(text.split())  # "is:\n\n4721." reads as one sentence
    m = re.search(r"[.!?](?!\d)", text)
    return text[: m.start()] if m else text


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 of `prediction` against `reference` (both normalized); 1.0 when both are empty."""
    pred, ref = squad_normalize(prediction).split(), squad_normalize(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: Iterable[str]) -> float:
    """The best token F1 of `prediction` against any of `references` (0.0 with none)."""
    return max((token_f1(prediction, r) for r in references), default=0.0)


def evaluate(engine: Engine, cases: Iterable[EvalCase], methods: Sequence[Method],
             max_new_tokens: int = 24, progress: Callable[[Iterable], Iterable] = lambda x: x,
             variants: Sequence[KVVariant] = (PLAIN,),
             after_case: Callable[[dict[str, MethodReport]], None] | None = None,
             on_case: Callable[[dict], None] | None = None) -> dict[str, MethodReport]:
    """Run every method on every case over each KV variant's chunks; `full` is always run as
    the reference (once a case: it reads no chunk KV). Reports are named `method` for the
    plain variant and `method+variant` for the others; `after_case` gets the reports over the
    cases so far after each case (a long run's partial results); `on_case` one JSON-ready row
    per case: its id and, per method, the answer, its scores and, for focus, the chunks kept
    and every chunk's relevance (to study a rule offline)."""
    p = engine.prompt
    params = SamplingParams(max_new_tokens=max_new_tokens)
    names = {(m.name, v.name): m.name if m.mode is Mode.FULL or not v.name else f"{m.name}+{v.name}"
             for m in methods for v in variants}
    reports = {name: MethodReport() for name in dict.fromkeys(names.values())}
    sums = {name: Counter() for name in reports}
    for case in progress(list(cases)):
        prefix_ids = p.prefix_ids()
        q = p.question_ids(case.question)
        full_ids = p.prompt_ids(list(case.chunks), case.question)

        def run(m: Method, kvs: Sequence[ChunkKV], full_ids: list[int] = full_ids, prefix_ids: list[int] = prefix_ids,
                q: list[int] = q) -> tuple[BlendResult, float]:
            t = time.perf_counter()
            res = engine.run(Prompt(full_ids), Mode.FULL) if m.mode is Mode.FULL else \
                engine.run(Prompt.of(prefix_ids, kvs, q), m.mode, options=m.options)
            res.logits.cpu()
            return res, time.perf_counter() - t

        ref, ref_s = run(Method("full", Mode.FULL), [])
        ref_answer, ref_tokens, ref_steps = decode_logged(engine, ref, params)
        ref_first = int(ref.logits.argmax())
        done: set[str] = set()
        row: dict = {"id": case.id, "answers": list(case.answers), "full_answer": ref_answer, "methods": {}}
        for v in variants:
            t = time.perf_counter()
            kvs = variant_kvs(engine, v, case)
            prefill_s = time.perf_counter() - t
            for m in methods:
                name = names[(m.name, v.name)]
                if name in done:  # full, once
                    continue
                done.add(name)
                res, secs = (ref, ref_s) if m.mode is Mode.FULL else run(m, kvs)
                refresh_s = 0.0
                if res is ref:
                    answer, tokens, steps = ref_answer, ref_tokens, ref_steps
                elif m.refresh is None:
                    answer, tokens, steps = decode_logged(engine, res, params)
                else:
                    answer, tokens, steps, refresh_s = refreshed(engine, m, res, prefix_ids, kvs, q, params)
                along = answer_kls(ref_tokens, ref_steps, tokens, steps)  # [K]
                head = first_sentence(answer)
                one = row["methods"][name] = {
                    "answer": answer, "acc": any(normalize(a) in normalize(head) for a in case.answers),
                    "f1": best_f1(head, case.answers), "agree": normalize(answer) == normalize(ref_answer),
                    "f1_vs_full": token_f1(answer, ref_answer), "first": int(res.logits.argmax()) == ref_first,
                    "kl": kl_divergence(ref.logits, res.logits), "kl_answer": statistics.fmean(along),
                    "kl_answer_max": max(along), "ttft_s": secs,
                    "kv_prefill_s": 0.0 if m.mode is Mode.FULL else prefill_s, "refresh_s": refresh_s,
                    "recompute_fraction": res.recompute_fraction,
                    "phases_s": {k: round(v, 4) for k, v in res.timings.items()},
                    "handed_over": res.handed_over, "used_chunks": res.used_chunks, "chunk_scores": res.chunk_scores}
                s, r = sums[name], reports[name]
                for key in ("acc", "f1", "agree", "f1_vs_full", "first", "kl", "kl_answer", "kl_answer_max",
                            "recompute_fraction"):
                    s[key] += one[key]
                r.n += 1
                r._ttfts.append(secs)
                r._prefills.append(one["kv_prefill_s"])
                r._refreshes.append(refresh_s)
        if on_case is not None:
            on_case(row)
        if after_case is not None:
            after_case(_finish(reports, sums))
    return _finish(reports, sums)


def decode_logged(engine: Engine, res: BlendResult, params: SamplingParams) -> tuple[str, list[int], list[torch.Tensor]]:
    """Decode greedily: (the answer, its token ids, the next-token logits [V] at each answer
    position: before each token, and after the last when the answer ended on EOS)."""
    stream = engine.decode(res, params)
    steps = [stream.logits.float().cpu()]
    receive = stream.receive

    def logged(logits: torch.Tensor) -> None:  # each forward step's logits, as the stream takes them
        receive(logits)
        steps.append(stream.logits.float().cpu())

    stream.receive = logged  # type: ignore[method-assign]
    answer = "".join(stream)
    return answer, list(stream.token_ids), steps


def refreshed(engine: Engine, m: Method, res: BlendResult, prefix_ids: Sequence[int], kvs: Sequence[ChunkKV],
              q: Sequence[int], params: SamplingParams) -> tuple[str, list[int], list[torch.Tensor], float]:
    """`m`'s answer refreshed (`Refresh`): its first `after` tokens decoded from `res`, then the
    prompt blended again at the refresh's ratio with them after the question, and the rest
    decoded from that. (answer, token ids, logits at each answer position as `decode_logged`
    gives them, the second pass's seconds); an answer that ends within `after` tokens is `res`'s."""
    assert m.refresh is not None
    after = m.refresh.after
    first = SamplingParams(max_new_tokens=min(after, params.max_new_tokens))
    head_text, head, head_steps = decode_logged(engine, res, first)
    if len(head) < after or after >= params.max_new_tokens:  # it ended (or is whole) before the refresh
        return head_text, head, head_steps, 0.0
    t = time.perf_counter()
    again = engine.run(Prompt.of(prefix_ids, kvs, [*q, *head]), m.mode,
                       options=dataclasses.replace(m.options, recompute_ratio=m.refresh.ratio))
    again.logits.cpu()
    secs = time.perf_counter() - t
    rest = SamplingParams(max_new_tokens=params.max_new_tokens - after)
    _, tail, tail_steps = decode_logged(engine, again, rest)
    tokens = [*head, *tail]
    return engine.lm.tokenizer.decode(tokens, skip_special_tokens=True), tokens, [*head_steps[:after], *tail_steps], secs


def answer_kls(ref_tokens: Sequence[int], ref_steps: Sequence[torch.Tensor], tokens: Sequence[int],
               steps: Sequence[torch.Tensor]) -> list[float]:
    """KL(full || method) at each answer position while the two answers agree, and at the one
    where they part: positions where both were fed the same tokens (at least the first)."""
    out = []
    for i in range(min(len(ref_steps), len(steps))):
        out.append(kl_divergence(ref_steps[i], steps[i]))
        if i >= len(ref_tokens) or i >= len(tokens) or ref_tokens[i] != tokens[i]:
            break  # they part here (a different token, or one ended)
    return out


def variant_kvs(engine: Engine, v: KVVariant, case: EvalCase) -> list[ChunkKV]:
    """The KV of each of `case`'s chunks as variant `v` computes it (the indexer's work)."""
    p = engine.prompt
    prefix_ids = p.prefix_ids()
    chunk_ids = [p.chunk_ids(c) for c in case.chunks]
    if v.context_kv is not None:
        stored = v.stored_plain or (lambda kv: kv)
        return [stored(engine.prefill(prefix_ids, ids)) if ctx is None else engine.prefill(prefix_ids, ids, context_kv=ctx)
                for ids, ctx in zip(chunk_ids, v.context_kv(case, prefix_ids))]
    contexts = v.context(case) if v.context is not None else [()] * len(chunk_ids)
    return [engine.prefill(prefix_ids, ids, ctx) for ids, ctx in zip(chunk_ids, contexts)]


def _finish(reports: dict[str, MethodReport], sums: dict[str, Counter]) -> dict[str, MethodReport]:
    """The means and medians of the cases run so far."""
    for name, r in reports.items():
        s = sums[name]
        if r.n:
            r.accuracy, r.f1, r.agreement = s["acc"] / r.n, s["f1"] / r.n, s["agree"] / r.n
            r.f1_vs_full, r.first_token_agreement = s["f1_vs_full"] / r.n, s["first"] / r.n
            r.kl_mean, r.recompute_fraction = s["kl"] / r.n, s["recompute_fraction"] / r.n
            r.kl_answer, r.kl_answer_max = s["kl_answer"] / r.n, s["kl_answer_max"] / r.n
            r.ttft_median_s = statistics.median(r._ttfts)
            r.kv_prefill_median_s = statistics.median(r._prefills)
            r.refresh_median_s = statistics.median(r._refreshes)
    return reports
