"""RULER-style synthetic RAG tasks, so anyone can check blend quality on their own model.

Haystack text is the Python standard library's own documentation (every machine has
it); needles are short facts with random keys and values. Tasks:
- niah:       one needle; ask for its value.
- multikey:   several needles with different keys; ask for one.
- multivalue: one key stated twice with two values; ask for either (both count).
- twohop:     key A points to key B, B holds the value; decoy chains beside it.
Pure text: nothing here imports torch.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass

TASKS = ("niah", "multikey", "multivalue", "twohop")
_MODULES = ("argparse", "collections", "json", "pathlib", "inspect", "statistics", "functools",
            "itertools", "subprocess", "threading", "asyncio", "logging", "datetime", "re", "csv",
            "sqlite3", "shutil", "tempfile", "dataclasses", "enum", "heapq", "random", "string")
_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
          "juniper", "kestrel", "lumen", "maple", "nickel", "onyx", "pepper", "quartz", "raven",
          "saffron", "tundra", "umber", "violet", "willow", "xenon", "yarrow", "zephyr")


@dataclass(frozen=True, slots=True)
class EvalCase:
    """One question over a fixed list of chunks."""

    id: str
    chunks: tuple[str, ...]  # context chunks, in prompt order
    question: str
    answers: tuple[str, ...]  # any of these in the answer's first sentence counts as correct


def haystack_paragraphs() -> list[str]:
    """Paragraphs of stdlib docstrings (module and public members), deterministic order."""
    return [p for name in _MODULES for p in module_paragraphs(name)]


def module_paragraphs(name: str) -> list[str]:
    """One stdlib module's docstring paragraphs (the module's, then its public classes' and
    functions'): one topic's text, in a vocabulary of its own."""
    mod = importlib.import_module(name)
    docs = [inspect.getdoc(mod) or ""]
    for attr in sorted(dir(mod)):
        if not attr.startswith("_"):
            obj = getattr(mod, attr, None)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                docs.append(inspect.getdoc(obj) or "")
    return [p.strip() for doc in docs for p in doc.split("\n\n") if len(p.strip()) > 80]


def make_cases(task: str, n: int, n_chunks: int, chunk_tokens: int,
               count_tokens: Callable[[str], int], seed: int = 0) -> list[EvalCase]:
    """Build n cases of `task`, each with n_chunks chunks of about chunk_tokens tokens."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if n < 1 or n_chunks < 1 or chunk_tokens < 32:
        raise ValueError(f"need n >= 1, n_chunks >= 1, chunk_tokens >= 32; got {n}, {n_chunks}, {chunk_tokens}")
    rng = random.Random(seed)
    paras = haystack_paragraphs()
    return [_case(task, f"{task}-{i}", rng, paras, n_chunks, chunk_tokens, count_tokens) for i in range(n)]


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}"


def _value(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _case(task: str, case_id: str, rng: random.Random, paras: list[str], n_chunks: int,
          chunk_tokens: int, count_tokens: Callable[[str], int]) -> EvalCase:
    key = _key(rng)
    value = _value(rng)
    if task == "niah":
        needles = [f"The secret code of the {key} vault is {value}."]
        question, answers = f"What is the secret code of the {key} vault?", (value,)
    elif task == "multikey":
        # the other keys in drawing order: a set's order follows the process's string hashing,
        # which would place the needles (and draw their codes) differently in every process
        others = [k for k in dict.fromkeys(_key(rng) for _ in range(4)) if k != key]
        needles = [f"The secret code of the {k} vault is {_value(rng)}." for k in others]
        needles.append(f"The secret code of the {key} vault is {value}.")
        question, answers = f"What is the secret code of the {key} vault?", (value,)
    elif task == "multivalue":
        second = _value(rng)
        needles = [f"One secret code of the {key} vault is {value}.",
                   f"Another secret code of the {key} vault is {second}."]
        question, answers = f"What is a secret code of the {key} vault?", (value, second)
    else:  # twohop
        middle = _key(rng)
        needles = [f"The {key} vault opens with the same code as the {middle} vault.",
                   f"The secret code of the {middle} vault is {value}."]
        for _ in range(2):  # decoy chains that share no key with the asked one
            a, b = _key(rng), _key(rng)
            needles += [f"The {a} vault opens with the same code as the {b} vault.",
                        f"The secret code of the {b} vault is {_value(rng)}."]
        question, answers = f"What is the secret code of the {key} vault?", (value,)
    chunks = _haystack(rng, paras, n_chunks, chunk_tokens, count_tokens)
    for needle in needles:
        i = rng.randrange(n_chunks)
        sentences = chunks[i].split(". ")
        at = rng.randrange(len(sentences) + 1)
        chunks[i] = ". ".join(sentences[:at] + [needle.rstrip(".")] + sentences[at:])
    return EvalCase(case_id, tuple(chunks), question, answers)


def _haystack(rng: random.Random, paras: list[str], n_chunks: int, chunk_tokens: int,
              count_tokens: Callable[[str], int]) -> list[str]:
    chunks = []
    for _ in range(n_chunks):
        text, start = "", rng.randrange(len(paras))
        j = start
        while True:
            nxt = (text + "\n\n" + paras[j % len(paras)]).strip()
            if text and count_tokens(nxt) > chunk_tokens:
                break
            text, j = nxt, j + 1
        chunks.append(text)
    return chunks
