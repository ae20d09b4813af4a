"""Calibration: how far blend is from full prefill on an index's own corpus, at each setting.

One recompute ratio does not serve every model and corpus: the same ratio sits at KL 0.020
from full prefill on one model and 0.028 on another (docs/quality.md). So `ragkv index`
measures it, on the corpus it serves, with no question from anyone:

1. **Chunk sets** like the ones retrieval makes: a seed chunk and its nearest chunks by the
   index's own embeddings (`CHUNKS_PER_SET`, the server's default top_k), in a shuffled order,
   so the chunk a question is about sits anywhere in the prompt.
2. **Questions from the chunks, of two kinds**, one kind to a set, in turn: "Who or what is
   NAME?", NAME a name or number of the seed chunk (`entity_question`), and a sentence of the
   seed chunk with its key words blanked (`cloze`). Answering either needs the chunks' own
   tokens, as a real question's answer does. No one kind predicts every model: on held-out
   MuSiQue questions the cloze's KL is SmolLM2's and a third of Gemma's, the entity question's
   Gemma's and a third of SmolLM2's (docs/quality.md). So each setting's predicted KL is the
   worse kind's mean: the kind of question blend serves worst on this model and corpus.
3. **Each setting against full prefill** of the same prompt: next-token KL at the answer's
   first position (the figure `ragkv eval` reports), and whether the first token agrees;
   per setting, the mean, spread and worst of the kind whose mean is the higher.
   The chunks' KV is the KV the server reads: the plain copy for the first chunk and
   neighbour KV after it, as stored, compressed or not (`indexer.job`'s `_calibrate`).

The sample is fixed by its seed, so indexing the same corpus again gives the same sets,
questions and choice. It is sized to a few percent of a large index's own work
(`sample_size`; at least 4 sets, which is +49% on the demo's 54 chunks). The result goes
into the manifest (`retriever.manifest.Calibration`), and `ragkv serve` serves the cheapest
setting whose predicted KL meets `--fidelity-kl`.
How well it predicts KL on held-out questions: `ragkv eval --calibration`, docs/quality.md.
"""

from __future__ import annotations

import math
import random
import re
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragkv.retriever.manifest import CalibratedSetting, Calibration

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ragkv.engine import Engine
    from ragkv.engine.kv.cache import ChunkKV

METHOD = "entity+cloze"  # the question kinds (`QUESTIONS`), one to a set in turn; "cloze" alone was the first
SEED = 0
RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)  # the recompute ratios measured (query selector)
SELECTOR = "query"
CHUNKS_PER_SET = 4  # chunks in each set: the server's default top_k
MIN_SETS, MAX_SETS = 4, 32
# sets per chunk of the index: a set (full prefill of its 4 chunks, then a blend at each ratio) costs
# about 4.5 chunks' indexing (the demo's index, SmolLM2 on 2 cores: 8 s a set, 1.76 s a chunk with
# neighbour KV), so 1 set per 100 chunks is about 5% of a large index's time; a small corpus still
# gets MIN_SETS (docs/quality.md: smaller samples predict nothing)
SETS_PER_CHUNK = 0.01
REDRAWS = 4  # a set whose seed gives no question is drawn again, up to this many times the sample in all
BLANK = "____"
ENTITY_QUESTION = "Who or what is {name}? Answer in at most five words."

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"\S+")
_KEY = re.compile(r"^[\"'(\[]*([A-Z][\w'-]*|\d[\d,.:/-]*)[\"')\],;:.!?]*$")  # a capitalized word or a number
# `_KEY`'s word for `key_terms`: its punctuation captured (a run of terms ends there), a number ending in a digit
_TERM = re.compile(r"^[\"'(\[]*([A-Z][\w'-]*|\d[\d,.:/-]*\d|\d)([\"')\],;:.!?]*)$")


@dataclass(frozen=True, slots=True)
class CalibrationSet:
    """One prompt of the sample: chunks with the KV the server reads for them, and a question."""

    chunk_ids: tuple[tuple[int, ...], ...]  # each chunk's token ids, in prompt order
    kvs: tuple[ChunkKV, ...]  # each chunk's KV as served (plain first chunk, neighbour KV after)
    question: str  # made from the seed chunk
    kind: str = "entity"  # the question's kind (`QUESTIONS`): the settings' KL is the worse kind's mean


def sample_size(n_chunks: int) -> int:
    """Chunk sets to measure for an index of `n_chunks` chunks: a few percent of its prefill work."""
    return max(MIN_SETS, min(MAX_SETS, round(n_chunks * SETS_PER_CHUNK)))


