"""`ragkv eval --kv-compression int8,fp8`: what compressing the KV files costs and saves.

Cases are synthetic (`--synthetic niah`, the default) or a QA file (`--dataset FILE.json`:
CacheBlend's format, MuSiQue; `--n` questions over `--ctxs` passages each). For each case
the chunks' KV is prefilled once (the indexer's work), written as a KV file
with no compression and with each asked-for compression (kvstore.fileformat, exactly what
`ragkv index --kv-compression` writes), read back, and every mode runs over the
uncompressed and the read-back KV. Per compression and mode:
- kl_mean: KL(uncompressed || compressed) of the next-token distribution at the last prompt
  position, in nats (0 = no change);
- first_token_agreement / agreement: the first token / the greedy answer equals the one over
  uncompressed KV;
- accuracy / accuracy_uncompressed: an expected answer is in the answer's first sentence;
- f1 / f1_uncompressed: token F1 of the answer's first sentence against the best expected answer;
- f1_vs_full / f1_vs_full_uncompressed (when --modes has full): token F1 of the answer against
  full prefill's (fidelity to the path that reads no chunk KV);
- bytes_per_token, bytes_ratio: file bytes per chunk token, and against the uncompressed file;
- read_median_s: median seconds to verify, parse and dequantize one chunk's file from memory
  (what a page-cache hit costs; a disk read adds bytes / disk bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from typing import Any

COMPRESSIONS = ("none", "int8", "fp8", "int4", "int2")


def parse_compressions(text: str) -> list[str]:
    """`--kv-compression int8,fp8` -> ["int8", "fp8"] ("none" is always the reference).

    Raises:
        ValueError: An unknown name.
    """
    names = [c.strip().lower() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in COMPRESSIONS]
    if bad or not names:
        raise ValueError(f"--kv-compression takes a comma list of int8, fp8, int4, int2 (none is the reference), "
                         f"got {text!r}")
    return [c for c in dict.fromkeys(names) if c != "none"]


def run_compression_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Measure each compression of --kv-compression against uncompressed KV; returns the report."""
    import torch
    from tqdm import tqdm

    from ragkv.engine import BlendOptions, ChunkKV, Engine, Prompt, SamplingParams, load_model, tune_host_allocator
    from ragkv.evals.evaluate import best_f1, first_sentence, kl_divergence, normalize, token_f1
    from ragkv.evals.synthetic import make_cases
    from ragkv.kvstore import KVEntry, hash_prefix
    from ragkv.kvstore.compression import Compression, check_supported
    from ragkv.kvstore.fileformat import decode, encode
    from ragkv.retriever.chunk_keys import chunk_key
    from ragkv.types import Mode

    tune_host_allocator()
    compressions = [check_supported(Compression(c)) for c in parse_compressions(args.kv_compression)]
    asked = [m.strip() for m in args.modes.split(",") if m.strip()]
    with_full = "full" in asked
    modes = [Mode(m) for m in asked if m != "full"]
    if not modes:
        raise ValueError("--kv-compression needs a mode that reads chunk KV in --modes: reuse, blend or focus")
    dataset = getattr(args, "dataset", None)
    if getattr(args, "instruction", None) is not None:
        instruction = args.instruction
    elif dataset:
        from ragkv.cli.dataset import DEFAULT_INSTRUCTION as instruction
    else:
        from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT as instruction
    engine = Engine(load_model(args.model), system_prompt=instruction)
    lm, p = engine.lm, engine.prompt
    tok = lm.tokenizer
    if dataset:
        from ragkv.cli.dataset import DEFAULT_QUESTION_SUFFIX, load_dataset

        suffix = DEFAULT_QUESTION_SUFFIX if getattr(args, "question_suffix", None) is None else args.question_suffix
        cases, _ = load_dataset(dataset, args.n, args.ctxs, suffix)
    else:
        n_chunks = max(1, args.context // args.chunk_tokens)
        cases = make_cases(args.synthetic or "niah", args.n, n_chunks, args.chunk_tokens,
                           lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), args.seed)
    ratio = float(args.ratio.split(",")[0])
    options = BlendOptions(recompute_ratio=ratio, selector=args.selector.split(",")[0].strip())
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prefix_ids = p.prefix_ids()
    prefix_hash = hash_prefix(prefix_ids)
    sums: dict[tuple[str, str], Counter] = {}
    sizes: dict[str, list[int]] = {c: [] for c in ["none", *[c.value for c in compressions]]}
    reads: dict[str, list[float]] = {c: [] for c in sizes}
    tokens = 0

    def read_back(kvs: list, compression: Compression) -> list:
        out = []
        for kv in kvs:
            key = chunk_key(lm.fingerprint, lm.tokenizer_fingerprint, prefix_ids, kv.token_ids.tolist())
            data = encode(KVEntry.of(kv, key, lm.fingerprint, lm.tokenizer_fingerprint, prefix_hash),
                          compression)
            sizes[compression.value].append(len(data))
            t = time.perf_counter()
            entry = decode(bytearray(data), expected_key=key, model_fp=lm.fingerprint,
                           tokenizer_fp=lm.tokenizer_fingerprint)
            back = ChunkKV.from_stored(entry, lm.device, lm.dtype)
            reads[compression.value].append(time.perf_counter() - t)
            out.append(back)
        return out

    for case in tqdm(cases, desc="kv-compression eval", unit="case", file=sys.stderr):
        chunk_ids = [p.chunk_ids(c) for c in case.chunks]
        tokens += sum(len(ids) for ids in chunk_ids)
        kvs = [engine.prefill(prefix_ids, ids) for ids in chunk_ids]
        q = p.question_ids(case.question)
        plain = read_back(kvs, Compression.NONE)  # bit-exact: the reference
        full_answer = None
        if with_full:
            full = engine.run(Prompt.of(prefix_ids, plain, q), Mode.FULL, options=options)
            full_answer = "".join(engine.decode(full, params))
        refs = {}
        for mode in modes:
            res = engine.run(Prompt.of(prefix_ids, plain, q), mode, options=options)
            refs[mode] = (res, "".join(engine.decode(res, params)))
        for compression in compressions:
            packed = read_back(kvs, compression)
            for mode in modes:
                ref, ref_answer = refs[mode]
                res = engine.run(Prompt.of(prefix_ids, packed, q), mode, options=options)
                answer = "".join(engine.decode(res, params))
                s = sums.setdefault((compression.value, mode.value), Counter())
                s["n"] += 1
                s["kl"] += kl_divergence(ref.logits, res.logits)
                s["first"] += int(res.logits.argmax()) == int(ref.logits.argmax())
                s["agree"] += normalize(answer) == normalize(ref_answer)
                s["acc"] += any(normalize(a) in normalize(first_sentence(answer)) for a in case.answers)
                s["acc_ref"] += any(normalize(a) in normalize(first_sentence(ref_answer)) for a in case.answers)
                s["f1"] += best_f1(first_sentence(answer), case.answers)
                s["f1_ref"] += best_f1(first_sentence(ref_answer), case.answers)
                if full_answer is not None:
                    s["f1_full"] += token_f1(answer, full_answer)
                    s["f1_full_ref"] += token_f1(ref_answer, full_answer)
        del kvs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    none_bytes = sum(sizes["none"])
    report: dict[str, Any] = {"files": {}, "quality": {}}
    for name, sz in sizes.items():
        report["files"][name] = {
            "bytes_per_token": sum(sz) / tokens,  # each variant wrote every chunk once
            "bytes_ratio": sum(sz) / none_bytes if none_bytes else 0.0,
            "read_median_s": statistics.median(reads[name]) if reads[name] else 0.0,
        }
    for (comp, mode), s in sums.items():
        n = s["n"]
        report["quality"][f"{comp}/{mode}"] = {
            "n": n, "kl_mean": s["kl"] / n, "first_token_agreement": s["first"] / n, "agreement": s["agree"] / n,
            "accuracy": s["acc"] / n, "accuracy_uncompressed": s["acc_ref"] / n, "f1": s["f1"] / n,
            "f1_uncompressed": s["f1_ref"] / n,
        }
        if with_full:
            report["quality"][f"{comp}/{mode}"].update(f1_vs_full=s["f1_full"] / n,
                                                       f1_vs_full_uncompressed=s["f1_full_ref"] / n)
    report["config"] = {"model": args.model, "dtype": str(lm.dtype).removeprefix("torch."), "device": str(lm.device),
                        "dataset": str(dataset) if dataset else None, "ctxs": getattr(args, "ctxs", None),
                        "synthetic": None if dataset else args.synthetic or "niah", "n": args.n, "context": args.context,
                        "chunk_tokens": args.chunk_tokens, "modes": [m.value for m in modes], "ratio": ratio,
                        "selector": options.selector, "seed": args.seed}
    return report


def print_report(report: dict[str, Any]) -> None:
    """The report as two small tables."""
    print(f"{'file':6s} {'bytes/token':>12s} {'ratio':>6s} {'read s':>8s}")
    for name, f in report["files"].items():
        print(f"{name:6s} {f['bytes_per_token']:12.0f} {f['bytes_ratio']:6.3f} {f['read_median_s']:8.4f}")
    print(f"{'compression/mode':18s} {'n':>4s} {'KL':>8s} {'tok1':>5s} {'agree':>5s} {'acc':>5s} {'acc none':>8s} "
          f"{'F1':>5s} {'F1 none':>7s} {'F1full':>6s} {'F1full none':>11s}")
    for name, q in report["quality"].items():
        print(f"{name:18s} {q['n']:4d} {q['kl_mean']:8.5f} {q['first_token_agreement']:5.2f} "
              f"{q['agreement']:5.2f} {q['accuracy']:5.2f} {q['accuracy_uncompressed']:8.2f} "
              f"{q['f1']:5.2f} {q['f1_uncompressed']:7.2f} {q.get('f1_vs_full', float('nan')):6.2f} "
              f"{q.get('f1_vs_full_uncompressed', float('nan')):11.2f}")
