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
    system_prompt: str | None = None  # the chat template's system prompt (None: no template)
    system_in_user: bool = False  # the template has no system role: the prompt opens the first user turn

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> PromptFormat:
        if getattr(tokenizer, "chat_template", None):
            head, tail, in_user = render_around_slot(tokenizer, system_prompt)
            return cls(tokenizer, head + "Context:\n", tail, add_bos=False, system_prompt=system_prompt,
                       system_in_user=in_user)
        return cls(tokenizer, f"{system_prompt}\n\nContext:\n", "\nAnswer:", add_bos=True)

    def with_system(self, system_prompt: str) -> PromptFormat:
        """This layout with another system prompt (a request's own instructions): the same
        tokenizer, so every chunk's tokens are the same; only the prefix differs."""
        return PromptFormat.for_tokenizer(self.tokenizer, system_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer_header_tokens(self, question_ids: Sequence[int]) -> int:
        """How many of a question segment's last tokens are `tail` (the end of the user's turn
        and the start of the answer's): the next call of a conversation shares the tokens
        before them, not them. 0 when the segment does not end with `tail` tokenized alone."""
        tail = self._ids(self.tail)
        n = len(tail)
        return n if 0 < n <= len(question_ids) and list(question_ids[-n:]) == tail else 0

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

    def turn_ids(self, question: str, history: Sequence[tuple[str, str]] = (), before: str = "",
                 agent: Sequence[tuple[str, str]] = ()) -> list[int] | None:
        """The question segment of a conversation in the chat template's own turns.

        The first user turn holds the context (the prefix ends inside it, the chunks follow),
        then its first message; the earlier turns, the question (after `before`) and the
        agent's turns since it (assistant calls, tool results) follow as the template renders
        them, and the segment ends where the answer starts. Each turn is tokenized on its
        own, and an assistant turn's header apart from its text, so a call's prompt followed
        by its answer is a token prefix of the next call's (the KV tree reuses it). An earlier
        user turn renders as it did when it was the question (`before`, then `Question: `),
        so a follow-up question's segment begins with the earlier calls' too.

        Args:
            history: earlier turns, oldest first, (role, text), role user, assistant or tool;
                the first is the user's.
            before: text before the question in its turn (tools, the answer's format).
            agent: the turns since the question: the assistant's calls and the tools' results.

        Returns:
            The tokens; None for a single question (`question_ids` lays it out), a tokenizer
            without a chat template, or a template that cannot render these turns (the caller
            falls back to `question_ids`).
        """
        if not question.strip():
            raise ValueError("question is empty")
        if (not history and not agent) or not getattr(self.tokenizer, "chat_template", None):
            return None
        asked = [(r, f"{before}Question: {t.strip()}" if r == "user" else t) for r, t in history]
        turns = [*asked, ("user", f"{before}Question: {question.strip()}"), *agent]
        if turns[0][0] != "user":
            return None
        for tool_role in ("tool", "user"):  # a template without a tool role shows results as the user's
            texts = self._render_turns([(tool_role if r == "tool" else r, t.strip()) for r, t in turns])
            if texts is not None:
                break
        else:
            return None
        ids: list[int] = []
        for text in texts:
            ids += self._ids(text)
        return ids

    def _render_turns(self, turns: list[tuple[str, str]]) -> list[str] | None:
        """The text of each turn after the context slot, and of each assistant turn's header
        apart, and the answer's header last; None when the template refuses the turns or
        renders a conversation as other than its earlier turns followed by the new one."""
        def render(n: int, generation: bool) -> str:
            msgs = [{"role": r, "content": (_SLOT + t) if i == 0 else t} for i, (r, t) in enumerate(turns[:n])]
            if self.system_prompt is not None:
                msgs = self._with_system(msgs, self.system_prompt)
            text: str = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)
            return text

        try:
            full = [render(n, False) for n in range(1, len(turns) + 1)]
            headed = [render(n, True) for n in range(1, len(turns) + 1)]
        except Exception:  # jinja2's TemplateError and the template's own raise_exception
            return None
        if _SLOT not in full[0] or full[0].split(_SLOT)[0] + "Context:\n" != self.head:
            return None
        texts = [full[0].split(_SLOT, 1)[1]]
        for n in range(1, len(turns)):
            prev, cur, header = full[n - 1], full[n], headed[n - 1]
            if not cur.startswith(prev):
                return None
            new = cur[len(prev):]
            gp = header[len(prev):] if header.startswith(prev) else ""
            if turns[n][0] == "assistant" and gp and new.startswith(gp):
                texts += [gp, new[len(gp):]]  # the answer's header, then what the answer was
            else:
                texts.append(new)
        if not headed[-1].startswith(full[-1]):
            return None
        texts.append(headed[-1][len(full[-1]):])
        return texts

    def _with_system(self, msgs: list[dict[str, str]], system: str) -> list[dict[str, str]]:
        """The messages under the index's system prompt `system`, as `render_around_slot` placed it."""
        if self.system_in_user:
            first = dict(msgs[0], content=f"{system}\n\n{msgs[0]['content']}")
            return [first, *msgs[1:]]
        return [{"role": "system", "content": system}, *msgs]

    def prompt_ids(self, chunks: list[str], question: str, history: Sequence[tuple[str, str]] = ()) -> list[int]:
        """The whole prompt as `full` mode sees it: exactly the concatenated segments."""
        ids = self.prefix_ids()
        for text in chunks:
            ids += self.chunk_ids(text)
        return ids + self.question_ids(question, history)


def render_around_slot(tokenizer: Any, system_prompt: str) -> tuple[str, str, bool]:
    """The chat template's text before and after the user turn's content, and whether the
    system prompt went into the user turn.

    A template without a system role (Gemma 1 and 2 raise on one) gets the system prompt
    folded into the first user turn, as Gemma 3's own template does.
    """
    turns = [{"role": "system", "content": system_prompt}, {"role": "user", "content": _SLOT}]
    in_user = False
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's TemplateError, raised by the template itself
        if "system" not in str(exc).lower():
            raise
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{system_prompt}\n\n{_SLOT}"}],
                                             tokenize=False, add_generation_prompt=True)
        in_user = True
    head, tail = text.split(_SLOT)
    return head, tail, in_user


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
