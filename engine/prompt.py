"""How a RAG prompt is laid out in tokens: `[prefix][chunk]...[chunk][question]`.

The indexer and the server must tokenize chunks identically, or stored KV would not
match the tokens served: both call `PromptFormat.chunk_ids`. Each segment is
tokenized on its own, so a chunk's ids never depend on its neighbours.

The system prompt is the index's (`ragkv index --system-prompt`): it is in the prefix,
so every chunk's KV (and key) depends on it. Earlier turns of a conversation go in the
question segment, after the chunks and before the question, so they are always
computed fresh and never change a chunk's cached KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the context. "
    "Answer briefly, in one sentence."
)
_SLOT = "\x00RAGKV_CONTEXT\x00"


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """Text around the chunks; the chat template decides it when the tokenizer has one."""

    tokenizer: Any
    head: str  # text before the first chunk (system turn, start of the user turn)
    tail: str  # text after the question (end of the user turn, start of the assistant's)
    add_bos: bool  # prepend the tokenizer's BOS id to the prefix

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> PromptFormat:
        if getattr(tokenizer, "chat_template", None):
            head, tail = render_around_slot(tokenizer, system_prompt)
            return cls(tokenizer, head + "Context:\n", tail, add_bos=False)
        return cls(tokenizer, f"{system_prompt}\n\nContext:\n", "\nAnswer:", add_bos=True)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self) -> list[int]:
        """The shared prefix every chunk is prefilled after."""
        bos = self.tokenizer.bos_token_id
        return ([bos] if self.add_bos and bos is not None else []) + self._ids(self.head)

    def chunk_ids(self, text: str) -> list[int]:
        """One chunk's tokens, separated from the next by a blank line."""
        if not text.strip():
            raise ValueError("chunk text is empty")
        return self._ids(text.strip() + "\n\n")

    def question_ids(self, question: str, history: Sequence[tuple[str, str]] = (), before: str = "",
                     after: str = "") -> list[int]:
        """The earlier turns, the question and everything up to where the answer starts.

        Args:
            question: The question.
            history: Earlier turns, oldest first, as (role, text) with role "user", "assistant" or "tool".
            before: Text between the earlier turns and the question (tools, the answer's format).
            after: Text between the question and the answer (tool calls made for it, their results).
        """
        if not question.strip():
            raise ValueError("question is empty")
        return self._ids(f"{history_text(history)}{before}Question: {question.strip()}{after}{self.tail}")

    def prompt_ids(self, chunks: list[str], question: str, history: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The whole prompt as `full` mode sees it: exactly the concatenated segments."""
        ids = self.prefix_ids()
        for text in chunks:
            ids += self.chunk_ids(text)
        return ids + self.question_ids(question, history)


def render_around_slot(tokenizer: Any, system_prompt: str) -> tuple[str, str]:
    """The chat template's text before and after the user turn's content.

    A template without a system role (Gemma 1 and 2 raise on one) gets the system prompt
    folded into the first user turn, as Gemma 3's own template does.
    """
    turns = [{"role": "system", "content": system_prompt}, {"role": "user", "content": _SLOT}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's TemplateError, raised by the template itself
        if "system" not in str(exc).lower():
            raise
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{system_prompt}\n\n{_SLOT}"}],
                                             tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_SLOT)
    return head, tail


_SPEAKER = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def history_text(history: Sequence[tuple[str, str]]) -> str:
    """Earlier turns as text placed between the chunks and the question ("" when none)."""
    if not history:
        return ""
    lines = []
    for role, text in history:
        if role not in _SPEAKER:
            raise ValueError(f"history role must be user, assistant or tool, got {role!r}")
        lines.append(f"{_SPEAKER[role]}: {text.strip()}")
    return "Earlier in this conversation:\n" + "\n".join(lines) + "\n\n"
