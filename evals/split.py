"""Out-of-sample evaluation: which cases tune a choice and which report it (`ragkv eval --split`,
`--folds`).

A case's part is a pure function of its id and a seed (a hash, not a shuffle of the set), so
the same question lands in the same part however many questions a run takes (`--n`), in
every run, on every machine. Tuning picks, among methods measured on the same cases, the
fastest whose KL to full prefill is within a slack of the best; the pick is then reported
on cases it never saw. This module knows nothing of models: it reads the per-case rows that
`evaluate(on_case=)` writes (`ragkv eval --cases-out`).
"""

from __future__ import annotations

import enum
import hashlib
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ragkv.evals.evaluate import MethodReport

# a case's scores that are averaged into a MethodReport (row key -> report field)
_MEANS = {"acc": "accuracy", "f1": "f1", "agree": "agreement", "f1_vs_full": "f1_vs_full",
          "first": "first_token_agreement", "kl": "kl_mean", "recompute_fraction": "recompute_fraction"}
# means of rows recorded since they were added (KL along the answer): 0 over rows that lack them
_LATER_MEANS = {"kl_answer": "kl_answer", "kl_answer_max": "kl_answer_max"}


class Part(enum.Enum):
    """Which side of a fixed split a case is on."""

    TUNE = "tune"  # choices (thresholds, modes) are made on these cases
    REPORT = "report"  # ... and reported on these, never tuned on


