"""Streaming decode over a preallocated cache: greedy or sampled, EOS, grammar and length.

`DecodeStream` picks tokens; iterated alone it is an iterator of text pieces (detokenized
by `engine.detokenize`, which also cuts at stop strings); after it ends, `finish_reason`
and `token_ids` tell what happened. `decode_batch` runs one step for many streams.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.engine.blend import BlendResult
from ragkv.engine.constrain import Constraint, closing_window
from ragkv.engine.detokenize import Detokenizer
from ragkv.engine.forward import layer_steps, span
from ragkv.engine.kv.cache import KVCache
from ragkv.engine.model_loading import LoadedModel
from ragkv.engine.work import drain
from ragkv.types import FinishReason

# answer tokens a cache makes room for up front (the prompt pass's, then the decode's); it doubles past
# them, so an answer allowed the whole context left holds only what it writes
FIRST_ROOM = 256


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token."""

    max_new_tokens: int = 128  # hard cap on generated tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept when sampling
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # sampling seed; None = nondeterministic
    stop: tuple[str, ...] = field(default_factory=tuple)  # generation ends before any of these

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


class DecodeStream(Iterator[str]):
    """One answer's decode state: picks each next token; EOS, the grammar's end and the length
    end it. Iterated alone it yields text pieces (one forward step per token, detokenized
    and cut at stop strings here: evals, tests, the demo); in the scheduler it only picks
    tokens (`advance`), and the consumer detokenizes them (`engine.detokenize`) and calls
    `stop_after` when a stop string ends the text.
    """

    def __init__(self, lm: LoadedModel, prompt: BlendResult, params: SamplingParams,
                 constraint: Constraint | None = None) -> None:
        self.lm, self.params = lm, params
        self.cache = prompt.cache
        self.cache.most = self.cache.length + params.max_new_tokens  # what admission counted: it grows no further
        if self.cache.pool is None:  # room for the answer's start now; it grows past it, doubling. A run of
            # the decode pool grows a page at a time as it decodes (`DecodePool.grow`): a path lent with room
            # for its prompt only moves (a copy) only if its answer outgrows the free pages after it
            self.cache.ensure(self.cache.length + min(params.max_new_tokens, FIRST_ROOM))
        self.constraint = constraint  # the grammar the answer must follow; None = free text
        if constraint is not None:
            constraint.window = closing_window(params.max_new_tokens)
        self.logits = prompt.logits  # [V]
        self.token_ids: list[int] = []  # generated so far
        self.finish_reason: FinishReason | None = None  # STOP (EOS, grammar, stop string) or LENGTH
        self._eos = set(lm.eos_token_ids)
        self._stop_after: int | None = None  # set by the consumer (any thread): a stop string ended the text
        self._text: Detokenizer | None = None  # the iterator's own detokenizer
        self._gen = None
        if params.temperature > 0:
            self._gen = torch.Generator(device=lm.device)
            self._gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.receive(self.logits)  # a constrained stream masks its first token's logits too

    def detokenizer(self) -> Detokenizer:
        """A detokenizer of this stream's tokens with its stop strings, which stops the stream
        (`stop_after`) when one is found; for the consumer of the tokens."""
        return Detokenizer(self.lm.tokenizer, self.params.stop, self.stop_after)

    def stop_after(self, n_tokens: int) -> None:
        """A stop string ended the text after `n_tokens` tokens (called by the consumer, from any
        thread): the next `advance` ends the stream, its tokens past the stop dropped."""
        self._stop_after = n_tokens

    def __iter__(self) -> DecodeStream:
        return self

    @torch.inference_mode()
    def __next__(self) -> str:
        if self._text is None:
            self._text = self.detokenizer()
        text = self._text
        while self.finish_reason is None:
            token = self.advance()
            piece = "" if token is None else text.push(token)
            if text.stopped:  # the text ends with this token (its token_ids end there too)
                self.finish_reason = FinishReason.STOP
            elif self.finish_reason is None:
                assert token is not None, "advance returns None only as the stream ends"
                self.receive(self._forward(token))
            if piece:
                return piece
        piece = text.finish()
        if piece:
            return piece
        raise StopIteration

    def receive(self, logits: torch.Tensor) -> None:
        """Take the next-token logits [V] of a forward step; a constrained stream masks them,
        in place, with the tokens its grammar admits (in a batch: before the batch's argmax)."""
        if self.constraint is not None:
            self.constraint.apply(logits, remaining=self.params.max_new_tokens - len(self.token_ids))
        self.logits = logits

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (a batch picks those together: `pick_greedy`)."""
        return self.params.temperature == 0

    def advance(self, token: int | None = None) -> int | None:
        """Take the next token: `token` when the caller picked it (greedy rows of a batch,
        `pick_greedy`), else picked here from the current logits.

        Returns:
            The token taken (None for EOS, or once the stream has ended). While
            `finish_reason` is None the caller runs the model on it and hands the step's
            logits to `receive`, alone (`__next__`) or batched (`decode_batch`); once set,
            the stream has ended (the returned token, if any, is its last).
        """
        if self.finish_reason is not None:
            return None
        if self._stop_after is not None:  # the consumer found a stop string
            del self.token_ids[self._stop_after:]
            self.finish_reason = FinishReason.STOP
            return None
        token = self._pick(self.logits) if token is None else token
        if token in self._eos:
            self.finish_reason = FinishReason.STOP
            return None
        self.token_ids.append(token)
        if self.constraint is not None:
            self.constraint.consume(token)
            if self.constraint.complete:  # the grammar admits nothing more: the answer is whole
                self.finish_reason = FinishReason.STOP
                return token
            self.constraint.start()  # the next mask, computed while the forward step runs
        if len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return token

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature  # [V]
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.shape[0])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, -1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, -1) - sorted_p > p.top_p  # keep the smallest set reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def _forward(self, token: int) -> torch.Tensor:
        return decode_batch(self.lm, [self.cache], [token])[0]  # [V]: a batch of one


@torch.inference_mode()
def decode_batch(lm: LoadedModel, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
    """One decode step for B sequences with caches of different lengths (ragged batching).

    The projections, MLPs and the LM head run once over all B rows, so the weights are
    read once per step for the whole batch; attention runs per sequence over its own
    cache (no padding): one `Span` per sequence in the one layer function. Each cache gets
    its token's K/V at its own length, and grows by 1.

    Args:
        caches: each sequence's cache, `length` = the tokens it holds.
        tokens: the token each sequence feeds next.

    Returns:
        [B, V] float32 next-token logits.
    """
    if len(caches) != len(tokens) or not caches:
        raise ValueError(f"decode_batch needs one token per cache, got {len(tokens)} for {len(caches)}")
    dev, ad = lm.device, lm.adapter
    lens = [c.length for c in caches]
    for c, n in zip(caches, lens):
        c.ensure(n + 1)
    pos = torch.tensor(lens, device=dev)  # [B]
    rope = ad.rotary(pos, torch.empty(0, dtype=lm.dtype, device=dev))  # B rows
    spans = [s for j, (c, n) in enumerate(zip(caches, lens))
             for s in span(c, slice(n, n + 1), pos[j:j + 1], n + 1, lm, rows=slice(j, j + 1))]
    h = drain(layer_steps(lm, ad.embed(torch.tensor(list(tokens), device=dev)), rope, spans,  # [B, hidden]
                          range(lm.num_layers)))
    for c, n in zip(caches, lens):
        c.length = n + 1
    return ad.logits(h)  # [B, V]


def pick_greedy(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [B, V]: one call for a batch's greedy requests."""
    return logits.argmax(-1).tolist()
