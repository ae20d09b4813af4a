"""`ragkv eval --retrieval-only`: retrieval recall and MRR per search mode, no LLM decoding.

Questions come from a built index (``--index DIR --questions FILE.jsonl``) or from the
synthetic fact corpus here (``--synthetic facts``): many documents stating the same
kinds of facts (code, owner, start date, site, budget) about differently named
items, so a question is answerable only by the chunk that names its item. The
wording of documents and questions changes with the seed.

A question counts as recalled when some retrieved chunk contains one of its
expected answers (case-insensitive); MRR is the mean of 1 / rank of the first such chunk.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SYLLABLES = ("ka", "lo", "mir", "ten", "vas", "dor", "pel", "quin", "ras", "sol", "tur", "ve", "zan", "bri",
              "cor", "del", "fen", "gal", "hol", "jun", "lin", "mor", "nes", "or", "pra", "sel", "tam", "ul")
_FIRST = ("Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
          "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wei", "Yara")
_LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Haddad", "Silva", "Kowalski", "Nguyen", "Adeyemi",
         "Rossi", "Petrov", "Khan", "Müller", "Garcia", "Ibrahim", "Larsen", "Sato", "Dubois", "Mensah")
_SITES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Denver", "Tallinn", "Porto", "Hanoi", "Quito", "Lyon")
_KINDS = ("project", "service", "pipeline", "device", "program")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")

# (sentence templates for documents, question templates) per fact; one of each is drawn per seed
_FACTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "code": (("The {kind} {name} is tracked under code {code}.", "{Name}'s tracking code is {code}.",
              "Internally, {kind} {name} goes by the code {code}."),
             ("What is the tracking code of {kind} {name}?", "Which code is {kind} {name} tracked under?",
              "Give the internal code for the {name} {kind}.")),
    "owner": (("Its owner is {owner}.", "{owner} is responsible for {name}.", "{name} is owned by {owner}."),
              ("Who owns the {kind} {name}?", "Who is responsible for {kind} {name}?",
               "Name the owner of {name}.")),
    "date": (("Work on {name} started on {date}.", "{name} began on {date}.", "The start date of {name} was {date}."),
             ("When did {kind} {name} start?", "On what date did work on {name} begin?",
              "What was the start date of the {name} {kind}?")),
    "site": (("The team behind {name} sits in {site}.", "{name} is run from the {site} office.",
              "Its home site is {site}."),
             ("Which office runs {kind} {name}?", "Where is the team of {name} based?",
              "From which site is {name} run?")),
}


@dataclass(frozen=True, slots=True)
class FactCase:
    """One question of the fact corpus."""

    id: str  # question id
    question: str  # names one item
    answers: tuple[str, ...]  # any of these in a retrieved chunk counts


def _name(rng: random.Random, bases: list[str], taken: set[str]) -> str:
    """A new item name: one of a few shared bases plus a number ("Korlin-47"), so that names
    differ only in the identifier, as product and project names often do."""
    while True:
        name = f"{rng.choice(bases)}-{rng.randint(10, 99)}"
        if name not in taken:
            taken.add(name)
            return name


def fact_corpus(n_docs: int = 40, n_questions: int = 20, seed: int = 0) -> tuple[list[dict], list[FactCase]]:
    """Documents (JSONL rows with typed metadata) and questions of the synthetic fact corpus.

    Raises:
        ValueError: fewer than 2 documents, or more questions than facts.
    """
    if n_docs < 2:
        raise ValueError(f"the fact corpus needs at least 2 documents, got {n_docs}")
    if n_questions > n_docs * len(_FACTS):
        raise ValueError(f"{n_questions} questions but only {n_docs * len(_FACTS)} facts: add documents")
    rng = random.Random(seed)
    doc_tpl = {k: rng.choice(v[0]) for k, v in _FACTS.items()}
    q_tpl = {k: rng.choice(v[1]) for k, v in _FACTS.items()}
    kind = rng.choice(_KINDS)
    prefix = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2))
    taken: set[str] = set()
    bases = sorted({"".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize() for _ in range(max(2, n_docs // 8))})
    docs, items = [], []
    for i in range(n_docs):
        name = _name(rng, bases, taken)
        year = rng.randint(2015, 2025)
        item = {
            "name": name, "Name": name, "kind": kind,
            "code": f"{prefix}-{rng.randint(1000, 9999)}",
            "owner": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
            "date": f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {year}",
            "site": rng.choice(_SITES),
        }
        order = list(_FACTS)
        rng.shuffle(order)
        text = " ".join(doc_tpl[k].format(**item) for k in order)
        text = f"{kind.capitalize()} {name}. " + text[0].upper() + text[1:]
        docs.append({"id": f"item-{i:03d}", "text": text,
                     "metadata": {"item": name, "year": year, "site": item["site"], "rank": i}})
        items.append(item)
    facts = [(i, k) for i in range(n_docs) for k in _FACTS]
    rng.shuffle(facts)
    cases = []
    for j, (i, k) in enumerate(facts[:n_questions]):
        item = items[i]
        cases.append(FactCase(f"q{j:02d}-{k}", q_tpl[k].format(**item), (item[k],)))
    return docs, cases


def load_questions(path: Path) -> list[FactCase]:
    """``{"id", "question", "answer"}`` lines (``answer`` a string or a list of strings)."""
    cases = []
    for i, line in enumerate(Path(path).read_text("utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            answers = row["answer"]
            answers = tuple(str(a) for a in answers) if isinstance(answers, list) else (str(answers),)
            cases.append(FactCase(str(row.get("id", i)), row["question"], answers))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{i + 1}: expected {{\"id\", \"question\", \"answer\"}}: {exc}") from None
    return cases


def score_modes(retriever: Any, cases: Sequence[FactCase], top_k: int, modes: Sequence[str],
                rerank: bool) -> dict[str, dict[str, Any]]:
    """retrieval_recall and mrr at ``top_k`` for each search mode (plus ``reranked`` when asked)."""
    runs = [(m, m, False) for m in modes]
    if rerank:
        runs.append(("reranked", "hybrid", True))
    out: dict[str, dict[str, Any]] = {}
    for name, mode, use_reranker in runs:
        recalled, rr, missed = 0, 0.0, []
        for case in cases:
            hits = retriever.search(case.question, top_k, mode=mode, rerank=use_reranker)
            rank = next((i + 1 for i, h in enumerate(hits)
                         if any(a.lower() in h.text.lower() for a in case.answers)), None)
            if rank is None:
                missed.append(case.id)
            else:
                recalled += 1
                rr += 1.0 / rank
        n = max(1, len(cases))
        out[name] = {"retrieval_recall": recalled / n, "mrr": rr / n, "n": len(cases), "top_k": top_k,
                     "missed": missed}
    return out


def build_fact_index(docs: list[dict], root: Path, model: str, progress: bool) -> Path:
    """Index the fact documents (chunks and vectors only, no KV) under ``root``."""
    from ragkv.indexer.job import IndexJobConfig, run_index

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "facts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), "utf-8")
    out = root / "index"
    run_index(IndexJobConfig(corpus=corpus, out=out, model=model, precompute_kv=False, progress=progress))
    return out


def run_retrieval_eval(args: Any) -> dict[str, Any]:
    """The JSON object `ragkv eval --retrieval-only` prints."""
    from ragkv.retriever import Retriever
    from ragkv.retriever.fusion import FusionConfig

    modes = [m.strip() for m in args.search_modes.split(",") if m.strip()]
    reranker = None
    if args.reranker:
        from ragkv.retriever.rerank import Reranker

        reranker = Reranker.load(args.reranker)
    fusion = FusionConfig(method=args.fusion, dense_weight=args.dense_weight, lexical_weight=args.lexical_weight)
    with tempfile.TemporaryDirectory(prefix="ragkv-facts-") as tmp:
        if args.synthetic:
            if args.synthetic != "facts":
                raise ValueError(f"--retrieval-only --synthetic takes 'facts', got {args.synthetic!r}")
            docs, cases = fact_corpus(args.docs, args.n, args.seed)
            index = build_fact_index(docs, Path(tmp), args.model, progress=not args.json)
            source = {"synthetic": "facts", "docs": len(docs), "questions": len(cases), "seed": args.seed}
        else:
            if not args.questions:
                raise ValueError("--index needs --questions FILE.jsonl")
            index, cases = args.index, load_questions(args.questions)
            source = {"index": str(args.index), "questions": str(args.questions)}
        with Retriever.open(index, fusion=fusion, reranker=reranker) as r:
            top_k = min(args.top_k, len(r))
            result = score_modes(r, cases, top_k, modes, rerank=reranker is not None)
    return {"retrieval": result, "source": source,
            "fusion": {"method": fusion.method.value, "dense_weight": fusion.dense_weight,
                       "lexical_weight": fusion.lexical_weight, "rrf_k": fusion.rrf_k}}