def unit_hash(case_id: str, seed: int) -> float:
    """A number in [0, 1) fixed by the case's id and the seed (sha256: the same everywhere)."""
    digest = hashlib.sha256(f"{seed}\0{case_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True, slots=True)
class Split:
    """A fixed, seeded split of a question set into a tune part and a report part."""

    seed: int = 0  # which split; another seed is another, independent split
    tune_frac: float = 0.5  # the share of cases (in expectation) in the tune part, in (0, 1)

    def __post_init__(self) -> None:
        if not 0.0 < self.tune_frac < 1.0:
            raise ValueError(f"--split-frac is the tune part's share and must be in (0, 1), got {self.tune_frac}")

    def part_of(self, case_id: str) -> Part:
        return Part.TUNE if unit_hash(case_id, self.seed) < self.tune_frac else Part.REPORT

    def select(self, items: Iterable, part: Part, key=lambda c: c.id) -> list:
        """The items (cases, or rows with `key=lambda r: r["id"]`) on `part`'s side, in their order."""
        return [x for x in items if self.part_of(str(key(x))) is part]


def fold_of(case_id: str, folds: int, seed: int) -> int:
    """The fold (0 .. folds - 1) a case is held out in, fixed by its id and the seed."""
    if folds < 2:
        raise ValueError(f"--folds must be at least 2 (one part to tune on, one to report), got {folds}")
    return min(int(unit_hash(case_id, seed) * folds), folds - 1)


def report_from_rows(rows: Iterable[Mapping], method: str) -> MethodReport:
    """One method's MethodReport over per-case rows (`evaluate(on_case=)`'s), the cases that
    ran it; the same means and medians `evaluate` reports over the same cases."""
    r, ttfts, prefills = MethodReport(), [], []
    sums = dict.fromkeys(_MEANS | _LATER_MEANS, 0.0)
    later = True  # every row has the later means
    for row in rows:
        one = row["methods"].get(method)
        if one is None:
            continue
        missing = [k for k in (*_MEANS, "ttft_s") if k not in one]
        if missing:
            raise ValueError(f"case {row.get('id')!r}: method {method!r} lacks {', '.join(missing)}: "
                             f"not a row ragkv eval --cases-out writes")
        r.n += 1
        for key in _MEANS:
            sums[key] += float(one[key])
        later = later and all(k in one for k in _LATER_MEANS)
        for key in _LATER_MEANS:
            sums[key] += float(one.get(key, 0.0))
        ttfts.append(float(one["ttft_s"]))
        prefills.append(float(one.get("kv_prefill_s", 0.0)))
    if r.n:
        for key, name in (_MEANS | (_LATER_MEANS if later else {})).items():
            setattr(r, name, sums[key] / r.n)
        r.ttft_median_s, r.kv_prefill_median_s = statistics.median(ttfts), statistics.median(prefills)
    return r


def paired_speedup(rows: Iterable[Mapping], method: str, reference: str = "full") -> float:
    """The median over cases of `reference`'s TTFT over `method`'s on the same case: steadier than
    the ratio of the two medians when other work shares the cores now and then (each case's runs
    are seconds apart). NaN when no case ran both."""
    ratios = [float(r["methods"][reference]["ttft_s"]) / float(r["methods"][method]["ttft_s"])
              for r in rows if method in r["methods"] and reference in r["methods"]
              and float(r["methods"][method]["ttft_s"]) > 0]
    return statistics.median(ratios) if ratios else float("nan")


@dataclass(frozen=True, slots=True)
class TuneRule:
    """How tuning picks one method from several measured on the same cases."""

    kl_slack: float = 0.005  # candidates within this KL (nats) of the best candidate's mean KL qualify
    # ... and of those the fastest (median TTFT) is picked: quality first, then speed

    def pick(self, reports: Mapping[str, MethodReport]) -> str:
        """The name of the fastest report whose mean KL is within `kl_slack` of the lowest."""
        if not reports:
            raise ValueError("nothing to tune over: give at least one method other than full")
        best = min(r.kl_mean for r in reports.values())
        ok = [name for name, r in reports.items() if r.kl_mean <= best + self.kl_slack]
        return min(ok, key=lambda name: (reports[name].ttft_median_s, reports[name].kl_mean, name))


@dataclass(frozen=True, slots=True)
class FoldResult:
    """One fold of a cross-validation: what tuning on the other folds picked, and how it did here."""

    fold: int  # the held-out fold
    picked: str  # the method tuning picked on the other folds
    n_tune: int  # cases tuned on
    report: MethodReport  # the picked method on this fold's cases (never tuned on)


def tuned_methods(rows: Sequence[Mapping], exclude: Iterable[str] = ("full",)) -> list[str]:
    """The methods every row ran, in the first row's order, less `exclude`."""
    if not rows:
        return []
    skip = set(exclude)
    names = [m for m in rows[0]["methods"] if m not in skip]
    return [m for m in names if all(m in row["methods"] for row in rows)]


def cross_validate(rows: Sequence[Mapping], candidates: Sequence[str], folds: int, seed: int,
                   rule: TuneRule = TuneRule()) -> list[FoldResult]:
    """K-fold tuning: for each fold, `rule` picks a candidate on the other folds' rows; the
    pick is reported on the fold's own rows. A fold with no rows is left out."""
    if not candidates:
        raise ValueError("cross-validation needs candidate methods besides full: add some to --modes")
    by_fold: dict[int, list[Mapping]] = {}
    for row in rows:
        by_fold.setdefault(fold_of(str(row["id"]), folds, seed), []).append(row)
    out = []
    for k in sorted(by_fold):
        tune = [row for j, rs in by_fold.items() if j != k for row in rs]
        if not tune:
            raise ValueError(f"every case fell in fold {k}: use fewer --folds or more cases")
        picked = rule.pick({m: report_from_rows(tune, m) for m in candidates})
        out.append(FoldResult(k, picked, len(tune), report_from_rows(by_fold[k], picked)))
    return out


def held_out_summary(results: Sequence[FoldResult], rows: Sequence[Mapping], folds: int, seed: int) -> dict:
    """The cross-validation as one JSON-ready object: each fold's pick and its held-out scores,
    and `tuned`: the tuning procedure's held-out score, every case scored by the method its own
    fold's tuning picked (each case is held out in exactly one fold)."""
    pick_of = {res.fold: res.picked for res in results}
    tuned_rows = [{"id": row["id"], "methods": {"tuned": row["methods"][pick_of[k]]}}
                  for row in rows if (k := fold_of(str(row["id"]), folds, seed)) in pick_of]
    return {"folds": folds, "fold_seed": seed,
            "per_fold": [{"fold": r.fold, "picked": r.picked, "n_tune": r.n_tune, **r.report.as_dict()}
                         for r in results],
            "tuned": report_from_rows(tuned_rows, "tuned").as_dict()}
