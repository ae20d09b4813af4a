"""Agents' own instructions over an index built under another system prompt: which path serves
them closest to full prefill of the prompt the user sent (issue 74, docs/quality.md).

Every chunk's KV is computed once, after the index's prefix (its system prompt), as `ragkv
index` stores it. A request then brings its own system prompt, and two paths can serve it:

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
from collections.abc import Sequence
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
    """The rows and timings of one split (tune or report)."""

    paths: dict[str, PathRow] = field(default_factory=lambda: {"prefix": PathRow(), "suffix": PathRow()})
    ttft: dict[str, list[float]] = field(default_factory=lambda: {
        "full": [], "prefix_first": [], "prefix_second": [], "suffix": [], "indexed": []})

    def summary(self) -> dict:
        med = {k: statistics.median(v) for k, v in self.ttft.items() if v}
        out: dict = {name: row.summary() for name, row in self.paths.items()}
        out["ttft_median_s"] = med
        if med:
            out["speedup_first_call"] = med["full"] / med["prefix_first"]
            out["second_call_vs_indexed"] = med["prefix_second"] / med["indexed"]
            out["speedup_suffix"] = med["full"] / med["suffix"]
        return out


def run(engine, cases: Sequence, prompts: Sequence[str], ratio: float, max_new_tokens: int,
        progress=lambda x: x) -> Split:
    """Both paths on every (case, system prompt) pair of the cases and prompts given."""
    import torch

    from ragkv.engine import BlendOptions
    from ragkv.engine.blend import Prompt
    from ragkv.engine.decode import SamplingParams
    from ragkv.evals.evaluate import kl_divergence, token_f1
    from ragkv.types import Mode

    idx = engine.prompt  # the index's layout: its system prompt is in the prefix the chunks follow
    index_prefix = idx.prefix_ids()
    opts = BlendOptions(recompute_ratio=ratio)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    out = Split()

    def timed(prompt: Prompt, mode: Mode):
        t = time.perf_counter()
        res = engine.run(prompt, mode, options=opts)
        res.logits.cpu()
        return res, time.perf_counter() - t

    def answer(res) -> str:
        return "".join(engine.decode(res, params))

    for case in progress(list(cases)):
        chunk_ids = [idx.chunk_ids(c) for c in case.chunks]
        kvs = [engine.prefill(index_prefix, ids) for ids in chunk_ids]  # as the index stores them
        q_index = idx.question_ids(case.question)
        _, t_indexed = timed(Prompt(q_index, index_prefix, chunk_ids, kvs), Mode.BLEND)
        for system in prompts:
            own = idx.with_system(system)
            own_prefix = own.prefix_ids()
            q_own = own.question_ids(case.question)
            full_ids = [*own_prefix, *(t for ids in chunk_ids for t in ids), *q_own]
            ref, t_full = timed(Prompt(full_ids), Mode.FULL)
            ref_answer = answer(ref)
            t = time.perf_counter()
            own_kv = engine.prefill((), own_prefix)  # a first call computes its instructions
            t_own = time.perf_counter() - t
            moved = [kv.moved(len(own_prefix) - len(index_prefix)) for kv in kvs]
            pre, t_pre = timed(Prompt(q_own, own_prefix, chunk_ids, moved, prefix_kv=own_kv), Mode.BLEND)
            q_suffix = idx.question_ids(case.question, before=f"{system.strip()}\n\n")
            suf, t_suf = timed(Prompt(q_suffix, index_prefix, chunk_ids, kvs), Mode.BLEND)
            for name, res in (("prefix", pre), ("suffix", suf)):
                row = out.paths[name]
                row.kl.append(kl_divergence(ref.logits, res.logits))
                row.first.append(bool(torch.equal(ref.logits.argmax(), res.logits.argmax())))
                row.f1.append(token_f1(answer(res), ref_answer))
            for k, v in (("full", t_full), ("prefix_first", t_own + t_pre), ("prefix_second", t_pre),
                         ("suffix", t_suf), ("indexed", t_indexed)):
                out.ttft[k].append(v)
    return out


def choose(tune: Split) -> str:
    """The path to ship: the lower mean KL on the tune split (F1-vs-full breaks a tie)."""
    s = {name: row.summary() for name, row in tune.paths.items()}
    return min(s, key=lambda name: (round(float(s[name]["kl_mean"]), 4), -float(s[name]["f1_vs_full"])))


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
    p.add_argument("--ratio", type=float, default=None, help="blend's recompute ratio (default: the server's)")
    p.add_argument("--prompts", type=int, default=len(SYSTEM_PROMPTS),
                   help=f"system prompts used, of the {len(SYSTEM_PROMPTS)} built in (default all)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length (default 24)")
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

    ratio = ServerSettings().default_recompute_ratio if args.ratio is None else args.ratio
    cases, _ = load_dataset(args.dataset, n=args.n, ctxs=args.ctxs)
    prompts = SYSTEM_PROMPTS[:args.prompts]
    engine = Engine(load_model(args.model), system_prompt=DEFAULT_INSTRUCTION)
    half = len(cases) // 2
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"tune: {half} questions x {len(prompts[0::2])} prompts; report: {len(cases) - half} x {len(prompts[1::2])}")
    tune = run(engine, cases[:half], prompts[0::2], ratio, args.max_new_tokens)
    chosen = choose(tune)
    report = run(engine, cases[half:], prompts[1::2], ratio, args.max_new_tokens)
    index_prefix = len(engine.prompt.prefix_ids())
    result = {"model": args.model, "ratio": ratio, "ctxs": args.ctxs, "chosen_on_tune": chosen,
              "tune": tune.summary(), "report": report.summary(),
              "prompt_tokens": [len(engine.lm.tokenizer(s)["input_ids"]) for s in prompts],
              "prefix_tokens": [len(engine.prompt.with_system(s).prefix_ids()) for s in prompts],
              "index_prefix_tokens": index_prefix}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
