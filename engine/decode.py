"""Streaming decode over a preallocated cache: greedy or sampled, EOS and stop strings.

`DecodeStream` is an iterator of text pieces; after it ends, `finish_reason` and
`token_ids` tell what happened. Text is detokenized incrementally: a piece is
emitted only once it cannot change (no dangling UTF-8, no partial stop string).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.engine.blend import BlendResult
from ragkv.engine.constrain import Constraint, closing_window
from ragkv.engine.forward import layer_forward, span
from ragkv.engine.kv import KVCache
from ragkv.engine.loading import LoadedModel
from ragkv.types import FinishReason


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
    """Yields text pieces of the answer; one forward step per generated token."""

    def __init__(self, lm: LoadedModel, prompt: BlendResult, params: SamplingParams,
                 constraint: Constraint | None = None) -> None:
        self.lm, self.params = lm, params
        self.cache = prompt.cache
        self.cache.ensure(self.cache.length + params.max_new_tokens)
        self.constraint = constraint  # the grammar the answer must follow; None = free text
        if constraint is not None:
            constraint.window = closing_window(params.max_new_tokens)
        self.logits = prompt.logits  # [V]
        self.token_ids: list[int] = []  # generated so far
        self.finish_reason: FinishReason | None = None  # STOP (EOS or a stop string) or LENGTH
        self._cut = False  # a stop string cut the text
        self._eos = set(lm.eos_token_ids)
        self._text = ""  # detokenized so far
        self._emitted = 0  # characters of _text already yielded
        # incremental detokenization: token_ids[_prefix:_read] were decoded last time; the newest
        # tokens' text is decode(token_ids[_prefix:]) less decode(token_ids[_prefix:_read])
        self._prefix = self._read = 0
        self._gen = None
        if params.temperature > 0:
            self._gen = torch.Generator(device=lm.device)
            self._gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.receive(self.logits)  # a constrained stream masks its first token's logits too

    def __iter__(self) -> DecodeStream:
        return self

    def __next__(self) -> str:
        while self.finish_reason is None:
            piece = self._step()
            if piece:
                return piece
        raise StopIteration

    @torch.inference_mode()
    def _step(self) -> str:
        piece, token = self.advance()
        if token is not None:
            self.receive(self._forward(token))
        return piece

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

    def advance(self, token: int | None = None) -> tuple[str, int | None]:
        """Take the next token: `token` when the caller picked it (greedy rows of a batch,
        `pick_greedy`), else picked here from the current logits.

        Returns:
            The text that became final, and the token to run the model on next (None when
            generation has finished: then `finish_reason` says why). The caller hands the
            logits of that forward step to `receive`, alone (`_step`) or batched (`decode_batch`).
        """
        token = self._pick(self.logits) if token is None else token
        if token in self._eos:
            self.finish_reason = FinishReason.STOP
            return self._flush(), None
        self.token_ids.append(token)
        self._detokenize()
        if self.constraint is not None:
            self.constraint.consume(token)
            if self.constraint.complete:  # the grammar admits nothing more: the answer is whole
                self.finish_reason = FinishReason.STOP
                return self._flush(), None
            self.constraint.start()  # the next mask, computed while the forward step runs
        stop_at = self._find_stop()
        if stop_at is not None:
            self._text = self._text[:stop_at]
            self.finish_reason, self._cut = FinishReason.STOP, True
            return self._flush(), None
        if len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
            return self._flush(), None
        return self._ready_piece(), token

    def _detokenize(self) -> None:
        """Append the newest token's text to `_text`, decoding only the last few tokens.

        Decoding a window with and without the newest token and keeping the difference is
        what a whole decode gives (a word-start space stripped at the window's start is
        stripped in both); a token that ends inside a UTF-8 character adds nothing until
        the token that completes it comes.
        """
        self._take_window(final=False)

    def _take_window(self, final: bool) -> None:
        """Append the text of token_ids[_read:] to `_text` and slide the window past it; unless
        `final`, only once it is not empty and ends on a whole character."""
        tok, ids = self.lm.tokenizer, self.token_ids
        before = tok.decode(ids[self._prefix:self._read], skip_special_tokens=True)
        now = tok.decode(ids[self._prefix:], skip_special_tokens=True)
        if final or (len(now) > len(before) and not now.endswith("\ufffd")):
            self._text += now[len(before):]
            self._prefix, self._read = self._read, len(ids)

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

    def _find_stop(self) -> int | None:
        if not self.params.stop:
            return None
        start = max(0, self._emitted - max(len(s) for s in self.params.stop))
        hits = [i for s in self.params.stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _ready_piece(self) -> str:
        """Text that can no longer change: not a dangling byte, not a possible stop prefix."""
        end = len(self._text)
        if self._text.endswith("\ufffd"):
            return ""
        for s in self.params.stop:
            for k in range(min(len(s) - 1, end - self._emitted), 0, -1):
                if self._text.endswith(s[:k]):
                    end = min(end, len(self._text) - k)
                    break
        piece = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return piece

    def _flush(self) -> str:
        """The rest of the text, at the end: a character left incomplete by the last token
        comes out as U+FFFD, as a whole decode gives it (unless a stop string cut the text)."""
        if not self._cut and self._read < len(self.token_ids):
            self._take_window(final=True)
        piece = self._text[self._emitted:]
        self._emitted = len(self._text)
        return piece



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
    h = ad.embed(torch.tensor(list(tokens), device=dev))  # [B, hidden]
    for i in range(lm.num_layers):
        h, _, _ = layer_forward(ad, i, h, rope, spans)
    for c, n in zip(caches, lens):
        c.length = n + 1
    return ad.logits(h)  # [B, V]


def pick_greedy(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [B, V]: one call for a batch's greedy requests."""
    return logits.argmax(-1).tolist()
