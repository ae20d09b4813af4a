"""Grammar-constrained decoding: a per-request token mask over the logits (llguidance).

A `Constraint` follows one request's output through its grammar: before each token is
picked, the tokens the grammar cannot take next get -inf; after it is picked, the
grammar consumes it. The mask for the next token is computed on a worker thread while
the model's forward step runs (llguidance releases the GIL), so in a batch it costs
the step only what is left of it when the logits are ready.

A structured answer (JSON, tool calls) must also end within `max_new_tokens`, or it does
not parse. In its last tokens (`closing_window`: a quarter of the budget, at least
CLOSING_WINDOW) a constraint made with `closing=True` prefers, among the tokens its
grammar admits, those that close what is open: inside a JSON string a token that starts
with its closing quote; outside one a token that starts with a brace or bracket, or
end-of-sequence, else one that starts with a comma (on to the next required key). Where
the grammar admits none of them, the model picks freely. A weak model looping inside a
string or a list is so made to close it; one that is not looping has usually ended before.

Grammars are llguidance's (https://github.com/guidance-ai/llguidance): Lark syntax with
JSON-schema terminals (`%json {...}`), or a JSON schema directly. Why llguidance and not
xgrammar: both compile our grammars in milliseconds and mask a step in well under a
millisecond on this CPU (bench/grammar_bench.py), but xgrammar's wheel requires triton
and pins torch, while llguidance has no Python dependencies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ragkv.errors import RagKVError

if TYPE_CHECKING:
    import torch

_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ragkv-mask")
CLOSING_WINDOW = 16  # tokens before max_new_tokens where a closing constraint prefers closers, at least


def closing_window(max_new_tokens: int) -> int:
    """How many of the budget's last tokens a closing constraint spends closing."""
    return max(CLOSING_WINDOW, max_new_tokens // 4)
_CLOSERS = frozenset('"}]')  # characters a closing token is made of (besides whitespace)


@dataclass(frozen=True)
class _Closing:
    """What the closing window prefers, per token of the vocabulary."""

    quote: torch.Tensor  # [V] bool: closing tokens that start with '"' (end a string)
    bracket: torch.Tensor  # [V] bool: closing tokens that start with '}' or ']', and EOS
    comma: torch.Tensor  # [V] bool: tokens of ',' and closers that start with ','
    text: Callable[[int], str]  # a token's text


class GrammarError(RagKVError, ValueError):
    """A grammar or JSON schema that the grammar library cannot compile."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of compact JSON (no free whitespace) valid against `schema`.

    Raises:
        GrammarError: The schema is not one the library can compile.
    """
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"JSON schema cannot be compiled: {exc}") from None
    return _validated(grammar, "JSON schema")


def lark_grammar(lark: str) -> str:
    """A grammar from Lark text (llguidance's dialect: `%json {...}` terminals allowed).

    Raises:
        GrammarError: The grammar (or a JSON schema inside it) is not one the library can compile.
    """
    import llguidance

    return _validated(llguidance.LLMatcher.grammar_from_lark(lark), "grammar")


def _validated(grammar: str, what: str) -> str:
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar, None)  # "" when it compiles
    if error:
        raise GrammarError(f"{what} cannot be compiled: {error.strip()}")
    return grammar


class ConstraintCompiler:
    """Compiles grammars against one model's tokenizer.

    Wrapping the tokenizer costs about a second (49k vocabulary), so it is built once,
    on first use, and shared.

    Args:
        tokenizer: The model's transformers tokenizer (a fast one).
        vocab_size: V, the width of the model's logits (may exceed the tokenizer's).
        eos_token_ids: Tokens that end generation; the grammar admits them once complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._closing: _Closing | None = None

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
            return self._tokenizer

    def _text(self, token: int) -> str:
        piece = self._hf.convert_ids_to_tokens(token)
        return self._hf.convert_tokens_to_string([piece]) if piece is not None else ""

    def closing(self) -> _Closing:
        """The closing tokens (only quotes, braces, brackets) by what they start with; EOS."""
        with self._lock:
            if self._closing is None:
                import torch

                quote, bracket, comma = (torch.zeros(self.vocab_size, dtype=torch.bool) for _ in range(3))
                for i in range(min(len(self._hf), self.vocab_size)):
                    text = self._text(i).strip()
                    if text and set(text) <= _CLOSERS:
                        (quote if text[0] == '"' else bracket)[i] = True
                    elif text.startswith(",") and set(text) <= _CLOSERS | {","}:
                        comma[i] = True
                bracket[[e for e in self._eos if e < self.vocab_size]] = True
                self._closing = _Closing(quote, bracket, comma, self._text)
            return self._closing

    def compile(self, grammar: str, closing: bool = False) -> Constraint:
        """A fresh constraint (one per request) over `grammar`.

        Args:
            closing: Prefer closing tokens in the last CLOSING_WINDOW tokens of the budget
                (for structured answers that must parse; not for free text).

        Raises:
            GrammarError: The grammar does not compile.
        """
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise GrammarError(f"grammar cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.closing() if closing else None)


class Constraint:
    """One request's place in its grammar, and the mask of the tokens it admits next."""

    def __init__(self, matcher: Any, vocab_size: int, closing: _Closing | None = None) -> None:
        import llguidance.torch as llt

        self._matcher = matcher
        self._closing = closing  # None: never prefer closing
        self._in_string = self._escaped = False  # where the output stands in JSON's lexical terms
        self.window = CLOSING_WINDOW  # the closing window, in tokens (the decode sets it from its budget)
        self._llt = llt
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32
        self._pending: Future[None] | None = None
        self.mask_seconds = 0.0  # time the decode waited for masks (not the time computing them)
        self.start()

    def start(self) -> None:
        """Begin computing the mask for the next token on a worker thread."""
        self._pending = _MASKS.submit(self._llt.fill_next_token_bitmask, self._matcher, self._bitmask, 0)

    def apply(self, logits: torch.Tensor, remaining: int | None = None) -> None:
        """Set to -inf, in place, the logits [V] of every token the grammar cannot take next.

        Args:
            remaining: Tokens left in the answer's budget, this one included; within
                CLOSING_WINDOW a closing constraint keeps only closing tokens, when the
                grammar admits any.
        """
        if self._pending is not None:
            t0 = time.perf_counter()
            self._pending.result()
            self._pending = None
            self.mask_seconds += time.perf_counter() - t0
        self._llt.apply_token_bitmask_inplace(logits.view(1, -1), self._bitmask.to(logits.device))
        if self._closing is not None and remaining is not None and remaining <= self.window:
            import torch

            c = self._closing
            with torch.inference_mode():  # logits come from the model's inference-mode forward
                allowed = logits > float("-inf")
                for prefer in ((c.quote,) if self._in_string else (c.bracket, c.comma)):
                    prefer = prefer.to(logits.device)
                    if bool((prefer & allowed).any()):
                        logits.masked_fill_(~prefer, float("-inf"))
                        break

    def consume(self, token: int) -> None:
        """Advance the grammar by the picked token.

        Raises:
            RuntimeError: The token was outside the mask (a bug: the mask was not applied).
        """
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} is outside the grammar: {self._matcher.get_error()}")
        if self._closing is not None:
            for ch in self._closing.text(token):
                if self._escaped:
                    self._escaped = False
                elif self._in_string and ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = not self._in_string

    @property
    def complete(self) -> bool:
        """Whether the grammar admits no further token (generation must end)."""
        return bool(self._matcher.is_stopped())
