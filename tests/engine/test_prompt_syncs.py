"""A prompt pass asks the device nothing back, in any mode (issue 70's profile: `.item()` syncs in the
per-layer host work). On a GPU a read of a tensor's value on the host (`.item()`, `int(t)`, `bool(t)`)
or an op whose output shape depends on values (`nonzero`, `masked_select`, `unique`) waits for every
kernel queued before it; here every such op a pass dispatches is counted, on the CPU, where the same
calls are made."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ragkv.engine import BlendOptions, Engine
from ragkv.engine.blend import Prompt, Selector
from ragkv.types import Mode

_WAITS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
          torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default,
          torch.ops.aten._unique2.default, torch.ops.aten.nonzero_static.default}


class HostWaits(TorchDispatchMode):
    """Counts the ops that make the host wait for the device's values."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _WAITS or (func in _INDEXING and _bool_index(args)):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default}


def _bool_index(args: tuple) -> bool:
    """Whether an indexing op indexes by a boolean mask (its output's size is the mask's count)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _prompt(engine: Engine) -> tuple[Prompt, Prompt]:
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, engine.lm.tokenizer.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prefix, chunks, q = rand(12), [rand(40) for _ in range(4)], rand(10)
    kvs = [engine.prefill(prefix, c) for c in chunks]
    return Prompt(q, prefix, chunks, kvs), Prompt(prefix + sum(chunks, []) + q)


@pytest.mark.parametrize(("mode", "options"), [
    (Mode.FULL, None), (Mode.PREFIX, None), (Mode.REUSE, None), (Mode.FOCUS, None),
    (Mode.BLEND, BlendOptions(recompute_ratio=0.15)),
    (Mode.BLEND, BlendOptions(recompute_ratio=0.15, selector=Selector.DEVIATION)),
], ids=["full", "prefix", "reuse", "focus", "blend-query", "blend-deviation"])
@pytest.mark.parametrize("step_tokens", [0, 48], ids=["whole-layers", "pieces-of-48-rows"])
def test_a_prompt_pass_reads_no_device_value_on_the_host(tiny_lm, mode: Mode, options, step_tokens: int) -> None:
    engine = Engine(tiny_lm, step_tokens=step_tokens)
    chunked, whole = _prompt(engine)
    prompt = whole if mode is Mode.FULL else chunked
    engine.run(prompt, mode, options=options)  # warm: first-use work is not the pass's
    with HostWaits() as waits:
        res = engine.run(prompt, mode, options=options)
    assert torch.isfinite(res.logits).all()
    assert waits.ops == [], f"{mode.value} waits on the device {len(waits.ops)} times: {sorted(set(waits.ops))}"


def test_the_counter_sees_a_planted_read() -> None:
    with HostWaits() as waits:
        t = torch.arange(6)
        int(t[2])
        t[t > 2]
    assert [op.split(".")[1] for op in waits.ops] == ["_local_scalar_dense", "index"]


def test_a_pass_resumed_from_the_kv_tree_reads_no_device_value_on_the_host(tiny_lm) -> None:
    """A conversation's next call: the lease's KV goes into the pass and only the new tokens run."""
    from ragkv.engine import SamplingParams, TreeConfig

    engine = Engine(tiny_lm, tree=TreeConfig(64 << 20))
    trees = engine.conversations
    g = torch.Generator().manual_seed(1)
    first = torch.randint(5, engine.lm.tokenizer.vocab_size, (120,), generator=g).tolist()
    place = trees.lease(Mode.FULL, (), [], (), first)
    res = engine.run(Prompt(first), Mode.FULL, reserve_tokens=16)
    stream = engine.decode(res, SamplingParams(max_new_tokens=5))
    list(stream)
    assert trees.remember(place, Mode.FULL, res, len(first), 0, stream.token_ids, None) > 0
    second = [*first, *stream.token_ids[:4], *torch.randint(5, 200, (20,), generator=g).tolist()]
    spot = trees.lease(Mode.FULL, (), [], (), second)
    assert spot.lease is not None
    with HostWaits() as waits:
        resumed = engine.run(Prompt(second), Mode.FULL, reserve_tokens=16, resume=spot)
    assert resumed.cached_tokens == spot.tokens > len(first)
    assert waits.ops == [], f"a resumed pass waits on the device {len(waits.ops)} times: {sorted(set(waits.ops))}"
