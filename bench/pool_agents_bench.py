"""Many agents' tool loops through one decode pool: how much of each call's leased path is lent
in place, and how much is copied.

Over one pool (`engine.kv.decode_pool`) a conversation's next call runs on from its path where
the KV tree holds it (`TreeLease.lend`) when the path lies in one run of slots with room after
it; otherwise the path is copied into the call's new run. Agents side by side break both: other
calls' runs land after a path, and a copied path leaves its next turn in another place. Two
arms, on the same seeded workload, interleaved in one process, over the model's KV shape (no
weights: only where KV lies is measured):

- `before`: the lease asks for its whole decode room after the path, and a copied path stays
  where the tree had it (the pool as it was);
- `now`: the lease takes room for its prompt when the whole room is not free (the decode grows
  the run), and the insert after a copied call keeps the path in the call's copy
  (`KVCache.from_tree`, `DecodePool.rehome`), so it lies in one run again. The engine's prompt
  pass does both (`engine.blend.resume_steps`).

Each agent's first call is 200-400 tokens; each later call adds a tool result and an answer of
40-120 tokens; `--inflight` calls hold their runs at once (other agents' calls: an agent's own
call has ended before its next one); the tree's budget is `--tree-share` of the pool. Prints,
per arm, the share of leased tokens lent in place, tokens copied, calls copied and why (the
path not on the device, not in one run, no room after it), and the ratio. Every lease's KV,
lent or copied, is checked against what its conversation's calls wrote (an error if not).

    python bench/pool_agents_bench.py --agents 16 --calls 8 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=16, help="conversations side by side")
    ap.add_argument("--calls", type=int, default=8, help="calls per agent")
    ap.add_argument("--inflight", type=int, default=4, help="calls holding their runs at once")
    ap.add_argument("--pool-tokens", type=int, default=16384, help="the decode pool's token slots")
    ap.add_argument("--tree-share", type=float, default=0.75, help="the KV tree's budget, a share of the pool")
    ap.add_argument("--reserve", type=int, default=64, help="decode room each call asks after its prompt")
    ap.add_argument("--seeds", default="0,1,2", help="workload seeds (comma list)")
    return ap


def run(arm: str, seed: int, args: argparse.Namespace) -> dict:
    """One arm over one seeded workload: what the leases lent and copied."""
    import torch

    from ragkv.engine.kv.cache import KVCache
    from ragkv.engine.kv.decode_pool import DecodePool
    from ragkv.engine.kv.tree import KVTree, TreeTier
    from ragkv.engine.kv.tree_node import TreeContext, TreeKey

    rng = random.Random(seed)
    layers, heads, dim = 2, 1, 4  # where KV lies does not depend on its shape
    token_bytes = 2 * layers * heads * dim * 4
    pool = DecodePool(layers, heads, dim, args.pool_tokens, torch.float32, "cpu")
    budget = int(args.tree_share * args.pool_tokens) * token_bytes
    tree = KVTree(budget, host_bytes=64 * budget, device_pool=pool.share(budget))
    shared = tree._pools[TreeTier.DEVICE]
    ctx = TreeContext(0, 0, 0)
    convs = {i: [10**5 * (i + 1) + j for j in range(rng.randint(200, 400))] for i in range(args.agents)}
    order = [i for _ in range(args.calls) for i in rng.sample(range(args.agents), args.agents)]
    live: list[tuple[int, KVCache]] = []  # (agent, its call's cache) of the calls holding runs
    leased = copied_calls = 0
    why: collections.Counter[str] = collections.Counter()
    for n, i in enumerate(order):
        ids = convs[i] + [10**5 * (i + 1) + 5000 + 7 * n + j for j in range(rng.randint(40, 120))]
        for mine in [c for a, c in live if a == i]:  # its last call answered before its tool ran
            pool.release(mine, keep=False)
        live = [(a, c) for a, c in live if a != i]
        key = TreeKey.of(f"agent{i}")
        lease = tree.match(key, ids[1:] + [0])
        held = 0 if lease is None else lease.tokens
        leased += held
        room = len(ids) + args.reserve
        cache = None
        if lease is not None:
            cache = lease.lend(room, least=len(ids) + 1) if arm == "now" else lease.lend(room)
            if cache is None:
                why[_why_copied(lease, pool)] += 1
        if cache is None:
            cache = pool.new_cache(room) or KVCache(layers, heads, dim, room, torch.float32, torch.device("cpu"))
            if lease is not None:
                first = lease.write_into(cache)
                if arm == "now":
                    cache.from_tree = first
                lease.release()
                copied_calls += 1
        kept = cache.k[0, 0, :held, 0].tolist()  # K of position j is its token id (written below)
        if kept != torch.tensor(ids[:held], dtype=torch.float32).tolist():
            raise AssertionError(f"agent {i}'s call {n}: the lease supplied other KV than was kept")
        values = torch.tensor(ids[held:], dtype=torch.float32)[None, None, :, None]  # [1, 1, T, 1]
        cache.k[:, :, held:len(ids)] = values
        cache.v[:, :, held:len(ids)] = -values
        cache.length = len(ids)
        tree.insert(key, ids[:1], ctx, ids[1:], cache)
        convs[i] = ids
        live.append((i, cache))
        while len(live) > args.inflight:
            pool.release(live.pop(0)[1], keep=False)
    for _, cache in live:
        pool.release(cache, keep=False)
    return {"leased_tokens": leased, "lent_tokens": pool.borrowed_tokens, "copied_tokens": shared.read_tokens,
            "lent_share": pool.borrowed_tokens / max(leased, 1), "calls_copied": copied_calls,
            "copied_because": dict(why), "rehomed_tokens": pool.rehomed_tokens,
            "reclaimed_tokens": pool.reclaimed_tokens}


def _why_copied(lease, pool) -> str:
    """Why a lease could not be lent: its path not all on the device, not in one run of slots,
    or no room after it."""
    import torch

    from ragkv.engine.kv.tree import TreeTier

    parts = lease._parts
    if any(p.k is not None or p.node.tier is not TreeTier.DEVICE for p in parts):
        return "not on the device"
    slots = torch.cat([p.node.slots[:p.n] for p in parts])
    if int(slots[-1]) - int(slots[0]) + 1 != len(slots):
        return "not in one run"
    return "no room after it"


def main() -> None:
    args = build_parser().parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, list[dict]] = {"before": [], "now": []}
    for seed in seeds:
        for arm in rows:
            rows[arm].append(run(arm, seed, args))
    report: dict[str, object] = {"seeds": seeds, "agents": args.agents, "calls": args.calls}
    for arm, runs in rows.items():
        report[arm] = {
            "lent_share": statistics.fmean(r["lent_share"] for r in runs),
            "copied_tokens": sum(r["copied_tokens"] for r in runs),
            "calls_copied": sum(r["calls_copied"] for r in runs),
            "copied_because": dict(sum((collections.Counter(r["copied_because"]) for r in runs), collections.Counter())),
            "per_seed": [round(r["lent_share"], 3) for r in runs],
        }
        print(f"{arm:>7}: lent in place {report[arm]['lent_share']:.3f} of leased tokens (per seed "
              f"{report[arm]['per_seed']}), {report[arm]['copied_tokens']} tokens copied in "
              f"{report[arm]['calls_copied']} calls: {report[arm]['copied_because']}")
    before, now = report["before"], report["now"]
    assert isinstance(before, dict) and isinstance(now, dict)
    ratio = now["copied_tokens"] / before["copied_tokens"] if before["copied_tokens"] else None
    report["copied_tokens_now_over_before"] = ratio
    print("tokens copied, now over before: " + ("none copied before" if ratio is None else f"{ratio:.2f}x"))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
