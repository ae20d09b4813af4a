"""Question-answering datasets in CacheBlend's format, as eval cases (`ragkv eval --dataset`).

The format (CacheBlend's harness, e.g. shared/data/musique_dev.json): a JSON list of
`{"question": str, "answers": [str, ...], "ctxs": [{"title": str, "text": str}, ...]}`.
Each question becomes one case over its first `ctxs` passages, in file order; a
passage with a title reads "title\\ntext". The instruction before the passages is the
engine's system prompt; the question suffix is appended to every question.
"""

from __future__ import annotations

import json
from pathlib import Path

from ragkv.evals.synthetic import EvalCase

# CacheBlend's MuSiQue harness asks for a short answer before the passages and after the question
DEFAULT_INSTRUCTION = ("You will be asked a question after reading several passages. Answer the question "
                       "directly from the passages, in at most five words. Do not repeat the question.")
DEFAULT_QUESTION_SUFFIX = " Answer in at most five words."


def passage_text(ctx: dict) -> str:
    """One passage as a chunk's text."""
    title, text = str(ctx.get("title") or "").strip(), str(ctx["text"]).strip()
    return f"{title}\n{text}" if title else text


def load_dataset(path: Path, n: int | None = None, ctxs: int = 5,
                 question_suffix: str = DEFAULT_QUESTION_SUFFIX) -> tuple[list[EvalCase], list[str]]:
    """The first `n` questions of `path` as cases over their first `ctxs` passages.

    Returns:
        (cases, every distinct passage text of the file in file order): the second is
        what neighbour-conditioned KV chooses neighbours from.

    Raises:
        ValueError: the file is missing, not JSON, or a row lacks a field; the message
            names the file, the row and the field.
    """
    if ctxs < 1 or (n is not None and n < 1):
        raise ValueError(f"need --ctxs >= 1 and --n >= 1, got ctxs={ctxs}, n={n}")
    try:
        rows = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty JSON list of "
                         '{"question", "answers", "ctxs": [{"title", "text"}]}')
    cases: list[EvalCase] = []
    passages: dict[str, None] = {}
    for i, row in enumerate(rows):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        for name, kind in (("question", str), ("answers", list), ("ctxs", list)):
            if not isinstance(row.get(name), kind):
                raise ValueError(f"{where}: field {name!r} must be a {kind.__name__}, got {row.get(name)!r:.60}")
        if not row["question"].strip():
            raise ValueError(f"{where}: the question is empty")
        if not row["answers"] or not all(isinstance(a, str) for a in row["answers"]):
            raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
        texts = []
        for j, ctx in enumerate(row["ctxs"]):
            if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str) or not ctx["text"].strip():
                raise ValueError(f"{where}: ctxs[{j}] must be an object with a non-empty 'text'")
            texts.append(passage_text(ctx))
        passages.update(dict.fromkeys(texts))
        if n is not None and len(cases) >= n:
            continue  # later rows still give their passages to the neighbour pool
        if len(texts) < ctxs:
            raise ValueError(f"{where}: {len(texts)} passages, but --ctxs asks for {ctxs}")
        cases.append(EvalCase(f"q{i}", tuple(texts[:ctxs]), row["question"].strip() + question_suffix,
                              tuple(row["answers"])))
    if n is not None and len(cases) < n:
        raise ValueError(f"{path}: {len(cases)} questions, but --n asks for {n}")
    return cases, list(passages)
