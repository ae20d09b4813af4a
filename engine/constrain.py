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

A request's grammar comes from the client (its JSON schema, its tools), so compiling it is
bounded: a grammar's text may be at most `max_grammar_bytes()` (MAX_GRAMMAR_BYTES, or the
RAGKV_MAX_GRAMMAR_BYTES environment variable), and llguidance compiles and steps it under
`GRAMMAR_LIMITS` (grammar size, lexer fuel and states, Earley items per step). A grammar over
a limit is a `GrammarError` (a ValueError) that names the limit; the server answers it with
INVALID_ARGUMENT. Each grammar is compiled once and cached by its hash (bounded LRUs): its
validation's result (`lark_grammar`, `json_schema_grammar`), and per tokenizer the compiled
matcher that each request's constraint copies (`ConstraintCompiler.compile`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

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
    """A grammar or JSON schema that the grammar library cannot compile, or one over a limit."""


class GrammarLimitError(GrammarError):
    """A grammar or JSON schema over a limit: MAX_GRAMMAR_BYTES, or one of GRAMMAR_LIMITS."""


MAX_GRAMMAR_BYTES = 128 * 1024
"""The longest grammar (or JSON schema) text compiled, in UTF-8 bytes: llguidance's JSON
compiler is superlinear in some schemas (thousands of optional properties: about 1 s at this
size on one core), so longer ones are refused before any compiling. RAGKV_MAX_GRAMMAR_BYTES
overrides it."""

class ParserLimits(TypedDict, total=False):
    """`llguidance.LLParserLimits`' arguments, by name (GRAMMAR_LIMITS holds them)."""

    max_grammar_size: int
    max_items_in_row: int
    initial_lexer_fuel: int
    step_lexer_fuel: int
    step_max_items: int
    max_lexer_states: int
    precompute_large_lexemes: bool
    verbose_errors: bool


GRAMMAR_LIMITS: ParserLimits = {
    "max_grammar_size": 100_000,  # symbols in the grammar's productions (llguidance's default: 500,000)
    "max_items_in_row": 2_000,  # branching of one production row
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes (~50k/ms: ~20 ms)
    "step_lexer_fuel": 200_000,  # lexer work per token mask (~14k/ms: ~15 ms)
    "step_max_items": 50_000,  # Earley items per token mask (~20k/ms: ~2.5 ms)
    "max_lexer_states": 50_000,  # lexer states (1-2 kB each: <100 MB; llguidance's default: 250,000)
    "verbose_errors": False,  # errors name the problem, not the parser's state and the whole grammar
}
"""llguidance's limits (`llguidance.LLParserLimits`) for compiling a grammar and computing each
token's mask: a grammar past one fails to compile (or its request fails at that token) with an
error naming it."""

GRAMMAR_CACHE_SIZE = 256  # grammars whose validation result is kept (a hash and a short string each)
MATCHER_CACHE_SIZE = 64  # compiled grammars kept per tokenizer (each holds its lexer: up to MBs)
_LIMIT_WORDS = ("limit", "too large", "too big", "fuel", "too complex")


def max_grammar_bytes() -> int:
    """MAX_GRAMMAR_BYTES, or the RAGKV_MAX_GRAMMAR_BYTES environment variable when set."""
    raw = os.environ.get("RAGKV_MAX_GRAMMAR_BYTES", "").strip()
    if not raw:
        return MAX_GRAMMAR_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise GrammarError(f"RAGKV_MAX_GRAMMAR_BYTES={raw!r} is not a whole number of bytes") from None
    return value if value > 0 else MAX_GRAMMAR_BYTES


def grammar_limits() -> Any:
    """GRAMMAR_LIMITS as an `llguidance.LLParserLimits`."""
    import llguidance

    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


def _check_size(text: str, what: str) -> None:
    size, limit = len(text.encode("utf-8", "surrogatepass")), max_grammar_bytes()
    if size > limit:
        raise GrammarLimitError(
            f"{what} is {size:,} bytes, over the limit of {limit:,} bytes on a grammar "
            f"(MAX_GRAMMAR_BYTES; the server's RAGKV_MAX_GRAMMAR_BYTES raises it): send a smaller one")


