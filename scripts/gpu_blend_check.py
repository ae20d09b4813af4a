"""The plain-first-chunk blend and focus paths on CUDA, on tiny random models (llama, gemma3_text),
float32 and bfloat16: ratio 1.0 against full prefill, a budget past an exact first chunk against
full prefill, where blend 0.15 picks its tokens, and what a focus lookup keeps. Run it on a GPU host
with ragkv installed: python scripts/gpu_blend_check.py (docs/quality.md, issue 39)."""
import torch

from ragkv.engine import BlendOptions, Engine, FocusOptions, Prompt, load_model
from ragkv.evals.testing import tiny_model_dir
from ragkv.types import Mode

CHUNKS = ["Paris is the capital of France. The secret number is 4721.",
          "Alice met Bob by the river. The quick brown fox jumps over the lazy dog.",
          "ragkv stores the KV cache of every chunk and blends them at query time.",
          "The lazy dog sleeps. 0123456789 are digits; abc are letters."]
Q = "What is the secret number?"
print(torch.cuda.get_device_name(0), torch.__version__)
for arch, fam in (("llama", False), ("gemma3_text", True)):
    d = tiny_model_dir(f"/tmp/m-{arch}", arch, seed=7, family=fam)
    for dtype in ("float32", "bfloat16"):
        eng = Engine(load_model(str(d), device="cuda", dtype=dtype))
        p = eng.prompt
        pre, ids, q = p.prefix_ids(), [p.chunk_ids(c) for c in CHUNKS], p.question_ids(Q)
        full = eng.run(Prompt(p.prompt_ids(CHUNKS, Q)), Mode.FULL).logits.float()
        plain = [eng.prefill(pre, i) for i in ids]
        nb = [eng.prefill(pre, ids[i], ids[(i + 1) % 4]) for i in range(4)]
        mixed = [plain[0], *nb[1:]]
        n, f = sum(k.num_tokens for k in plain), plain[0].num_tokens
        r1 = eng.run(Prompt.of(pre, nb, q), Mode.BLEND, options=BlendOptions(1.0)).logits.float()
        rest = eng.run(Prompt.of(pre, plain, q), Mode.BLEND, options=BlendOptions((n - f) / n))
        mix = eng.run(Prompt.of(pre, mixed, q), Mode.BLEND, options=BlendOptions(0.15))
        foc = eng.run(Prompt.of(pre, mixed, q), Mode.FOCUS,
                      options=BlendOptions(0.15, focus=FocusOptions(keep=1.0, handover=True)))
        logp = torch.log_softmax(full, -1)
        kl = float(torch.sum(logp.exp() * (logp - torch.log_softmax(mix.logits.float(), -1))))
        first = len(pre) + f
        print(f"{arch:12s} {dtype:9s} ratio1-vs-full max|d| {(r1 - full).abs().max().item():.2e} | "
              f"exact-first rest-vs-full max|d| {(rest.logits.float() - full).abs().max().item():.2e} "
              f"first untouched {int(rest.recomputed.min()) >= first} | mixed blend 0.15: "
              f"picks {mix.recomputed.numel()}={round(0.15 * n)} none-in-first {int(mix.recomputed.min()) >= first} "
              f"KL {kl:.4f} | focus lookup used {foc.used_chunks} handed_over {foc.handed_over}", flush=True)
