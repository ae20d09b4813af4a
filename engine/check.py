"""The correctness gate: does ragkv compute this model as transformers does?

`check_model` runs a short RAG prompt through transformers' own forward and through
ragkv's engine, and checks four things:

- logits: the last position's logits of full prefill against transformers' forward
  (max abs difference, top-1 agreement);
- blend at ratio 1.0 against full prefill (every chunk token recomputed: the same sums);
- reuse of a chunk at the positions it was computed at against full prefill (its KV
  is exact there, so any difference is a bug in storing or re-rotating K);
- greedy decode against transformers' `generate` (token for token);
- where the family decodes over one KV pool (`engine.decode_graphs`, CUDA's default path),
  greedy decode over the pool, eagerly, against the same `generate` tokens.

`ragkv check-model MODEL` prints the verdicts; `ragkv serve` and `ragkv index` run the
quick form at start and refuse a model that fails it (`--skip-model-check` overrides).

Tolerances scale with the logits' magnitude (a 135M model's logits reach ~20, a tiny
random model's ~1) and with the dtype: float32 must agree to 1e-4 of that scale with
transformers and 1e-5 between ragkv's own modes; bfloat16 and float16 round every
product to 8 (11) bits, so ragkv and transformers differ there by as much as either
differs from float32: 5e-2 of the scale, with the top-1 token the same.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragkv.engine.blend import Prompt
from ragkv.engine.decode_graphs import unsupported_reason
from ragkv.errors import ModelCheckError

if TYPE_CHECKING:
    from ragkv.engine.blend import BlendResult
    from ragkv.engine.model_loading import LoadedModel
    from ragkv.engine.runtime import Engine

log = logging.getLogger(__name__)

_TEXT = ("The archive keeps the secret number 4721 in a sealed box.",
         "Alice met Bob in Paris, the capital of France, on a quiet day.",
         "The quick brown fox jumps over the lazy dog near the river bank.")
_QUESTION = "What is the secret number, and where did Alice meet Bob?"


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome."""

    name: str
    passed: bool
    value: float  # the measured number: max abs difference, or tokens that agree
    detail: str  # the numbers behind the verdict, in words

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name:<28} {self.detail}"


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(against transformers, between ragkv's modes), as fractions of the logits' scale."""
    return (1e-4, 1e-5) if dtype == torch.float32 else (5e-2, 5e-2)


@torch.inference_mode()
def check_model(lm: LoadedModel, quick: bool = False, decode_tokens: int | None = None) -> list[Check]:
    """Run the gate's checks on a loaded model; `quick` = a shorter prompt and decode (start-up)."""
    from ragkv.engine.decode import SamplingParams
    from ragkv.engine.runtime import Engine
    from ragkv.types import Mode

    engine = Engine(lm)
    fmt = engine.prompt
    prefix_ids = fmt.prefix_ids()
    chunk_ids = [fmt.chunk_ids(t) for t in (_TEXT[:2] if quick else _TEXT)]
    q_ids = fmt.question_ids(_QUESTION)
    ids = [*prefix_ids, *(t for c in chunk_ids for t in c), *q_ids]
    dev = lm.device
    n_new = decode_tokens or (4 if quick else 16)
    tol_ref, tol_self = tolerances(lm.dtype)

    full = engine.run(Prompt(q_ids, prefix_ids, chunk_ids, None), Mode.FULL, reserve_tokens=n_new + 1)
    ref = lm.model(torch.tensor([ids], device=dev)).logits[0, -1].float()  # [V]
    scale = max(1.0, float(ref.abs().max()))
    checks = []
    diff = float((full.logits - ref).abs().max())
    same_top = int(full.logits.argmax()) == int(ref.argmax())
    checks.append(Check("logits vs transformers", diff <= tol_ref * scale and same_top, diff,
                        f"max abs diff {diff:.2e} (limit {tol_ref * scale:.1e}), top-1 "
                        f"{'agrees' if same_top else 'differs'}, {len(ids)} tokens"))

    if not engine.recurrent:  # a hybrid serves FULL only: no chunk KV to blend or reuse
        checks += _chunk_checks(engine, prefix_ids, chunk_ids, q_ids, full, tol_self * scale)

    pools = unsupported_reason(lm.adapter) is None  # the family decodes over one pool on CUDA: gate that too
    pooled_from = copy.deepcopy(full) if pools else None  # the decode below writes into full's cache
    stream = engine.decode(full, SamplingParams(max_new_tokens=n_new))
    for _ in stream:
        pass
    ours = list(stream.token_ids)
    out = lm.model.generate(torch.tensor([ids], device=dev), attention_mask=torch.ones(1, len(ids), device=dev,
                            dtype=torch.long), max_new_tokens=n_new, do_sample=False, top_k=None, top_p=None,
                            temperature=None, eos_token_id=list(lm.eos_token_ids) or None,
                            pad_token_id=lm.tokenizer.pad_token_id or 0)
    theirs = out[0, len(ids):].tolist()
    while theirs and theirs[-1] in lm.eos_token_ids:  # generate keeps the EOS; our stream ends before it
        theirs.pop()
    agree = sum(a == b for a, b in zip(ours, theirs))
    checks.append(Check("greedy decode vs generate", ours == theirs, agree,
                        f"{agree} of {max(len(ours), len(theirs))} tokens "
                        "agree" + ("" if ours == theirs else f" (ours {ours[:8]}..., theirs {theirs[:8]}...)")))
    if pooled_from is not None:
        pooled = _pooled_greedy(lm, pooled_from, n_new)
        agree = sum(a == b for a, b in zip(pooled, theirs))
        checks.append(Check("pooled decode vs generate", pooled == theirs, agree,
                            f"{agree} of {max(len(pooled), len(theirs))} tokens agree" + (
                                "" if pooled == theirs else f" (ours {pooled[:8]}..., theirs {theirs[:8]}...)")))
    return checks


def _pooled_greedy(lm: LoadedModel, prompt: BlendResult, n_new: int) -> list[int]:
    """Up to `n_new` greedy tokens after `prompt`, decoded over one decode pool (eagerly: the
    step a CUDA graph captures), ending before an end-of-sequence token as a stream does."""
    from ragkv.engine.decode_graphs import PooledDecoder

    cache = prompt.cache
    dec = PooledDecoder(lm, pool_tokens=cache.length + n_new + 64, graphs=False)
    tokens: list[int] = []
    token = int(prompt.logits.argmax())
    while len(tokens) < n_new and token not in lm.eos_token_ids:
        tokens.append(token)
        if len(tokens) < n_new:
            token = int(dec.step([cache], [token])[0].argmax())
    dec.release(cache)
    return tokens


def _chunk_checks(engine: Engine, prefix_ids: list[int], chunk_ids: list[list[int]], q_ids: list[int],
                  full: BlendResult, limit: float) -> list[Check]:
    """Blend at 1.0 against full, and a reused chunk against full (the chunk-KV modes)."""
    from ragkv.engine.blend import BlendOptions
    from ragkv.types import Mode

    checks = []
    chunks = [engine.prefill(prefix_ids, ids) for ids in chunk_ids]
    blend = engine.run(Prompt(q_ids, prefix_ids, chunk_ids, chunks), Mode.BLEND, BlendOptions(recompute_ratio=1.0))
    diff = float((blend.logits - full.logits).abs().max())
    checks.append(Check("blend at 1.0 vs full", diff <= limit, diff,
                        f"max abs diff {diff:.2e} (limit {limit:.1e})"))

    one = engine.run(Prompt(q_ids, prefix_ids, chunk_ids[:1], chunks[:1]), Mode.REUSE)
    one_full = engine.run(Prompt(q_ids, prefix_ids, chunk_ids[:1], None), Mode.FULL)
    diff = float((one.logits - one_full.logits).abs().max())
    checks.append(Check("reused chunk vs full", diff <= limit, diff,
                        f"max abs diff {diff:.2e} (limit {limit:.1e})"))
    return checks


_PASSED: set[tuple[str, str, str]] = set()  # (fingerprint, dtype, device) that passed in this process


def gate_model(lm: LoadedModel, skip: bool = False) -> None:
    """The quick gate `ragkv serve` and `ragkv index` run at start.

    Raises:
        ModelCheckError: a check failed; the message has every check's numbers.
    """
    if skip:
        log.warning("SKIPPING the model correctness gate (--skip-model-check): %s (%s) is served without "
                    "checking that ragkv computes it as transformers does; its answers may be wrong. "
                    "Run `ragkv check-model %s` to see.", lm.spec, lm.adapter.family.model_type, lm.spec)
        return
    key = (str(lm.fingerprint), str(lm.dtype), str(lm.device))
    if key in _PASSED:
        return
    checks = check_model(lm, quick=True)
    if not all(c.passed for c in checks):
        # A model computed wrongly fails every run. A first run that fails and a second that passes is
        # a one-off, seen about once in a hundred fresh CPU processes under load (the first full
        # prefill 2e-3 off while the runs after it agree with transformers; cause not yet found):
        # served, and said loudly.
        first, checks = checks, check_model(lm, quick=True)
        if all(c.passed for c in checks):
            log.warning("the model check of %s failed its first run and passed its second: ragkv computed it "
                        "differently once in this process (first: %s); serving it. Please report this with "
                        "`ragkv check-model %s`.", lm.spec, "; ".join(c.line() for c in first if not c.passed), lm.spec)
    if not all(c.passed for c in checks):
        raise ModelCheckError(
            f"model {lm.spec!r} ({lm.adapter.family.model_type}, {str(lm.dtype).removeprefix('torch.')}) fails "
            "ragkv's correctness gate, so it is not served:\n  " + "\n  ".join(c.line() for c in checks)
            + f"\nRun `ragkv check-model {lm.spec}` for the full report; --skip-model-check serves it anyway "
            "(its answers may be wrong).")
    _PASSED.add(key)
    log.info("model check passed for %s: %s", lm.spec, "; ".join(f"{c.name}: {c.detail}" for c in checks))