def _explained(error: str, what: str) -> GrammarError:
    error = error.strip()
    if any(w in error.lower() for w in _LIMIT_WORDS):
        limits = ", ".join(f"{k}={v:,}" for k, v in GRAMMAR_LIMITS.items() if not isinstance(v, bool))
        return GrammarLimitError(f"{what} is over a limit of the grammar compiler ({error}; "
                            f"the limits: {limits}): send a simpler one")
    return GrammarError(f"{what} cannot be compiled: {error}")


def _key(grammar: str) -> str:
    """A grammar's cache key: its hash under the limits it is compiled with."""
    limits = json.dumps(GRAMMAR_LIMITS, sort_keys=True)
    return hashlib.sha256(f"{limits}\n{grammar}".encode("utf-8", "surrogatepass")).hexdigest()


class _LRU:
    """A bounded, thread-safe map from a grammar's hash to what compiling it gave."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
            return None

    def peek(self, key: str) -> Any:
        """What `key` gave, without counting a hit or a miss; None when not kept."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


_VALIDATED = _LRU(GRAMMAR_CACHE_SIZE)  # grammar hash -> "" (it compiles) or its error


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of compact JSON (no free whitespace) valid against `schema`.

    Raises:
        GrammarError: The schema is not one the library can compile, or is over a limit.
    """
    import llguidance

    try:
        _check_size(json.dumps(schema), "JSON schema")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as exc:
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(f"JSON schema cannot be compiled: {exc}") from None
    return _validated(grammar, "JSON schema")


def lark_grammar(lark: str) -> str:
    """A grammar from Lark text (llguidance's dialect: `%json {...}` terminals allowed).

    Raises:
        GrammarError: The grammar (or a JSON schema inside it) is not one the library can
            compile, or is over a limit.
    """
    import llguidance

    _check_size(lark, "grammar")
    return _validated(llguidance.LLMatcher.grammar_from_lark(lark), "grammar")


def _validated(grammar: str, what: str) -> str:
    """`grammar` once it compiles under GRAMMAR_LIMITS; each grammar is compiled once (cached)."""
    import llguidance

    _check_size(grammar, what)
    key = _key(grammar)
    error = _VALIDATED.get(key)
    if error is None:
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=grammar_limits())  # "" when it compiles
        error = "" if error.startswith("WARNING") else error
        _VALIDATED.put(key, error)
    if error:
        raise _explained(error, what)
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
        self._matchers = _LRU(MATCHER_CACHE_SIZE)  # grammar hash -> compiled matcher (copied per request) or error
        self._copy_lock = threading.Lock()

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

        A grammar is compiled once, under GRAMMAR_LIMITS, and kept (MATCHER_CACHE_SIZE
        grammars, by hash): each request gets a copy of the compiled matcher in its start
        state. A grammar that failed to compile fails again without compiling.

        Args:
            closing: Prefer closing tokens in the last CLOSING_WINDOW tokens of the budget
                (for structured answers that must parse; not for free text).

        Raises:
            GrammarError: The grammar does not compile, or is over a limit.
        """
        return Constraint(self._matcher(grammar), self.vocab_size, self.closing() if closing else None)

    @property
    def compiled(self) -> int:
        """Grammars compiled for this tokenizer (not counting copies of cached ones)."""
        return self._matchers.misses

    def _matcher(self, grammar: str) -> Any:
        _check_size(grammar, "grammar")
        key = _key(grammar)
        cached = _VALIDATED.peek(key)  # validated already (lark_grammar): only an error is of use here
        if cached:
            raise _explained(cached, "grammar")
        template = self._matchers.get(key)
        if template is None:
            import llguidance

            template = llguidance.LLMatcher(self._llg_tokenizer(), grammar, limits=grammar_limits())
            if template.is_error():
                template = template.get_error() or "unknown error"
            self._matchers.put(key, template)
        if isinstance(template, str):
            raise _explained(template, "grammar")
        with self._copy_lock:  # a copy of the start state; the cached matcher itself never steps
            return template.deep_copy()


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
