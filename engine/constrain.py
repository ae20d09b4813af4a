"""Grammar-constrained decoding: a per-request token mask over the logits (llguidance).

A `Constraint` follows one request's output through its grammar: before each token is
picked, the tokens the grammar cannot take next get -inf; after it is picked, the
grammar consumes it. The mask for the next token is computed on a worker thread while
the model's forward step runs (llguidance releases the GIL), so in a batch it costs
the step only what is left of it when the logits are ready.

Grammars are llguidance's (https://github.com/guidance-ai/llguidance): Lark syntax with
JSON-schema terminals (`%json {...}`), or a JSON schema directly. Why llguidance and not
xgrammar: both compile our grammars in milliseconds and mask a step in well under a
millisecond on this CPU (bench/grammar_bench.py), but xgrammar's wheel requires triton
and pins torch, while llguidance has no Python dependencies.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ragkv.errors import RagKVError

if TYPE_CHECKING:
    import torch

_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ragkv-mask")


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

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
            return self._tokenizer

    def compile(self, grammar: str) -> Constraint:
        """A fresh constraint (one per request) over `grammar`.

        Raises:
            GrammarError: The grammar does not compile.
        """
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        if matcher.is_error():
            raise GrammarError(f"grammar cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One request's place in its grammar, and the mask of the tokens it admits next."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch as llt

        self._matcher = matcher
        self._llt = llt
        self.vocab_size = vocab_size
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32
        self._pending: Future[None] | None = None
        self.mask_seconds = 0.0  # time the decode waited for masks (not the time computing them)
        self.start()

    def start(self) -> None:
        """Begin computing the mask for the next token on a worker thread."""
        self._pending = _MASKS.submit(self._llt.fill_next_token_bitmask, self._matcher, self._bitmask, 0)

    def apply(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, the logits [V] of every token the grammar cannot take next."""
        if self._pending is not None:
            t0 = time.perf_counter()
            self._pending.result()
            self._pending = None
            self.mask_seconds += time.perf_counter() - t0
        self._llt.apply_token_bitmask_inplace(logits.view(1, -1), self._bitmask.to(logits.device))

    def consume(self, token: int) -> None:
        """Advance the grammar by the picked token.

        Raises:
            RuntimeError: The token was outside the mask (a bug: the mask was not applied).
        """
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} is outside the grammar: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the grammar admits no further token (generation must end)."""
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())
