"""The built-in demo corpus: documentation of a dozen standard-library modules.

Every Python has it, so ``ragkv index demo --out DIR`` works offline anywhere. Each
module becomes one ``.txt`` file: its docstring, then the first paragraph of the
docstring of each public function and class (up to ``MAX_MEMBER_CHARS``), capped at ``MAX_CHARS`` so the
demo stays at about 60 chunks of 512 tokens (a few minutes of KV precompute on
two CPU cores). The text depends on the Python version, which is fine for a demo.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

DEMO_MODULES = (
    "json", "csv", "heapq", "bisect", "itertools", "functools", "collections", "pathlib",
    "datetime", "random", "statistics", "textwrap", "shutil", "sqlite3", "re", "string",
    "enum", "contextlib", "operator", "fractions", "tempfile",
)
MAX_CHARS = 8_000  # characters per module file: ~2,000 tokens, ~4 chunks
MAX_MEMBER_CHARS = 1_200  # characters of one function's or class's docstring


def module_text(name: str, max_chars: int = MAX_CHARS) -> str:
    """Documentation text of one module: its docstring and its members' first paragraphs."""
    mod = importlib.import_module(name)
    parts = [f"Python module {name}.", inspect.cleandoc(mod.__doc__ or "")]
    public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for member in sorted(public):
        obj = getattr(mod, member, None)
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        doc = inspect.getdoc(obj)
        if not doc:
            continue
        parts.append(f"{name}.{member}: {doc[:MAX_MEMBER_CHARS].strip()}")
    text = "\n\n".join(p for p in parts if p)
    if len(text) > max_chars:
        cut = text.rfind("\n\n", 0, max_chars)
        text = text[: cut if cut > 0 else max_chars]
    return text + "\n"


def build_demo_corpus(dest: str | Path, modules: tuple[str, ...] = DEMO_MODULES) -> Path:
    """Write one ``<module>.txt`` per module into ``dest`` (rewriting only changed files)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in modules:
        path = dest / f"{name}.txt"
        text = module_text(name)
        if not path.exists() or path.read_text("utf-8") != text:
            path.write_text(text, "utf-8")
    return dest
