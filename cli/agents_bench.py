"""`ragkv bench --agents N`: many agents' tool loops at once, against a KV tree too small for all
of them, under four tree policies in one run.

Each agent asks its own question (made of a chunk's words, so each retrieves its own chunks
and has its own path in the tree), then makes `--calls` - 1 more calls, each appending a tool
call and the tool's result (`--tool-result-chars` characters) as `ragkv bench --agent-loop`
does. Between two calls its tool runs: a sleep of a uniform random latency in
`--tool-latency LO,HI` seconds, seeded (`--seed`), the same for every policy; agents start at
seeded offsets within [0, HI]. Every call offers the tool, so every answer may end in tool calls.

The same agents run against four in-process servers on one index, one after the other:

- **unbounded**: a tree that holds every path (no eviction): the baseline. Its bytes after the
  run are the agents' working set;
- **lru**: the tree at `--kv-tree-bytes` (default: `--tree-share` of that working set), plain
  least-recently-used eviction (`--kv-tree-retain-max-s 0`);
- **retention**: the same budget, with retention that knows agents (engine/kv/tree.py): an
  answer's path is pinned ahead of LRU until the agent's next call, for the tool latency the
  server has learned (at most `--retain-max-s`);
- **spill**: retention, and what leaves the device spills to CPU memory (as much again as the
  device budget) and below that to disk (a temporary folder), read back when the agent returns
  (the KV tree's tiers, engine/kv/tree.py).

Per policy it reports the share of prompt tokens served from the tree
(`usage.tree_prompt_tokens / prompt_tokens`, over every call; with spill, of it the share read
back from CPU memory or disk), TTFT p50 and p95 (server-side)
of the calls after a tool result, the run's total time, the tree's evictions, and each
measure's ratio to the unbounded tree's.
"""

from __future__ import annotations

import json
import math
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

POLICIES = ("unbounded", "lru", "retention", "spill")
_UNBOUNDED = 1 << 40  # a tree budget no run here reaches: nothing is evicted
_REQUESTS_KV = 4 << 30  # --kv-budget-bytes past the tree's: admission never shrinks the tree
_DISK = 1 << 40  # the spill policy's disk budget: the tier below the host's holds the rest


def _latency_range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"--tool-latency takes LO,HI seconds (e.g. 0.5,3), got {text!r}") from None
    if not 0 <= lo <= hi or not math.isfinite(hi):
        raise ValueError(f"--tool-latency needs 0 <= LO <= HI, got {text!r}")
    return lo, hi


