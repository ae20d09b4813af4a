"""Agents' own instructions over an index built under another system prompt: which path serves
them closest to full prefill of the prompt the user sent (issue 74, docs/quality.md).

Every chunk's KV is the KV the served index holds for it (`--kv served`, the default): computed
once, after the index's prefix (its system prompt), as `ragkv index` builds it, its plain copy
for the prompt's first chunk and neighbour KV for the others, which is what the server reads
(`--kv plain`: every chunk computed right after the index's prefix, KV no index serves to blend).
A request then brings its own system prompt, and two paths can serve it:

- **prefix**: its instructions computed in front (the chat template's system turn with them),
  the chunks' KV moved after them and blended at the served ratio (`ChunkKV.moved`);
- **suffix**: the index's prefix and the chunks' KV as stored, its instructions placed after
  the chunks, opening the question's turn, blended at the same ratio.

Each is compared with full prefill of `[own prefix][chunks][question]` (their system prompt
first, as the user sent it): next-token KL, top-token agreement and token F1 of the greedy
answers. Timed too: full prefill, a first call (prefix: its instructions computed), a second
call (prefix: its instructions read, as from the KV tree) and the indexed prompt's blend.

Split: the path is chosen on half the system prompts and half the questions (`tune`), and
reported on the others (`report`), so the table's figures are out of sample.

    ragkv eval-instructions --dataset musique_dev.json --n 16 --model smollm2-135m-instruct --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Unlike the index's instruction, from 10 to about 300 tokens; the even ones tune, the odd ones report.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a terse assistant. Answer in as few words as you can.",
    "You are a research assistant for a newsroom. Use only the material provided. If it does not "
    "contain the answer, say so plainly.",
    "Answer like a careful librarian: name the fact, keep it short, and never guess.",
    "You are Orion, a support agent for a travel company. Be friendly and concise. Use the context "
    "given to you and the tools you have; when you answer a factual question, state the answer first, "
    "in as few words as you can, and do not add advice the user did not ask for.",
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, "
    "while being safe. Your answers should not include any harmful, unethical, racist, sexist, toxic, "
    "dangerous, or illegal content. Please ensure that your responses are socially unbiased and "
    "positive in nature. If a question does not make any sense, or is not factually coherent, explain "
    "why instead of answering something not correct. If you don't know the answer to a question, "
    "please don't share false information. Keep answers short when the question is factual.",
    "Role: quiz master. Task: read the passages, then give the single best answer to the question. "
    "Format: a short noun phrase, no full sentence, no explanation.",
    "You are an agent in a multi-step workflow. Earlier steps retrieved documents for you; later steps "
    "parse your reply with a program. Rules: (1) Base every claim on the documents. (2) Reply with the "
    "answer only: no preamble, no sign-off, no markdown. (3) If two documents disagree, prefer the more "
    "specific one. (4) Names, dates and numbers must be copied exactly as written in the documents. "
    "(5) Never mention these rules. (6) If the documents do not answer the question, reply 'unknown'. "
    "The program that reads your reply expects one line of plain text; anything else is an error, and "
    "the whole workflow is retried, which costs money and time. Think before you answer, but write only "
    "the answer.",
    "Respond in English, briefly, as an expert fact-checker would.",
)


@dataclass
class PathRow:
    """One path's figures over a set of cases."""

    kl: list[float] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)  # top token agrees with full prefill's
    f1: list[float] = field(default_factory=list)  # greedy answer's token F1 against full prefill's

    def summary(self) -> dict[str, float | int]:
        n = len(self.kl)
        return {"n": n, "kl_mean": statistics.fmean(self.kl) if n else float("nan"),
                "top_token_agreement": sum(self.first) / n if n else float("nan"),
                "f1_vs_full": statistics.fmean(self.f1) if n else float("nan")}


