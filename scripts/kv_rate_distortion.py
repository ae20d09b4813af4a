"""How few bits a chunk's stored KV can take at a given fidelity: the stored formats against the
best a transform coder can do, out of sample.

    python scripts/kv_rate_distortion.py musique_dev.json --calib 40:75 --test 0:30 --ctxs 2 \
        --model smollm2-135m-instruct --kl 15

Issue 56 asks for 1/8 of bf16's bytes (2 bits an element, everything included) at KL at most
0.005. This measures whether any coder of the kind the anchors use can get there on a model:

1. the passages of the calibration questions (`--calib`) are prefilled, and per layer and KV
   head a PCA basis of K (before RoPE) and of V is fitted (`fit_basis`);
2. the test questions' passages (`--test`, disjoint) are coded in that basis with one uniform
   step per (layer, head), the same multiple of its RMS everywhere (entropy-coded scalar
   quantization, ECSQ: at high rate the same step for every coefficient is MSE-optimal, so the
   bits go where the variance is, as reverse water-filling would put them). Bits are counted as
   the empirical entropy of each coefficient's codes over its chunk: what an ideal adaptive
   arithmetic coder would reach, a lower bound on any real one (CacheGen's included), with no
   per-chunk side information counted. The step is tuned on the calibration chunks to hit each
   rate (`--rates`), then reported on the test chunks;
3. it prints, per K and V, the relative error (squared error over the centred energy, per
   chunk, averaged) of int8, int4 and int2 (`kvstore.compression`'s pack and unpack, as files
   store them) and of ECSQ at each rate, and the rate at which ECSQ matches int4's error;
4. with `--kl N`, runs `ragkv eval --kv-compression int4,int2`'s measurement over the first N
   test questions with ECSQ at the first of `--rates` in the int2 slot (reported as
   "ecsq"): the KL of each mode's next-token distribution to the uncompressed KV's, and the
   answers' F1 against full prefill.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Basis:
    """One role's (K or V) PCA per layer and KV head."""

    mean: torch.Tensor  # [L, Hkv, 1, D]
    vecs: torch.Tensor  # [L, Hkv, D, D], columns by falling variance
    rms: torch.Tensor  # [L, Hkv, 1, 1], RMS of the centred coefficients


def fit_basis(chunks: list[torch.Tensor]) -> Basis:
    """PCA of `[L, Hkv, T, D]` chunks pooled over their tokens (float64 for the eigensolve)."""
    x = torch.cat([c.double() for c in chunks], dim=2)  # [L, Hkv, N, D]
    mean = x.mean(dim=2, keepdim=True)
    xc = x - mean
    cov = xc.transpose(2, 3) @ xc / x.shape[2]  # [L, Hkv, D, D]
    lam, vecs = torch.linalg.eigh(cov)  # ascending
    rms = lam.clamp_min(0).mean(dim=-1).sqrt()[..., None, None]  # [L, Hkv, 1, 1]
    return Basis(mean.float(), vecs.flip(-1).float(), rms.float())


def ecsq(x: torch.Tensor, basis: Basis, step: float) -> tuple[torch.Tensor, float]:
    """Code `x` `[L, Hkv, T, D]` in `basis` with step `step` x RMS; returns (reconstruction,
    bits an element: the empirical entropy of each coefficient's codes over the chunk's tokens)."""
    delta = step * basis.rms  # [L, Hkv, 1, 1]
    y = (x.float() - basis.mean) @ basis.vecs  # [L, Hkv, T, D]
    q = torch.round(y / delta)  # [L, Hkv, T, D]
    recon = (q * delta) @ basis.vecs.transpose(-1, -2) + basis.mean
    return recon.to(x.dtype), entropy_bits(q)


def entropy_bits(q: torch.Tensor) -> float:
    """Mean over elements of each row's empirical entropy, rows = (layer, head, lane) over tokens."""
    n_layers, hkv, t, d = q.shape
    rows = q.permute(0, 1, 3, 2).reshape(-1, t)  # [L * Hkv * D, T]
    idx = (rows - rows.amin(dim=1, keepdim=True)).long()  # [R, T], from 0
    counts = torch.zeros(rows.shape[0], int(idx.max()) + 1).scatter_add_(1, idx, torch.ones_like(rows))
    p = counts / t
    h = -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(dim=1)  # [R] bits a token
    return float(h.mean())


def relative_error(recon: torch.Tensor, x: torch.Tensor) -> float:
    """Squared error over the energy of `x` about its per-lane mean (0 = exact)."""
    x = x.float()
    centred = x - x.mean(dim=2, keepdim=True)
    return float(((recon.float() - x) ** 2).sum() / (centred ** 2).sum())


def step_for(chunks: list[torch.Tensor], basis: Basis, *, bits: float | None = None,
             error: float | None = None) -> float:
    """The step (in RMS) at which `chunks` code at `bits` an element, or at relative `error`."""
    lo, hi = 0.02, 4.0  # rate falls and error rises with the step
    for _ in range(16):  # halves the bracket in log each time: it ends within a factor 200 ** 2**-16
        mid = (lo * hi) ** 0.5
        coded = [ecsq(c, basis, mid) for c in chunks]
        if bits is not None:
            over = sum(b for _, b in coded) / len(coded) > bits  # too many bits: a larger step
        else:
            over = sum(relative_error(r, c) for (r, _), c in zip(coded, chunks, strict=True)) / len(chunks) < error
        lo, hi = (mid, hi) if over else (lo, mid)
    return (lo * hi) ** 0.5


