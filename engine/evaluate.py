"""Answer quality and TTFT of each blend method against full prefill of the same prompt.

For every case the chunk KVs are prefilled once (the indexer's work, not timed); each
method then runs the prompt and decodes greedily. Per method:
- accuracy:   an expected answer appears in the answer's first sentence;
- agreement:  the answer equals full prefill's answer (normalized);
- kl_mean:    KL(full || method) of the next-token distribution at the last prompt position;
- ttft_median_s: prompt processing up to the first token's logits;
- recompute_fraction: the mean share of chunk tokens recomputed.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ragkv.types import Mode
from ragkv.engine.blend import BlendOptions, BlendResult
from ragkv.engine.decode import SamplingParams
from ragkv.engine.runtime import Engine
from ragkv.engine.synthetic import EvalCase


@dataclass(frozen=True, slots=True)
class Method:
    """A named way of running the prompt."""

    name: str  # label in reports, e.g. "blend-query-0.30"
    mode: Mode
    options: BlendOptions = field(default_factory=BlendOptions)


@dataclass(slots=True)
class MethodReport:
    n: int = 0
    accuracy: float = 0.0
    agreement: float = 0.0
    kl_mean: float = 0.0
    ttft_median_s: float = 0.0
    recompute_fraction: float = 0.0
    _ttfts: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("_ttfts")
        return d


def normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


def first_sentence(text: str) -> str:
    text = " ".join(text.split())  # "is:\n\n4721." reads as one sentence
    m = re.search(r"[.!?](?!\d)", text)
    return text[: m.start()] if m else text


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the softmax distributions, in nats."""
    ref = torch.log_softmax(ref_logits.float(), -1)
    other = torch.log_softmax(logits.float(), -1)
    return float(torch.sum(ref.exp() * (ref - other)))


def evaluate(engine: Engine, cases: Iterable[EvalCase], methods: Sequence[Method],
             max_new_tokens: int = 24, progress: Callable[[Iterable], Iterable] = lambda x: x,
             ) -> dict[str, MethodReport]:
    """Run every method on every case; `full` is always run as the reference."""
    p = engine.prompt
    params = SamplingParams(max_new_tokens=max_new_tokens)
    reports = {m.name: MethodReport() for m in methods}
    sums: dict[str, dict[str, float]] = {m.name: {"acc": 0, "agr": 0, "kl": 0, "rf": 0} for m in methods}
    for case in progress(list(cases)):
        prefix_ids = p.prefix_ids()
        prefix = engine.prefix_kv(prefix_ids)
        kvs = engine.prefill_chunks(prefix_ids, [p.chunk_ids(c) for c in case.chunks])
        q = p.question_ids(case.question)
        full_ids = p.prompt_ids(list(case.chunks), case.question)

        def run(m: Method) -> tuple[BlendResult, float]:
            t = time.perf_counter()
            res = engine.full_prefill(full_ids) if m.mode is Mode.FULL else \
                engine.blend(prefix, kvs, q, mode=m.mode, options=m.options)
            res.logits.cpu()
            return res, time.perf_counter() - t

        ref, ref_s = run(Method("full", Mode.FULL))
        ref_answer = "".join(engine.decode(ref, params))
        for m in methods:
            res, secs = (ref, ref_s) if m.mode is Mode.FULL else run(m)
            answer = ref_answer if res is ref else "".join(engine.decode(res, params))
            s, r = sums[m.name], reports[m.name]
            head = normalize(first_sentence(answer))
            s["acc"] += any(normalize(a) in head for a in case.answers)
            s["agr"] += normalize(answer) == normalize(ref_answer)
            s["kl"] += kl_divergence(ref.logits, res.logits)
            s["rf"] += res.recompute_fraction
            r.n += 1
            r._ttfts.append(secs)
    for name, r in reports.items():
        s = sums[name]
        if r.n:
            r.accuracy, r.agreement = s["acc"] / r.n, s["agr"] / r.n
            r.kl_mean, r.recompute_fraction = s["kl"] / r.n, s["rf"] / r.n
            r.ttft_median_s = statistics.median(r._ttfts)
    return reports