def _pct(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs by nearest rank (None when there is none)."""
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 4)


def _plans(n: int, calls: int, lo: float, hi: float, seed: int) -> list[tuple[float, list[float]]]:
    """Per agent: its start offset and each tool's latency (seeded: the same for every policy)."""
    plans = []
    for i in range(n):
        rng = random.Random(seed * 100_003 + i)
        plans.append((rng.uniform(0.0, hi), [rng.uniform(lo, hi) for _ in range(calls - 1)]))
    return plans


def _agent(addr: str, i: int, question: str, results: list[str], plan: tuple[float, list[float]], calls: int,
           max_new: int, top_k: int, t0: float, out: list[dict], errors: list[str]) -> None:
    from ragkv.cli.agent_bench import LOOKUP, _turns
    from ragkv.client import RagClient

    start, latencies = plan
    time.sleep(max(0.0, t0 + start - time.perf_counter()))
    with RagClient(addr, timeout=600) as client:
        for step in range(calls):
            try:
                stream = client.query(question, top_k=top_k, max_new_tokens=max_new, agent_turns=_turns(results, step),
                                      tools=[LOOKUP])
                for _ in stream:
                    pass
                stats = stream.result()
                out.append({"agent": i, "step": step, "ttft_s": stats.ttft_seconds,
                            "prompt_tokens": stats.usage.prompt_tokens, "tree_tokens": stats.usage.tree_prompt_tokens})
            except Exception as exc:  # counted and reported, never hidden
                errors.append(f"agent {i} step {step}: {exc}")
            if step < calls - 1:
                time.sleep(latencies[step])  # the tool runs


def _run_policy(args, index: Path, tree_bytes: int, retain_max_s: float, questions: list[str],
                results: list[list[str]], plans: list[tuple[float, list[float]]], spill_dir: Path | None = None) -> dict:
    """The agents against one fresh in-process server; its calls, their measures and its tree's."""
    from ragkv.cli.agent_bench import LOOKUP, WARM_UP
    from ragkv.client import RagClient
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.inprocess import InProcessServer
    from ragkv.server.settings import CollectionSpec, ServerSettings

    n = len(questions)
    settings = ServerSettings(
        indexes=(CollectionSpec("default", index),), host="127.0.0.1", port=0, metrics_port=None,
        model=None if args.index else args.model, kv_tree_bytes=tree_bytes, kv_budget_bytes=tree_bytes + _REQUESTS_KV,
        kv_tree_retain_max_s=retain_max_s, max_queue=n + 4, max_batch=max(1, n),
        kv_tree_host_bytes=tree_bytes if spill_dir is not None else 0, kv_tree_dir=spill_dir, kv_tree_disk_bytes=_DISK,
        **({"device": args.device} if args.device else {}), **({"dtype": args.dtype} if args.dtype else {}))
    server = InProcessServer(settings, build_pipeline, load_timeout=600)
    try:
        tree = server.server.service.backend.parts().kv_tree
        with RagClient(server.addr, timeout=600) as client:  # first-call allocations and the tools' grammar
            "".join(client.query(WARM_UP, top_k=args.top_k, max_new_tokens=2, tools=[LOOKUP]))
        tree.clear()  # the agents find the tree empty (the warm-up's pin would hold some of it)
        warm = tree.stats()
        calls: list[dict] = []
        errors: list[str] = []
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_agent, args=(server.addr, i, questions[i], results[i], plans[i],
                                                         args.calls, args.max_new_tokens, args.top_k, t0, calls, errors))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = time.perf_counter() - t0
        stats = tree.stats()
    finally:
        server.stop()
    prompt = sum(c["prompt_tokens"] for c in calls)
    served = sum(c["tree_tokens"] for c in calls)
    spilled = stats.spilled_hit_tokens - warm.spilled_hit_tokens
    after_tool = [c["ttft_s"] for c in calls if c["step"] > 0]
    return {
        "calls": len(calls), "errors": len(errors), "error_samples": errors[:3],
        "prompt_tokens": prompt, "tree_tokens": served, "tree_share": round(served / prompt, 4) if prompt else 0.0,
        "spilled_share": round(spilled / prompt, 4) if prompt else 0.0,
        "ttft_after_tool_p50_s": _pct(after_tool, 0.5), "ttft_after_tool_p95_s": _pct(after_tool, 0.95),
        "ttft_first_p50_s": _pct([c["ttft_s"] for c in calls if c["step"] == 0], 0.5),
        "total_s": round(total, 3),
        "tree": {"budget_bytes": tree_bytes, "held_bytes": stats.nbytes, "agents_bytes": stats.nbytes - warm.nbytes,
                 "evictions": stats.evictions - warm.evictions, "evicted_bytes": stats.evicted_bytes - warm.evicted_bytes,
                 "pinned_bytes": stats.pinned_bytes, "retain_s": round(stats.retain_s, 3), "tool_gaps": stats.tool_gaps,
                 "spills": stats.spills - warm.spills, "host_bytes": stats.host_bytes, "disk_bytes": stats.disk_bytes},
    }


