"""Replay focus's handover rule offline, from recorded per-case rows (`ragkv eval --cases-out`).

Focus answers a question one of two ways: a handover is blend over every chunk, over the very
cache the scoring pass read (its logits equal blend's: tests/engine/test_focus.py); a lookup
answers over the best chunk alone, and that answer does not depend on the threshold that chose
it. So a run that records, for every case, blend's row and a focus row that looked up on every
question (`--focus-spread 1 --focus-several 0`: its chunk scores and its lookup answer) holds
every threshold's answers: a rule is replayed by picking, per case, the row the rule would have
run. The replayed TTFT is the picked row's, plus, for a handover, the scoring pass's time read
from the lookup row (`phases_s["focus"]`). No model is loaded here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ragkv.engine.focus import FocusOptions


@dataclass(frozen=True, slots=True)
class ReplayRule:
    """One handover rule to replay (FocusOptions' fields of the same names)."""

    spread: float  # hand over when the two runners-up average at least this x the best
    several: int  # ... or when at least this many chunks score within `keep` of the best (0 = never)
    keep: float = FocusOptions().keep  # chunks kept: scoring at least this x the best

    @property
    def name(self) -> str:
        return f"replay@s{self.spread:g}n{self.several}"

    def hands_over(self, scores: Sequence[float]) -> bool:
        """engine/blend.py's handover test, on one case's chunk scores."""
        if not scores:
            raise ValueError("a focus row without chunk_scores: record it with a focus method")
        best = max(scores)
        kept = sum(s >= self.keep * best for s in scores)
        return kept > 1 and (runners_up_spread(scores) >= self.spread or 0 < self.several <= kept)


def runners_up_spread(scores: Sequence[float], runners_up: int = 2) -> float:
    """engine.focus.spread on a list: the mean of the next `runners_up` scores over the best."""
    if len(scores) < 2:
        return 0.0
    top = sorted(scores, reverse=True)[: runners_up + 1]
    return (sum(top[1:]) / len(top[1:])) / max(top[0], 1e-12)


def parse_rules(text: str) -> list[ReplayRule]:
    """`--replay-focus` entries: S:N comma-separated (spread S, several N), e.g. 0.66:3,0.8:0."""
    rules = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            s, n = item.split(":")
            rules.append(ReplayRule(float(s), int(n)))
        except ValueError:
            raise ValueError(f"--replay-focus takes spread:several pairs joined by commas (e.g. 0.66:3,0.8:0), "
                             f"got {item!r}") from None
    return rules


def replay(rows: Sequence[Mapping], rules: Sequence[ReplayRule], handover: str = "blend",
           lookup: str = "focus-lookup") -> list[dict]:
    """`rows` with one more method per rule (`rule.name`): per case, the `handover` method's
    row where the rule hands over, else the `lookup` method's (a lookup row that itself
    handed over, all chunks kept, is a handover either way).

    Raises:
        ValueError: a row lacks the `handover` or the `lookup` method, naming the case.
    """
    out = []
    for row in rows:
        methods = dict(row["methods"])
        if handover not in methods or lookup not in methods:
            raise ValueError(f"case {row['id']}: replay needs methods {handover!r} and {lookup!r} in each row, "
                             f"found {sorted(methods)}; record them with --modes blend,focus and a focus "
                             f"variant that always looks up (--focus-spread 1 --focus-several 0)")
        look = methods[lookup]
        for rule in rules:
            if look["handed_over"] or rule.hands_over(look["chunk_scores"]):
                one = dict(methods[handover])
                one["ttft_s"] = float(one["ttft_s"]) + float(look.get("phases_s", {}).get("focus", 0.0))
                one["handed_over"], one["chunk_scores"] = True, look["chunk_scores"]
            else:
                one = dict(look)
            methods[rule.name] = one
        out.append({**row, "methods": methods})
    return out