def cloze(text: str, rng: random.Random) -> str | None:
    """A fill-in-the-blank question from a chunk: one of its sentences of 8 to 40 words, chosen by
    `rng`, with its key words blanked: the last run of capitalized words or numbers after its
    first word (a name, a date), else its last word. None when no sentence fits."""
    sentences = [s for s in _SENTENCE.split(" ".join(text.split())) if 8 <= len(s.split()) <= 40]
    if not sentences:
        return None
    words = [m.group() for m in _WORD.finditer(rng.choice(sentences))]
    keys = [i for i in range(1, len(words)) if _KEY.match(words[i])]
    if keys:
        end = keys[-1] + 1
        start = keys[-1]
        while start - 1 in keys:
            start -= 1
    else:
        start, end = len(words) - 1, len(words)
    tail = re.sub(r"^.*?([,;:.!?\"')\]]*)$", r"\1", words[end - 1])  # the blank keeps its punctuation
    masked = " ".join([*words[:start], BLANK + tail, *words[end:]])
    return f'Fill in the blank ({BLANK}) with the words the passages use: "{masked}"'


def key_terms(text: str) -> list[str]:
    """The names and numbers `text` holds, in order and once each: runs of capitalized words and
    numbers inside a sentence (not its first word), a run ending at punctuation; terms of 3
    characters or fewer left out (a year stays, "He" does not)."""
    out: list[str] = []
    for sentence in _SENTENCE.split(" ".join(text.split())):
        run: list[str] = []
        for i, word in enumerate(sentence.split()):
            m = _TERM.match(word) if i > 0 else None
            if m is not None:
                run.append(m.group(1))
            if run and (m is None or m.group(2)):  # the run ends here
                out.append(" ".join(run))
                run = []
        if run:
            out.append(" ".join(run))
    return [t for t in dict.fromkeys(out) if len(t) > 3]


def entity_question(text: str, rng: random.Random) -> str | None:
    """A question about a name or number of the chunk (`key_terms`, one chosen by `rng`): "Who or
    what is TERM?", with the answer's length asked as the eval's questions ask it. None when the
    chunk holds none. Its answer is not a copy of the chunk's words around the term, as a cloze's
    is: the model must find the term and say what the passages make of it."""
    found = key_terms(text)
    return ENTITY_QUESTION.format(name=rng.choice(found)) if found else None


QUESTIONS: dict[str, Callable[[str, random.Random], str | None]] = {"entity": entity_question, "cloze": cloze}


def chunk_sets(xb: np.ndarray, n_sets: int, k: int = CHUNKS_PER_SET, seed: int = SEED) -> list[tuple[int, list[int]]]:
    """`n_sets` chunk sets over the rows of `xb` ([n, d] embeddings), each (seed row, its k rows in
    prompt order): the seed (its question is made from it) and its k - 1 most similar rows, in an
    order `seed` fixes. Seeds are distinct rows drawn at random; fewer than k rows give no set."""
    import numpy as np

    n = xb.shape[0]
    if n < k or n_sets < 1:
        return []
    norm = _unit(xb)
    rng = np.random.default_rng(seed)
    return [_set_of(norm, s, k, rng) for s in rng.choice(n, size=min(n_sets, n), replace=False).tolist()]


def spare_sets(xb: np.ndarray, taken: set[int], k: int = CHUNKS_PER_SET,
               seed: int = SEED) -> Iterator[tuple[int, list[int]]]:
    """More chunk sets, as `chunk_sets` makes them, seeded by the rows not in `taken`, in an order
    `seed` fixes (a stream of its own: `chunk_sets`' draws stay as they are). Lazy: a set's
    similarities are computed when it is asked for."""
    import numpy as np

    n = xb.shape[0]
    if n < k:
        return
    norm = _unit(xb)
    rng = np.random.default_rng([seed, 1])
    for s in rng.permutation(n).tolist():
        if s not in taken:
            yield _set_of(norm, s, k, rng)


def _unit(xb: np.ndarray) -> np.ndarray:
    import numpy as np

    return xb / np.maximum(np.linalg.norm(xb, axis=1, keepdims=True), 1e-12)


def _set_of(norm: np.ndarray, s: int, k: int, rng: np.random.Generator) -> tuple[int, list[int]]:
    """The set seeded by row `s` of `norm` ([n, d], unit rows): `s` and its k - 1 nearest rows,
    in an order `rng` draws."""
    import numpy as np

    sims = norm @ norm[s]  # [n]
    sims[s] = np.inf  # the seed, then the nearest
    rows = np.argsort(-sims, kind="stable")[:k]
    return s, rows[rng.permutation(k)].tolist()


