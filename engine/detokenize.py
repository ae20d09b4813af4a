"""Incremental detokenization with stop strings: token ids in, text that can no longer change out.

Runs on the consumer's side of a decode: the server's answer relay (`server/answering.py`,
on the event loop) for served requests, the stream's own iterator for one-off decodes
(`DecodeStream.__iter__`: evals, tests, the demo). The scheduler thread only picks tokens.

A piece is given out once it cannot change: no dangling UTF-8 byte, no text that could be
the start of a stop string. A stop string ends the text before it; the tokens past it are
not counted (`token_count`), and `on_stop` tells the producer to stop decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Detokenizer:
    """Turns one answer's token ids into its text, piece by piece.

    Args:
        tokenizer: Anything with `decode(ids, skip_special_tokens=True)` (a transformers tokenizer).
        stop: The answer ends before the first of these (non-empty: `SamplingParams` checks them).
        on_stop: Called once, with `token_count`, when a stop string is found (the producer
            stops decoding: `DecodeStream.stop_after`).
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), on_stop: Callable[[int], None] | None = None) -> None:
        self._tok, self._stop, self._on_stop = tokenizer, stop, on_stop
        self.token_ids: list[int] = []  # taken so far (none past a stop string)
        self.stopped = False  # a stop string ended the text
        self._text = ""  # detokenized so far
        self._emitted = 0  # characters of _text already given out
        # token_ids[_prefix:_read] were decoded last time; the newest tokens' text is
        # decode(token_ids[_prefix:]) less decode(token_ids[_prefix:_read])
        self._prefix = self._read = 0

    @property
    def token_count(self) -> int:
        """Tokens of the answer: those taken, none after a stop string's."""
        return len(self.token_ids)

    def push(self, token: int) -> str:
        """Take the next token; returns the text that became final (often "")."""
        if self.stopped:
            return ""  # decoded before the producer heard of the stop: not part of the answer
        self.token_ids.append(token)
        self._take_window(final=False)
        stop_at = self._find_stop()
        if stop_at is not None:
            self._text = self._text[:stop_at]
            self.stopped = True
            if self._on_stop is not None:
                self._on_stop(self.token_count)
            return self.finish()
        return self._ready_piece()

    def finish(self) -> str:
        """The rest of the text, at the end: a character left incomplete by the last token comes
        out as U+FFFD, as a whole decode gives it (unless a stop string cut the text)."""
        if not self.stopped and self._read < len(self.token_ids):
            self._take_window(final=True)
        piece = self._text[self._emitted:]
        self._emitted = len(self._text)
        return piece

    def _take_window(self, final: bool) -> None:
        """Append the text of token_ids[_read:] to `_text` and slide the window past it; unless
        `final`, only once it is not empty and ends on a whole character.

        Decoding a window with and without the newest tokens and keeping the difference is
        what a whole decode gives (a word-start space stripped at the window's start is
        stripped in both); a token that ends inside a UTF-8 character adds nothing until the
        token that completes it comes.
        """
        ids = self.token_ids
        before = self._tok.decode(ids[self._prefix:self._read], skip_special_tokens=True)
        now = self._tok.decode(ids[self._prefix:], skip_special_tokens=True)
        if final or (len(now) > len(before) and not now.endswith("\ufffd")):
            self._text += now[len(before):]
            self._prefix, self._read = self._read, len(ids)

    def _find_stop(self) -> int | None:
        if not self._stop:
            return None
        start = max(0, self._emitted - max(len(s) for s in self._stop))
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _ready_piece(self) -> str:
        """Text that can no longer change: not a dangling byte, not a possible stop prefix."""
        end = len(self._text)
        if self._text.endswith("\ufffd"):
            return ""
        for s in self._stop:
            for k in range(min(len(s) - 1, end - self._emitted), 0, -1):
                if self._text.endswith(s[:k]):
                    end = min(end, len(self._text) - k)
                    break
        piece = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return piece
