"""`ragkv bench --agent-loop`: an agent's tool loop, with the KV tree and without it, in one run.

An agent calls its model again and again in one conversation: the question, a tool call,
the tool's result, another call... Each call's prompt is the last one's plus the newest call
and result. This bench builds (or opens) an index, starts two in-process servers on it,
one with the KV tree (`--kv-tree-bytes`, the default) and one without (`0`), and runs the
same loop against both, step by step in turn (so drift on the machine hits both alike):
step k sends the question, the tools, and k calls with their results of
`--tool-result-chars` characters each, in the server's default mode, streamed. Last, the
user asks a follow-up question that retrieves other chunks (a new path in the tree).

It prints, per step, the prompt tokens, each server's TTFT (server-side) over its own
step 0's, and the tokens the tree supplied; then both loops' total first-token time and
their ratio: what an agent pays for its conversation with the tree and without it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ragkv.types import ChatRole, ChatTurn, Tool, ToolCall

QUESTION = "Which module of the standard library parses command-line arguments, and how is it used?"
WARM_UP = "What does the json module's dumps function do?"
FOLLOW_UP = "And which module makes temporary files and directories?"
LOOKUP = Tool("lookup", "Look a page of the documentation up by its number.",
              {"type": "object", "properties": {"page": {"type": "integer"}}, "required": ["page"]})


def _results(n: int, chars: int) -> list[str]:
    """n tool results of `chars` characters of standard-library documentation, each different."""
    from ragkv.evals.synthetic import haystack_paragraphs

    text = " ".join(haystack_paragraphs())
    return [text[(i * 7919) % max(1, len(text) - chars):][:chars] for i in range(n)]


def _turns(results: list[str], step: int) -> list[ChatTurn]:
    turns: list[ChatTurn] = []
    for i in range(step):
        call = ToolCall(f"call_{i}", LOOKUP.name, json.dumps({"page": i + 1}))
        turns += [ChatTurn(ChatRole.ASSISTANT, "", (call,)), ChatTurn(ChatRole.TOOL, results[i], tool_call_id=call.id)]
    return turns


def _call(client, step_turns: list[ChatTurn], max_new: int, top_k: int,  # RagClient
          question: str = QUESTION, history: list[ChatTurn] | None = None) -> dict:
    stream = client.query(question, top_k=top_k, max_new_tokens=max_new, agent_turns=step_turns, tools=[LOOKUP],
                          history=history or [])
    for _ in stream:
        pass
    stats = stream.result()
    return {"ttft_s": round(stats.ttft_seconds, 3), "prompt_tokens": stats.usage.prompt_tokens,
            "tree_tokens": stats.usage.tree_prompt_tokens}


def run_agent_bench(args) -> int:  # argparse.Namespace from cli.bench
    from ragkv.cli.load_bench import _build_index
    from ragkv.client import RagClient
    from ragkv.server.assembly import build_pipeline
    from ragkv.server.inprocess import InProcessServer
    from ragkv.server.settings import CollectionSpec, ServerSettings

    steps, chars = args.agent_steps, args.tool_result_chars
    if steps < 1 or chars < 1:
        raise ValueError(f"--agent-steps and --tool-result-chars must be >= 1, got {steps} and {chars}")
    results = _results(steps, chars)
    with tempfile.TemporaryDirectory(prefix="ragkv-agent-") as tmp:
        index = args.index or _build_index(Path(tmp), args.model, args.device, args.dtype)
        servers = {}
        try:
            for name, tree_bytes in (("tree", args.kv_tree_bytes), ("no_tree", 0)):
                settings = ServerSettings(
                    indexes=(CollectionSpec("default", index),), host="127.0.0.1", port=0, metrics_port=None,
                    model=None if args.index else args.model, kv_tree_bytes=tree_bytes,
                    **({"device": args.device} if args.device else {}),
                    **({"dtype": args.dtype} if args.dtype else {}))
                servers[name] = InProcessServer(settings, build_pipeline, load_timeout=600)
            rows = []
            with RagClient(servers["tree"].addr, timeout=600) as tree, \
                    RagClient(servers["no_tree"].addr, timeout=600) as plain:
                for client in (tree, plain):  # first-call allocations and the tools' grammar, on another
                    "".join(client.query(WARM_UP, top_k=args.top_k, max_new_tokens=2, tools=[LOOKUP]))  # question
                for step in range(steps):
                    turns = _turns(results, step)
                    row = {"step": step, "tree": _call(tree, turns, args.max_new_tokens, args.top_k),
                           "no_tree": _call(plain, turns, args.max_new_tokens, args.top_k)}
                    rows.append(row)
                    print(f"step {step}: {row['tree']['prompt_tokens']} prompt tokens, TTFT tree "  # progress
                          f"{row['tree']['ttft_s']:.3f} s ({row['tree']['tree_tokens']} from the tree), "
                          f"without {row['no_tree']['ttft_s']:.3f} s", file=sys.stderr, flush=True)
                # then the user asks another question, which retrieves other chunks: a new path
                history = [ChatTurn(ChatRole.USER, QUESTION), ChatTurn(ChatRole.ASSISTANT, "It is argparse.")]
                follow_up = {name: _call(client, [], args.max_new_tokens, args.top_k, FOLLOW_UP, history)
                             for name, client in (("tree", tree), ("no_tree", plain))}
        finally:
            for server in servers.values():
                server.stop()
    report = {"agent_loop": {**_summary(rows), "follow_up": follow_up}, "config": {
        "steps": steps, "tool_result_chars": chars, "max_new_tokens": args.max_new_tokens, "top_k": args.top_k,
        "model": args.model, "kv_tree_bytes": args.kv_tree_bytes, "mode": "the server's default",
        "index": str(args.index) if args.index else "built: 40 docs x 256-token chunks",
        "baseline": "the same loop against a server without the KV tree, step by step in turn, same run"}}
    if args.json:
        print(json.dumps(report))
    else:
        _print(report["agent_loop"])
    return 0


def _summary(rows: list[dict]) -> dict:
    out: dict = {"steps": []}
    for r in rows:
        out["steps"].append({
            "step": r["step"], "prompt_tokens": r["tree"]["prompt_tokens"], "tree_tokens": r["tree"]["tree_tokens"],
            "ttft_tree_s": r["tree"]["ttft_s"], "ttft_no_tree_s": r["no_tree"]["ttft_s"],
            "tree_over_step0": round(r["tree"]["ttft_s"] / rows[0]["tree"]["ttft_s"], 2),
            "no_tree_over_step0": round(r["no_tree"]["ttft_s"] / rows[0]["no_tree"]["ttft_s"], 2)})
    tree, plain = (round(sum(r[k]["ttft_s"] for r in rows), 3) for k in ("tree", "no_tree"))
    out.update(total_ttft_tree_s=tree, total_ttft_no_tree_s=plain,
               total_speedup=round(plain / tree, 2) if tree else None)
    return out


def _print(s: dict) -> None:
    print("step  prompt tokens  from tree  TTFT tree (x step 0)  TTFT without tree (x step 0)")
    for r in s["steps"]:
        print(f"{r['step']:>4}  {r['prompt_tokens']:>13}  {r['tree_tokens']:>9}  {r['ttft_tree_s']:>8.3f} s "
              f"({r['tree_over_step0']:.2f}x)  {r['ttft_no_tree_s']:>10.3f} s ({r['no_tree_over_step0']:.2f}x)")
    print(f"total first-token time: {s['total_ttft_tree_s']:.3f} s with the tree, {s['total_ttft_no_tree_s']:.3f} s "
          f"without: {s['total_speedup']}x")
    f = s["follow_up"]
    print(f"a follow-up question (other chunks, a new path): TTFT {f['tree']['ttft_s']:.3f} s with the tree "
          f"({f['tree']['tree_tokens']} tokens from it), {f['no_tree']['ttft_s']:.3f} s without")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: ragkv bench --agent-loop --agent-steps 9 --tool-result-chars 1200")