def _questions(text: str) -> range:
    a, _, b = text.partition(":")
    return range(int(a), int(b))


def prefill_chunks(dataset: Path, questions: range, ctxs: int, model: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V `[L, Hkv, T, D]` of the first `ctxs` passages of each question, as the index stores them."""
    from ragkv.cli.dataset import DEFAULT_INSTRUCTION, load_dataset
    from ragkv.engine import Engine, load_model

    cases, _ = load_dataset(dataset, questions.stop, ctxs)
    eng = Engine(load_model(model), system_prompt=DEFAULT_INSTRUCTION)
    prefix = eng.prompt.prefix_ids()
    ks, vs = [], []
    for case in cases[questions.start:]:
        for c in case.chunks:
            kv = eng.prefill(prefix, eng.prompt.chunk_ids(c))
            ks.append(kv.k.clone())
            vs.append(kv.v.clone())
    return ks, vs


def stored_format_errors(chunks: list[torch.Tensor], role: str) -> dict[str, float]:
    from ragkv.kvstore.compression import Compression, pack, unpack

    out = {}
    for name in ("int8", "int4", "int2"):
        c = Compression(name)
        errs = [relative_error(unpack(pack(x, c, role), c, role, tuple(x.shape[1:]), torch.float32), x) for x in chunks]
        out[name] = round(sum(errs) / len(errs), 5)
    return out


def kl_eval(args: argparse.Namespace, bases: dict[str, Basis], step: dict[str, float]) -> dict:
    """`ragkv eval --kv-compression int4,int2` over the first `--kl` test questions, ECSQ in int2's slot."""
    from ragkv.cli.eval import served_defaults
    from ragkv.cli.kv_compression_eval import run_compression_eval
    from ragkv.cli.main import build_parser
    from ragkv.kvstore import KVEntry, fileformat
    from ragkv.kvstore.compression import Compression

    real_encode = fileformat.encode

    def encode(entry: KVEntry, compression: Compression = Compression.NONE, extra: dict | None = None) -> bytes:
        if Compression(compression) is Compression.INT2:
            k, _ = ecsq(entry.k, bases["k"], step["k"])
            v, _ = ecsq(entry.v, bases["v"], step["v"])
            entry, compression = dataclasses.replace(entry, k=k, v=v), Compression.NONE
        return real_encode(entry, compression, extra)

    ns = build_parser().parse_args(["eval", "--dataset", str(args.dataset), "--n", str(args.kl), "--ctxs",
                                    str(args.kl_ctxs), "--kv-compression", "int4,int2", "--modes", args.modes,
                                    "--max-new-tokens", "32", "--model", args.model])
    served_defaults(ns)
    fileformat.encode = encode
    try:
        report = run_compression_eval(ns)
    finally:
        fileformat.encode = real_encode
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", type=Path, help="CacheBlend-format QA file (MuSiQue)")
    ap.add_argument("--calib", default="40:75", help="questions a:b whose passages fit the basis and the steps")
    ap.add_argument("--test", default="0:30", help="questions a:b, disjoint, reported on")
    ap.add_argument("--ctxs", type=int, default=2, help="passages a question (each one chunk)")
    ap.add_argument("--rates", default="2.0,3.0", help="ECSQ bits an element to report (2.0 = 1/8 of bf16)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kl", type=int, default=0, metavar="N", help="also run the KL eval over N test questions")
    ap.add_argument("--kl-ctxs", type=int, default=5, help="passages a question in the KL eval")
    ap.add_argument("--modes", default="full,reuse,blend", help="modes of the KL eval")
    args = ap.parse_args(argv)
    calib, test = _questions(args.calib), _questions(args.test)
    if set(calib) & set(test) or (args.kl and set(calib) & set(range(args.kl))):
        raise SystemExit(f"--calib {args.calib} overlaps the questions reported on")
    rates = [float(r) for r in args.rates.split(",")]
    cal = dict(zip("kv", prefill_chunks(args.dataset, calib, args.ctxs, args.model), strict=True))
    tst = dict(zip("kv", prefill_chunks(args.dataset, test, args.ctxs, args.model), strict=True))
    out: dict = {"model": args.model, "calib": args.calib, "test": args.test, "ctxs": args.ctxs,
                 "chunks": {"calib": len(cal["k"]), "test": len(tst["k"])}, "roles": {}}
    bases, first_step = {}, {}
    for role in "kv":
        basis = bases[role] = fit_basis(cal[role])
        stored = stored_format_errors(tst[role], role)
        row: dict = {"stored_formats": stored, "ecsq": []}
        for rate in rates:
            s = step_for(cal[role], basis, bits=rate)
            first_step.setdefault(role, s)
            coded = [ecsq(x, basis, s) for x in tst[role]]
            row["ecsq"].append({"target_bits": rate, "step_rms": round(s, 4),
                                "bits": round(sum(b for _, b in coded) / len(coded), 3),
                                "error": round(sum(relative_error(r, x) for (r, _), x in zip(coded, tst[role], strict=True))
                                               / len(coded), 5)})
        s = step_for(cal[role], basis, error=stored["int4"])
        coded = [ecsq(x, basis, s) for x in tst[role]]
        row["bits_at_int4_error"] = round(sum(b for _, b in coded) / len(coded), 3)
        out["roles"][role] = row
        print(f"{role}: {json.dumps(row)}", file=sys.stderr)
    if args.kl:
        out["kl_eval"] = {"ecsq_bits": rates[0], "report": kl_eval(args, bases, first_step)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