def sample_prompts(xb: np.ndarray, n_sets: int, text_of: Callable[[int], str],
                   method: str = METHOD) -> list[tuple[list[int], str, str]]:
    """The sample: `n_sets` chunk sets over the rows of `xb` (`chunk_sets`), each (its rows in prompt
    order, a question made from its seed row's text `text_of(row)`, the question's kind). The kinds
    of `method` ("entity+cloze": `QUESTIONS`' names joined by "+") take the sets in turn. A set whose
    seed gives its kind no question (a chunk with no name or number, or no sentence to blank) gives
    way to a set drawn from the other rows (`spare_sets`), asked the same kind, up to `REDRAWS` x
    `n_sets` draws in all: the kinds keep their shares of the sample. Fixed by `SEED`: the index and
    `ragkv eval --calibration` draw alike."""
    kinds = method.split("+")
    if unknown := [k for k in kinds if k not in QUESTIONS]:
        raise ValueError(f"unknown calibration question kind {unknown[0]!r}: the kinds are {', '.join(QUESTIONS)}")
    rng = random.Random(SEED)
    first = chunk_sets(xb, n_sets, CHUNKS_PER_SET, SEED)
    spare = spare_sets(xb, {s for s, _ in first}, CHUNKS_PER_SET, SEED)
    redraws = REDRAWS * n_sets
    out = []
    for i, (seed, rows) in enumerate(first):
        kind = kinds[i % len(kinds)]
        question = QUESTIONS[kind](text_of(seed), rng)
        while question is None and redraws > 0 and (drawn := next(spare, None)) is not None:
            redraws -= 1
            seed, rows = drawn
            question = QUESTIONS[kind](text_of(seed), rng)
        if question is not None:
            out.append((rows, question, kind))
    return out


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the softmax distributions, in nats."""
    import torch

    ref = torch.log_softmax(ref_logits.float(), -1)
    other = torch.log_softmax(logits.float(), -1)
    return float(torch.sum(ref.exp() * (ref - other)))


def measure(engine: Engine, sets: Sequence[CalibrationSet], ratios: Sequence[float] = RATIOS, *,
            seed: int = SEED, method: str = METHOD,
            progress: Callable[[Iterable], Iterable] = lambda x: x) -> Calibration:
    """Blend at each ratio (query selector) against full prefill of the same prompt, on every set.

    Returns:
        The calibration: per ratio, the mean KL and its standard error over the sets of the
        question kind whose mean is the higher (`CalibrationSet.kind`; one kind: every set), the
        worst set's KL, the first-token agreement and the median prompt time over every set;
        full prefill's median time.
    """
    from ragkv.engine.blend import BlendOptions, Prompt
    from ragkv.types import Mode

    if not sets:
        raise ValueError("calibration needs at least one chunk set")
    prefix_ids = engine.prompt.prefix_ids()
    kls: dict[tuple[float, str], list[float]] = {}  # (ratio, question kind) -> each set's KL
    agree: dict[float, list[bool]] = {r: [] for r in ratios}
    secs: dict[float, list[float]] = {r: [] for r in ratios}
    full_s: list[float] = []

    def timed(prompt: Prompt, mode: Mode, options: BlendOptions | None = None):
        t = time.perf_counter()
        res = engine.run(prompt, mode, options=options)
        logits = res.logits.float().cpu()  # [V]
        return logits, time.perf_counter() - t

    for one in progress(list(sets)):
        q = engine.prompt.question_ids(one.question)
        ref, t = timed(Prompt([*prefix_ids, *(t for ids in one.chunk_ids for t in ids), *q]), Mode.FULL)
        full_s.append(t)
        for r in ratios:
            logits, t = timed(Prompt.of(prefix_ids, one.kvs, q), Mode.BLEND, BlendOptions(recompute_ratio=r))
            kls.setdefault((r, one.kind), []).append(max(0.0, kl_divergence(ref, logits)))
            agree[r].append(int(logits.argmax()) == int(ref.argmax()))
            secs[r].append(t)
    n = len(sets)

    def setting(r: float) -> CalibratedSetting:
        worse = max((v for (ratio, _), v in kls.items() if ratio == r), key=statistics.fmean)  # the worse kind's
        every = [x for (ratio, _), v in kls.items() if ratio == r for x in v]
        return CalibratedSetting(
            recompute_ratio=float(r), selector=SELECTOR, kl_mean=statistics.fmean(worse),
            kl_stderr=statistics.stdev(worse) / math.sqrt(len(worse)) if len(worse) > 1 else 0.0, kl_max=max(every),
            top_token_agreement=sum(agree[r]) / n, seconds_median=statistics.median(secs[r]))

    settings = tuple(setting(r) for r in sorted(ratios))
    return Calibration(method, seed, n, len(sets[0].chunk_ids), statistics.median(full_s), settings)