def _ratios(runs: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    base = runs["unbounded"]

    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {name: {"tree_share": over(r["tree_share"], base["tree_share"]),
                   "ttft_after_tool_p50": over(r["ttft_after_tool_p50_s"], base["ttft_after_tool_p50_s"]),
                   "ttft_after_tool_p95": over(r["ttft_after_tool_p95_s"], base["ttft_after_tool_p95_s"]),
                   "total_s": over(r["total_s"], base["total_s"])}
            for name, r in runs.items() if name != "unbounded"}


def run_agents_bench(args) -> int:  # argparse.Namespace from cli.bench
    from ragkv.cli.agent_bench import _results
    from ragkv.cli.load_bench import _build_index, _questions

    n, calls = args.agents, args.calls
    lo, hi = _latency_range(args.tool_latency)
    if n < 1 or calls < 2 or args.tool_result_chars < 1 or args.retain_max_s <= 0 or not 0 < args.tree_share <= 1:
        raise ValueError(f"--agents must be >= 1, --calls >= 2, --tool-result-chars >= 1, --retain-max-s > 0 and "
                         f"--tree-share in (0, 1], got {n}, {calls}, {args.tool_result_chars}, {args.retain_max_s}, "
                         f"{args.tree_share}")
    unknown = sorted(set(args.policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)}; of {', '.join(POLICIES)} (unbounded always runs)")
    if args.kv_tree_bytes is not None and args.kv_tree_bytes < 1:
        raise ValueError(f"--kv-tree-bytes must be >= 1 with --agents, got {args.kv_tree_bytes}")
    texts = _results(n * calls, args.tool_result_chars)
    results = [texts[i * calls:(i + 1) * calls] for i in range(n)]
    plans = _plans(n, calls, lo, hi, args.seed)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ragkv-agents-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, args.device, args.dtype)
        questions = _questions(index, n, seed=args.seed)
        for policy in ("unbounded", *(p for p in POLICIES if p in args.policies and p != "unbounded")):
            if policy == "unbounded":
                tree_bytes, retain = _UNBOUNDED, 0.0
            else:  # a share of the working set the unbounded tree held, unless named
                working_set = runs["unbounded"]["tree"]["agents_bytes"]
                tree_bytes = args.kv_tree_bytes or max(1, int(working_set * args.tree_share))
                retain = 0.0 if policy == "lru" else args.retain_max_s
            spill = Path(tmp) / "tree" if policy == "spill" else None
            runs[policy] = _run_policy(args, index, tree_bytes, retain, questions, results, plans, spill)
            r = runs[policy]
            print(f"{policy}: {r['calls']} calls, {r['tree_share']:.1%} of prompt tokens from the tree, "  # progress
                  f"{r['total_s']:.1f} s, {r['errors']} errors", file=sys.stderr, flush=True)
    report = {"agents": {
        "policies": runs, "vs_unbounded": _ratios(runs),
        "working_set_bytes": runs["unbounded"]["tree"]["agents_bytes"],
        "budget_bytes": next((r["tree"]["budget_bytes"] for p, r in runs.items() if p != "unbounded"), None),
    }, "config": {
        "agents": n, "calls": calls, "tool_latency_s": [lo, hi], "tool_result_chars": args.tool_result_chars,
        "max_new_tokens": args.max_new_tokens, "top_k": args.top_k, "model": args.model, "seed": args.seed,
        "retain_max_s": args.retain_max_s, "tree_share": args.tree_share, "mode": "the server's default",
        "kv_tree_bytes": args.kv_tree_bytes,
        "index": str(args.index) if args.index else "built: 40 docs x 256-token chunks",
        "baseline": "the same agents (questions, results, tool latencies) against an unbounded tree, same run",
        "ttft": "server-side; after_tool = every call but each agent's first"}}
    if args.json:
        print(json.dumps(report))
    else:
        _print(report["agents"])
    return 1 if any(r["errors"] for r in runs.values()) else 0


def _print(a: dict) -> None:
    budget = "-" if a["budget_bytes"] is None else f"{a['budget_bytes'] / 2**20:.1f} MiB"
    print(f"working set {a['working_set_bytes'] / 2**20:.1f} MiB, budget {budget}")
    print("policy      tree share  (spilled)  TTFT p50 after tool  TTFT p95 after tool  total    evictions  "
          "(x unbounded: share, p50, p95, total)")
    for name, r in a["policies"].items():
        x = a["vs_unbounded"].get(name)
        ratio = "" if x is None else "  ".join(f"{v:.2f}x" if v is not None else "-" for v in x.values())
        p50, p95 = r["ttft_after_tool_p50_s"] or 0.0, r["ttft_after_tool_p95_s"] or 0.0
        print(f"{name:10s}  {r['tree_share']:>9.1%}  {r['spilled_share']:>9.1%}  {p50:>17.3f} s  {p95:>17.3f} s  "
              f"{r['total_s']:>6.1f} s  "
              f"{r['tree']['evictions']:>9d}  {ratio}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: ragkv bench --agents 8 --calls 5 --tool-latency 0.5,3")