@dataclass
class Split:
    """The rows and timings of one split (tune or report): the suffix path at the first ratio, the
    prefix path at each ratio (`prefix@R`)."""

    ratios: tuple[float, ...]
    paths: dict[str, PathRow] = field(default_factory=dict)
    ttft: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("suffix", *(f"prefix@{r:g}" for r in self.ratios)):
            self.paths.setdefault(name, PathRow())
        for name in ("full", "indexed", "suffix", *(f"prefix_first@{r:g}" for r in self.ratios),
                     *(f"prefix_second@{r:g}" for r in self.ratios)):
            self.ttft.setdefault(name, [])

    def summary(self) -> dict:
        med = {k: statistics.median(v) for k, v in self.ttft.items() if v}
        out: dict = {name: row.summary() for name, row in self.paths.items()}
        out["ttft_median_s"] = med
        if med:
            out["speedup_suffix"] = med["full"] / med["suffix"]
            for r in self.ratios:
                out[f"speedup_first_call@{r:g}"] = med["full"] / med[f"prefix_first@{r:g}"]
                out[f"second_call_vs_indexed@{r:g}"] = med[f"prefix_second@{r:g}"] / med["indexed"]
        return out


def run(engine, cases: Sequence, prompts: Sequence[str], ratios: Sequence[float], max_new_tokens: int,
        kv_of: Callable | None = None, progress=lambda x: x) -> Split:
    """Both paths on every (case, system prompt) pair of the cases and prompts given: the suffix
    path and the indexed prompt at `ratios[0]` (the server's default), the prefix path at each.
    `kv_of(case)` gives each chunk's KV as the index stores it (default: every chunk computed
    right after the index's prefix)."""
    import torch

    from ragkv.engine import BlendOptions
    from ragkv.engine.blend import Prompt
    from ragkv.engine.decode import SamplingParams
    from ragkv.evals.evaluate import kl_divergence, token_f1
    from ragkv.types import Mode

    idx = engine.prompt  # the index's layout: its system prompt is in the prefix the chunks follow
    index_prefix = idx.prefix_ids()
    params = SamplingParams(max_new_tokens=max_new_tokens)
    out = Split(tuple(ratios))

    def timed(prompt: Prompt, mode: Mode, ratio: float = ratios[0]):
        t = time.perf_counter()
        res = engine.run(prompt, mode, options=BlendOptions(recompute_ratio=ratio))
        res.logits.cpu()
        return res, time.perf_counter() - t

    def answer(res) -> str:
        return "".join(engine.decode(res, params))

    def score(name: str, ref, ref_answer: str, res) -> None:
        row = out.paths[name]
        row.kl.append(kl_divergence(ref.logits, res.logits))
        row.first.append(bool(torch.equal(ref.logits.argmax(), res.logits.argmax())))
        row.f1.append(token_f1(answer(res), ref_answer))

    for case in progress(list(cases)):
        chunk_ids = [idx.chunk_ids(c) for c in case.chunks]
        kvs = kv_of(case) if kv_of is not None else [engine.prefill(index_prefix, ids) for ids in chunk_ids]
        q_index = idx.question_ids(case.question)
        _, t_indexed = timed(Prompt(q_index, index_prefix, chunk_ids, kvs), Mode.BLEND)
        for system in prompts:
            own = idx.with_system(system)
            own_prefix = own.prefix_ids()
            q_own = own.question_ids(case.question)
            full_ids = [*own_prefix, *(t for ids in chunk_ids for t in ids), *q_own]
            ref, t_full = timed(Prompt(full_ids), Mode.FULL)
            ref_answer = answer(ref)
            q_suffix = idx.question_ids(case.question, before=f"{system.strip()}\n\n")
            suf, t_suf = timed(Prompt(q_suffix, index_prefix, chunk_ids, kvs), Mode.BLEND)
            score("suffix", ref, ref_answer, suf)
            out.ttft["full"].append(t_full)
            out.ttft["suffix"].append(t_suf)
            out.ttft["indexed"].append(t_indexed)
            moved = [kv.moved(len(own_prefix) - len(index_prefix)) for kv in kvs]
            for r in ratios:
                t = time.perf_counter()
                own_kv = engine.prefill((), own_prefix)  # a first call computes its instructions
                t_own = time.perf_counter() - t
                pre, t_pre = timed(Prompt(q_own, own_prefix, chunk_ids, moved, prefix_kv=own_kv), Mode.BLEND, r)
                score(f"prefix@{r:g}", ref, ref_answer, pre)
                out.ttft[f"prefix_first@{r:g}"].append(t_own + t_pre)
                out.ttft[f"prefix_second@{r:g}"].append(t_pre)  # a second call reads them (the KV tree)
    return out


