"""Which recompute ratio blend serves, and what the index's calibration predicts for it.

`ragkv index` measures, on its own corpus, how far blend at each ratio is from full prefill
(`indexer.calibrate`, the manifest's `Calibration`). `ragkv serve` then serves each
collection, for requests that set no ratio, the cheapest ratio whose predicted KL meets
`--fidelity-kl` (`served_ratio`, chosen once at start-up and logged). A request may ask for
its own target instead of a ratio (`fidelity_kl`): the cheapest ratio that meets it, or full
prefill when none does (`request_ratio`). The answer's stats report the ratio that ran and
the KL predicted for it.

An explicit `--default-recompute-ratio` wins over the calibration, and an index without one
(built before, or with `--calibrate off`) serves that default (`DEFAULT_RECOMPUTE_RATIO`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.retriever.manifest import Calibration
from ragkv.server.status import InvalidArgumentError

# blend's ratio where neither the operator nor a calibration chose one: with the selector over three
# layers, 0.15 is as close to full prefill as 0.2 over one was, at about 4x (docs/quality.md, issue 39)
DEFAULT_RECOMPUTE_RATIO = 0.15


@dataclass(frozen=True, slots=True)
class ServedRatio:
    """Blend's ratio for a collection's requests that set none, and why it is that."""

    ratio: float  # share of chunk tokens recomputed
    predicted_kl: float | None  # the calibration's predicted KL for it; None = the index has no calibration
    reason: str  # one line for the start-up log


@dataclass(frozen=True, slots=True)
class RequestRatio:
    """What one request runs at: a ratio, or full prefill (a fidelity target no setting meets)."""

    ratio: float | None  # None = full prefill
    predicted_kl: float | None  # None = not predicted (no calibration, or a path it did not measure)


def served_ratio(collection: str, calibration: Calibration | None, fidelity_kl: float | None,
                 explicit_ratio: float | None) -> ServedRatio:
    """The ratio a collection serves to requests that set none (`ragkv serve`'s choice at start-up).

    Args:
        calibration: the index's (None: not calibrated).
        fidelity_kl: --fidelity-kl; None = off (the default ratio serves).
        explicit_ratio: --default-recompute-ratio when the operator gave it: it wins.
    """
    if explicit_ratio is not None:
        kl = _predicted(calibration, explicit_ratio)
        return ServedRatio(explicit_ratio, kl, f"collection {collection!r}: blend at recompute ratio "
                                               f"{explicit_ratio:g} (--default-recompute-ratio)" + _said(kl))
    if calibration is None or fidelity_kl is None:
        why = ("the index has no calibration (rebuild it with `ragkv index`, which calibrates by default)"
               if calibration is None else "--fidelity-kl off")
        kl = _predicted(calibration, DEFAULT_RECOMPUTE_RATIO)
        return ServedRatio(DEFAULT_RECOMPUTE_RATIO, kl, f"collection {collection!r}: blend at recompute ratio "
                                                        f"{DEFAULT_RECOMPUTE_RATIO:g}, the default: {why}" + _said(kl))
    sample = f"over {calibration.sets} chunk sets of its corpus"
    chosen = calibration.choose(fidelity_kl)
    if chosen is None:  # none meets it: the closest measured, and the operator told so
        best = min(calibration.settings, key=lambda s: (s.kl_mean, -s.recompute_ratio))
        return ServedRatio(best.recompute_ratio, best.kl_mean, (
            f"collection {collection!r}: no calibrated ratio meets --fidelity-kl {fidelity_kl:g}; serving the "
            f"closest, {best.recompute_ratio:g} (predicted KL {best.kl_mean:.4f} +- {best.kl_stderr:.4f} {sample}). "
            f"Loosen --fidelity-kl, set --default-recompute-ratio, or serve --default-mode full"))
    cheaper = [s for s in calibration.settings if s.recompute_ratio < chosen.recompute_ratio]
    missed = f"; {cheaper[-1].recompute_ratio:g} predicts {cheaper[-1].kl_mean:.4f}" if cheaper else ""
    return ServedRatio(chosen.recompute_ratio, chosen.kl_mean, (
        f"collection {collection!r}: blend at recompute ratio {chosen.recompute_ratio:g}, the cheapest whose "
        f"calibrated KL to full prefill meets --fidelity-kl {fidelity_kl:g}: predicted {chosen.kl_mean:.4f} "
        f"+- {chosen.kl_stderr:.4f} {sample}{missed}"))


def request_ratio(collection: str, calibration: Calibration | None, served: ServedRatio, *,
                  ratio: float | None = None, fidelity_kl: float | None = None,
                  calibrated_path: bool = True) -> RequestRatio:
    """The ratio one request runs at.

    Args:
        served: the collection's choice for requests that set none.
        ratio: the request's (or the server's for its path: --system-prompt-recompute-ratio); None = served.
        fidelity_kl: the request's target instead of a ratio.
        calibrated_path: whether the calibration measured the path it runs (False: its own system
            prompt in front of the chunks, which moves every chunk's KV): no KL is predicted then.

    Raises:
        InvalidArgumentError: a target on a collection that has no calibration.
    """
    if fidelity_kl is not None:
        if calibration is None:
            raise InvalidArgumentError("fidelity_kl", f"collection {collection!r} has no calibration (its index was "
                                                      "built with --calibrate off, or before calibration): rebuild "
                                                      "it with `ragkv index`, or send recompute_ratio")
        chosen = calibration.choose(fidelity_kl)
        if chosen is None:
            return RequestRatio(None, 0.0)  # no blend setting meets it: full prefill is exact
        return RequestRatio(chosen.recompute_ratio, chosen.kl_mean if calibrated_path else None)
    if ratio is None:
        return RequestRatio(served.ratio, served.predicted_kl if calibrated_path else None)
    return RequestRatio(ratio, _predicted(calibration, ratio) if calibrated_path else None)


def _predicted(calibration: Calibration | None, ratio: float) -> float | None:
    """The calibration's KL at exactly `ratio` (query selector); None when it did not measure it."""
    setting = None if calibration is None else calibration.setting(ratio)
    return None if setting is None else setting.kl_mean


def _said(kl: float | None) -> str:
    return "" if kl is None else f" (calibrated: predicted KL {kl:.4f})"