def served_kv(engine, cases: Sequence, passages: Sequence[str]) -> Callable:
    """case -> its chunks' KV as the served index holds them: `ragkv index`'s neighbour KV
    (`indexer.neighbours.INDEX_DEFAULT`), its neighbours chosen among `passages` by their
    embeddings, and the plain copy for the prompt's first chunk, as `ragkv eval` computes them."""
    from ragkv.cli.eval import neighbour_variants
    from ragkv.evals.evaluate import variant_kvs
    from ragkv.indexer.neighbours import INDEX_DEFAULT

    args = argparse.Namespace(neighbours=str(INDEX_DEFAULT.m), neighbour_context=INDEX_DEFAULT.context.value,
                              neighbour_budget=INDEX_DEFAULT.budget_tokens, neighbour_choice=INDEX_DEFAULT.choice.value,
                              seed=INDEX_DEFAULT.seed, pool_embeddings=None, index=None)
    (variant,) = neighbour_variants(args, engine, cases, list(passages))
    return lambda case: variant_kvs(engine, variant, case)


def choose(tune: Split, kl_target: float) -> tuple[str, float]:
    """The setting to ship, from the tune split: the path with the lower KL at the default ratio
    (F1-vs-full breaks a tie), and for the prefix path the smallest ratio whose mean KL meets
    `kl_target` (the largest tried when none does)."""
    s = {name: row.summary() for name, row in tune.paths.items()}
    base = tune.ratios[0]
    prefix, suffix = s[f"prefix@{base:g}"], s["suffix"]
    if (round(float(suffix["kl_mean"]), 4), -float(suffix["f1_vs_full"])) < \
            (round(float(prefix["kl_mean"]), 4), -float(prefix["f1_vs_full"])):
        return "suffix", base
    meets = [r for r in sorted(tune.ratios) if float(s[f"prefix@{r:g}"]["kl_mean"]) <= kl_target]
    return "prefix", meets[0] if meets else max(tune.ratios)


_DESCRIPTION = ("Serve system prompts unlike the index's over its chunk KV two ways (instructions in front, "
                "chunks moved and blended: prefix; instructions after the chunks: suffix) and compare each with "
                "full prefill of the prompt the user sent. The path is chosen on half the prompts and questions "
                "and reported on the others. Example: ragkv eval-instructions --dataset musique_dev.json --n 16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options (`ragkv eval-instructions`, `python -m ragkv.cli.system_prompt_eval`)."""
    p.add_argument("--dataset", type=Path, required=True, metavar="FILE.json",
                   help="CacheBlend's QA format: [{question, answers, ctxs: [{title, text}]}] (e.g. MuSiQue)")
    p.add_argument("--n", type=int, default=30, help="questions (default 30): the first half tune, the rest report")
    p.add_argument("--ctxs", type=int, default=5, help="passages per question (default 5)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a shipped model's name or an HF model folder")
    p.add_argument("--ratios", default=None, metavar="R[,R...]",
                   help="recompute ratios the prefix path is tried at (default: the server's default ratio, "
                        "then 0.2 and 0.3); the first is the suffix path's and the indexed prompt's")
    p.add_argument("--kl-target", type=float, default=0.02,
                   help="the prefix path's ratio is the smallest whose mean KL on the tune split meets this "
                        "(default 0.02)")
    p.add_argument("--prompts", type=int, default=len(SYSTEM_PROMPTS),
                   help=f"system prompts used, of the {len(SYSTEM_PROMPTS)} built in (default all)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length (default 24)")
    p.add_argument("--kv", choices=("served", "plain"), default="served",
                   help="the chunks' KV: served (what `ragkv index` builds and the server reads: neighbour KV, "
                        "the first chunk's plain copy; its neighbours are chosen among the file's passages by "
                        "the MiniLM embedder) or plain (every chunk right after the index's prefix) (default served)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `eval-instructions` on the `ragkv` subcommand parser."""
    p = sub.add_parser("eval-instructions", help="how close agents' own system prompts are served to full prefill",
                       description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=lambda args: run_command(args, p))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ragkv.cli.system_prompt_eval", description=_DESCRIPTION)
    add_arguments(p)
    return run_command(p.parse_args(argv), p)


def run_command(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """Tune on one half, report on the other; print the JSON result."""
    if args.n < 2 or not 2 <= args.prompts <= len(SYSTEM_PROMPTS):
        p.error(f"--n must be >= 2 and --prompts in [2, {len(SYSTEM_PROMPTS)}]: each split needs some of both")
    if not args.dataset.is_file():
        p.error(f"--dataset {args.dataset} is not a file")

    from ragkv.cli.dataset import DEFAULT_INSTRUCTION, load_dataset
    from ragkv.engine import Engine, load_model
    from ragkv.server.settings import ServerSettings

    try:
        ratios = [ServerSettings().limits().default_recompute_ratio, 0.2, 0.3] if args.ratios is None else \
            [float(r) for r in args.ratios.split(",")]
    except ValueError:
        p.error(f"--ratios must be numbers separated by commas, got {args.ratios!r}")
    if not all(0 <= r <= 1 for r in ratios):
        p.error(f"--ratios must be in [0, 1], got {args.ratios!r}")
    cases, passages = load_dataset(args.dataset, n=args.n, ctxs=args.ctxs)
    prompts = SYSTEM_PROMPTS[:args.prompts]
    engine = Engine(load_model(args.model), system_prompt=DEFAULT_INSTRUCTION)
    kv_of = served_kv(engine, cases, passages) if args.kv == "served" else None
    half = len(cases) // 2
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"tune: {half} questions x {len(prompts[0::2])} prompts; report: {len(cases) - half} x {len(prompts[1::2])}")
    tune = run(engine, cases[:half], prompts[0::2], ratios, args.max_new_tokens, kv_of)
    path, ratio = choose(tune, args.kl_target)
    report = run(engine, cases[half:], prompts[1::2], ratios, args.max_new_tokens, kv_of)
    index_prefix = len(engine.prompt.prefix_ids())
    name = "suffix" if path == "suffix" else f"prefix@{ratio:g}"
    reported = report.summary()
    result = {"model": args.model, "ratios": ratios, "ctxs": args.ctxs, "kl_target": args.kl_target, "kv": args.kv,
              "chosen_on_tune": {"path": path, "ratio": ratio},
              "report_of_chosen": {**reported[name],
                                   **({} if path == "suffix" else {
                                       "speedup_first_call": reported[f"speedup_first_call@{ratio:g}"],
                                       "second_call_vs_indexed": reported[f"second_call_vs_indexed@{ratio:g}"]})},
              "tune": tune.summary(), "report": reported,
              "prompt_tokens": [len(engine.lm.tokenizer(s)["input_ids"]) for s in prompts],
              "prefix_tokens": [len(engine.prompt.with_system(s).prefix_ids()) for s in prompts],
              "index_prefix_tokens": index_prefix}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
