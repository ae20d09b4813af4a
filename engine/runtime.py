"""Engine: one loaded model and the operations the indexer and server call.

Prompt work has one way in for each thing it makes: `run_steps` runs a prompt in any
mode (full prefill, prefix, reuse, blend, focus, a KV-tree resume) to its next-token
logits; `prefill_steps` computes a chunk's KV after the prefix (the indexer's precompute,
a chunk computed while serving). Both yield between decoder layers, so the scheduler runs
them step by step; `run` and `prefill` run them to the end. A served request's whole work
(reads, prompt, decode, KV tree) is `work`.

Not thread-safe: one thread runs an Engine (the server's scheduler thread, engine.scheduler).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator, Sequence

import torch

from ragkv.engine.answer import answer_steps
from ragkv.engine.blend import BlendOptions, BlendResult, Prompt, PromptSteps, prompt_steps, resume_steps
from ragkv.engine.constrain import Constraint, ConstraintCompiler
from ragkv.engine.decode import DecodeStream, SamplingParams
from ragkv.engine.decode_graphs import DecodeConfig, PooledDecoder
from ragkv.engine.forward import Step
from ragkv.engine.kv.cache import ChunkKV
from ragkv.engine.kv.conversation import NO_TREE, Conversations, TreeConfig, TreeSpot
from ragkv.engine.kv.tree_node import TreeContext
from ragkv.engine.model_loading import LoadedModel
from ragkv.engine.prefill import prefill_steps
from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT, PromptFormat
from ragkv.engine.request import Request, Work
from ragkv.engine.speed import EngineSpeed
from ragkv.engine.work import drain
from ragkv.errors import UnsupportedModelError
from ragkv.types import Mode

_PREFIX_MEMO_SIZE = 8  # distinct prefixes kept computed
# prompt tokens one step computes at least (chunked prefill; more where the engine's measured
# speed runs more within a slice): prompts of up to 2K tokens (the demo's, the benches') run
# whole layers. Smaller pieces cost more than they give on this project's 2-core CPU, where a
# slice's worth of a 7K-token prompt's layer is about 300 rows: with pieces of 300 the long
# prompts' TTFT was 1.16x that with 2048 and the streams' inter-token p99 1.13x; with 1024 the
# p99 was 1.76x of alone against 1.31x (`bench.long_prompt`, docs/quality.md).
DEFAULT_STEP_TOKENS = 2048
DEFAULT_STEP_S = 0.05  # seconds one step of a prompt pass should last (the scheduler's shortest slice)
_CHUNK_KV_MODES = frozenset({Mode.REUSE, Mode.BLEND, Mode.FOCUS})


def placeholder_kv(token_ids: Sequence[int], start: int, lm: LoadedModel) -> ChunkKV:
    """A chunk with its tokens but no real KV, for PREFIX mode (it recomputes every chunk token).

    The K/V are a zero-stride view of one zero, so no memory is spent on them.
    """
    n = len(token_ids)
    zeros = torch.zeros((), device=lm.device, dtype=lm.dtype).expand(
        lm.num_layers, lm.num_kv_heads, n, lm.head_dim)  # [L, Hkv, T, D]
    return ChunkKV(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long, device=lm.device),  # [T]
        k=zeros,
        v=zeros,
        positions=torch.arange(start, start + n, device=lm.device),  # [T]
        fresh=True,
    )


class Engine:
    """The model runtime: prefill chunks, blend a prompt, decode.

    Args:
        tree: the KV tree's budgets and policies (`TreeConfig`; budget 0 = no tree): a served
            prompt's KV, so a conversation's next call computes only what is new, behind its one
            door (`engine.kv.conversation`); a hybrid's also holds its recurrent state where prompts
            end. What leaves the device spills to host memory, then to disk files (whose
            conversations it finds again), read back only when that is sooner than computing
            them at the engine's full-prefill rate.
        step_tokens: prompt tokens one step of a prompt pass computes at most: a longer prompt's
            layers run in pieces, one step each (chunked prefill, `engine.forward.layer_steps`),
            so the scheduler can run decode steps between them; 0 = a whole layer per step;
            None = sized from the engine's measured speed (`step_rows`).
        step_s: with `step_tokens` None, the seconds one step should last at most.
    """

    def __init__(self, lm: LoadedModel, system_prompt: str = DEFAULT_SYSTEM_PROMPT, tree: TreeConfig = NO_TREE,
                 step_tokens: int | None = None, step_s: float = DEFAULT_STEP_S,
                 decode: DecodeConfig = DecodeConfig()) -> None:
        if step_tokens is not None and step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0 (0 = a whole layer per step), got {step_tokens}")
        if step_s <= 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.lm = lm
        self.step_tokens, self.step_s = step_tokens, step_s
        self.speed = EngineSpeed()  # its measured rates: chunk prefill, prompt work (engine.speed)
        self.prompt = PromptFormat.for_tokenizer(lm.tokenizer, system_prompt)
        self._prefixes: OrderedDict[tuple[int, ...], ChunkKV] = OrderedDict()
        vocab = lm.model.get_output_embeddings().weight.shape[0]  # V, the logits' width
        self.grammars = ConstraintCompiler(lm.tokenizer, vocab, lm.eos_token_ids)  # constrained decoding
        # decode steps over one pool, captured per bucket on CUDA (engine.decode_graphs); None = ragged.
        # The KV tree keeps its device tier in the same pool, so a lease and an insert move no KV
        share_tree = tree.budget_bytes > 0 and not self.recurrent
        self.decoder: PooledDecoder | None = decode.decoder(lm)
        shared = self.decoder.pool.share(tree.budget_bytes) if self.decoder is not None and share_tree else None
        self.conversations = Conversations(lm, tree, self.recurrent, lambda: self.speed.prompt_tokens_per_s(Mode.FULL),
                                           device_pool=shared)
        # requests' prompt caches come from the decoder's pool, so they decode where their prompt left them
        self._new_cache = None if self.decoder is None else self.decoder.pool.new_cache

    def step_rows(self) -> int:
        """Prompt rows one step of the next pass computes at most (0 = a whole layer): `step_tokens`
        when set; else the rows of one layer that take `step_s` at the engine's measured full
        prefill rate (its chunk prefill rate before a full pass was measured), and
        `DEFAULT_STEP_TOKENS` at least. A GPU that runs an 8K-token layer of an 8B model in
        12 ms runs it whole (pieces of 2048 cost it 1.15x); a slow CPU keeps pieces of 2048."""
        if self.step_tokens is not None:
            return self.step_tokens
        rate = self.speed.prompt_tokens_per_s(Mode.FULL) or self.speed.tokens_per_s  # tokens a second, every layer
        if rate is None:
            return DEFAULT_STEP_TOKENS
        return max(DEFAULT_STEP_TOKENS, int(rate * self.lm.num_layers * self.step_s))

    @property
    def recurrent(self) -> bool:
        """The model is a hybrid: some layers are recurrent, so only FULL mode serves it."""
        return bool(self.lm.adapter.recurrent_layers)

    def modes(self) -> frozenset[Mode]:
        """The modes this model can be served in."""
        return frozenset({Mode.FULL}) if self.recurrent else frozenset(Mode)

    def _check_mode(self, mode: Mode) -> None:
        if mode not in self.modes():
            fam = self.lm.adapter.family
            raise UnsupportedModelError(
                f"mode {Mode(mode).value!r} cannot serve {fam.model_type}: its {fam.recurrent} layers are recurrent, "
                "so a layer's state after a chunk depends on every token before it and no stored chunk KV (or "
                "prefix KV) can stand in for it; use mode 'full'")

    def work(self, request: Request) -> Work:
        """A prepared request's work, for the scheduler to run step by step (`engine.answer`):
        its chunks' KV, its prompt pass, its decode, the KV tree."""
        return answer_steps(self, request)

    def prefix_kv(self, prefix_ids: Sequence[int]) -> ChunkKV:
        """The prefix's own KV (positions 0..P-1), computed once and reused."""
        self._check_mode(Mode.PREFIX)
        key = tuple(int(i) for i in prefix_ids)
        if key in self._prefixes:
            self._prefixes.move_to_end(key)
            return self._prefixes[key]
        kv = drain(prefill_steps(self.lm, None, key))
        self._prefixes[key] = kv
        if len(self._prefixes) > _PREFIX_MEMO_SIZE:
            self._prefixes.popitem(last=False)
        return kv

    def prefill_steps(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int], context_ids: Sequence[int] = (),
                      context_kv: Sequence[ChunkKV] = ()) -> Generator[Step, None, ChunkKV]:
        """A chunk's KV computed after the shared prefix (and its context: neighbour-conditioned
        KV, `engine.prefill.prefill_steps`), one decoder layer per step: K before RoPE, V,
        both [L, Hkv, T, D]."""
        self._check_mode(Mode.REUSE)
        prefix = self.prefix_kv(prefix_ids) if len(prefix_ids) else None
        return (yield from prefill_steps(self.lm, prefix, chunk_ids, context_ids, context_kv))

    def prefill(self, prefix_ids: Sequence[int], chunk_ids: Sequence[int], context_ids: Sequence[int] = (),
                context_kv: Sequence[ChunkKV] = ()) -> ChunkKV:
        """`prefill_steps` to its end."""
        return drain(self.prefill_steps(prefix_ids, chunk_ids, context_ids, context_kv))

    def request_kv_bytes(self, tokens: int) -> int:
        """The KV bytes a request of `tokens` tokens (prompt and max_new_tokens) holds at most, as
        admission counts them: over a decode pool, whole pages of it (its run never grows past
        them: `KVCache.most`)."""
        if self.decoder is not None:
            page = self.decoder.pool.page_tokens
            tokens = -(-tokens // page) * page
        return tokens * self.kv_bytes_per_token

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of decode cache (K and V, every layer) one token takes at the model's dtype."""
        lm = self.lm
        return 2 * lm.kv_layers * lm.num_kv_heads * lm.head_dim * lm.dtype.itemsize

    @staticmethod
    def reads_chunk_kv(mode: Mode) -> bool:
        """Whether `mode` reads the chunks' cached KV (FULL and PREFIX recompute every chunk token)."""
        return Mode(mode) in _CHUNK_KV_MODES

    @staticmethod
    def prompt_cost(mode: Mode, prefix_tokens: int, chunk_tokens: int, question_tokens: int,
                    options: BlendOptions | None = None) -> int:
        """About how much work a prompt pass is, in token-equivalents: the tokens it runs through
        the model, plus an eighth of the prompt for reading and attending to the cached KV.

        The scheduler runs the cheapest pass first; only the order of passes matters, not
        the unit (measured alone on CPU, reuse : blend 0.15 : focus : full took about
        1 : 2.6 : 2.9 : 7 of 1K chunk tokens, this gives 1 : 2 : 2.4 : 8.5).
        """
        total = prefix_tokens + chunk_tokens + question_tokens
        return _computed_tokens(Mode(mode), prefix_tokens, chunk_tokens, question_tokens, options) + total // 8

    def prompt_rows(self, mode: Mode, prefix_tokens: int, chunk_tokens: int, question_tokens: int,
                    options: BlendOptions | None = None) -> int:
        """About how many rows (token-layers) a prompt pass's steps compute: the tokens it runs
        through the model (as `prompt_cost` counts them) times the layers, and a scoring pass of
        the question (blend's query selector, focus). The scheduler reads a pass's progress in it
        (the rows its steps have yielded, over this), so a pass whose seconds outrun its
        estimate still has the rest of its rows to go, not none."""
        mode = Mode(mode)
        scored = question_tokens if mode in (Mode.BLEND, Mode.FOCUS) else 0
        computed = _computed_tokens(mode, prefix_tokens, chunk_tokens, question_tokens, options)
        return (computed + scored) * self.lm.num_layers

    def run(self, prompt: Prompt, mode: Mode, options: BlendOptions | None = None, reserve_tokens: int = 256,
            resume: TreeSpot | None = None) -> BlendResult:
        """`run_steps` to its end."""
        return drain(self.run_steps(prompt, mode, options, reserve_tokens, resume))

    @torch.inference_mode()
    def run_steps(self, prompt: Prompt, mode: Mode, options: BlendOptions | None = None, reserve_tokens: int = 256,
                  resume: TreeSpot | None = None) -> PromptSteps:
        """Run `[prefix][chunks][question]` in any mode: the one way into the engine for a prompt.

        A generator that yields between decoder layers (`engine.blend.prompt_steps`), so the
        scheduler can interleave other requests' decode steps; it returns the BlendResult.

        Args:
            prompt: the prompt's tokens, and each chunk's KV when `reads_chunk_kv(mode)`.
            reserve_tokens: decode room preallocated after the prompt.
            resume: this prompt's place in the KV tree (`Conversations.lease`); when it holds a
                lease on the context and first tokens, only the rest is computed, and the
                chunks' KV is not read.

        Returns:
            The prompt ready for decoding; `cached_tokens` counts the prompt tokens whose KV
            was read from a cache (the prefix, and the used chunks that were not fresh).
        """
        mode, opts = Mode(mode), options or BlendOptions()
        self._check_mode(mode)
        step_tokens = self.step_rows()
        prefix_ids, chunk_ids, chunks, question_ids = prompt.prefix_ids, prompt.chunk_ids, prompt.chunks, \
            prompt.question_ids
        if resume is not None and resume.lease is not None:
            layout = None
            if mode in (Mode.FULL, Mode.PREFIX):  # a context many prompts share: this one's layout
                p = len(prefix_ids)
                c = p + sum(len(ids) for ids in chunk_ids)
                layout = TreeContext(prefix_tokens=p, chunk_end=c, chunk_tokens=c - p)
            return (yield from resume_steps(self.lm, resume.lease, resume.path, mode, layout, reserve_tokens,
                                            prompt.snapshot_at, step_tokens, self._new_cache))
        if mode is Mode.FULL:
            ids = [*prefix_ids, *(t for ids in chunk_ids for t in ids), *question_ids]
            return (yield from prompt_steps(self.lm, None, [], ids, Mode.FULL, reserve_tokens=reserve_tokens,
                                            snapshot_at=prompt.snapshot_at, step_tokens=step_tokens,
                                            new_cache=self._new_cache))
        prefix = prompt.prefix_kv if prompt.prefix_kv is not None else self.prefix_kv(prefix_ids)
        if prefix.num_tokens != len(prefix_ids):
            raise ValueError(f"the prompt's prefix KV holds {prefix.num_tokens} tokens, its prefix_ids {len(prefix_ids)}")
        if mode is Mode.PREFIX:  # every chunk token is recomputed: its KV is never read
            placeholders = [placeholder_kv(ids, len(prefix_ids), self.lm) for ids in chunk_ids]
            res = yield from prompt_steps(self.lm, prefix, placeholders, question_ids, mode, opts, reserve_tokens,
                                          step_tokens=step_tokens, new_cache=self._new_cache)
            res.cached_tokens = len(prefix_ids)  # (PREFIX chooses nothing: no select_ids)
            return res
        if chunks is None or len(chunks) != len(chunk_ids):
            raise ValueError(f"mode {mode.value} reads each chunk's KV: got "
                             f"{'none' if chunks is None else len(chunks)} for {len(chunk_ids)} chunks")
        res = yield from prompt_steps(self.lm, prefix, chunks, question_ids, mode, opts, reserve_tokens,
                                      prompt.select_ids, step_tokens=step_tokens, new_cache=self._new_cache)
        used = res.used_chunks if res.used_chunks is not None else range(len(chunks))
        res.cached_tokens = len(prefix_ids) + sum(chunks[i].num_tokens for i in used if not chunks[i].fresh)
        return res

    def decode(self, prompt: BlendResult, params: SamplingParams | None = None,
               constraint: Constraint | None = None) -> DecodeStream:
        """Stream the answer's text pieces; the stream reports finish_reason and token_ids.

        Args:
            constraint: A grammar the answer must follow (`self.grammars.compile`); None = free text.
        """
        return DecodeStream(self.lm, prompt, params or SamplingParams(), constraint)


def _computed_tokens(mode: Mode, prefix_tokens: int, chunk_tokens: int, question_tokens: int,
                     options: BlendOptions | None) -> int:
    """The prompt tokens a `mode` pass runs through the model, about (focus: a fifth of the chunks)."""
    ratio = (options or BlendOptions()).recompute_ratio
    total = prefix_tokens + chunk_tokens + question_tokens
    return {Mode.FULL: total, Mode.PREFIX: chunk_tokens + question_tokens, Mode.REUSE: question_tokens,
            Mode.BLEND: round(ratio * chunk_tokens) + question_tokens,
            Mode.FOCUS: round(0.2 * chunk_tokens) + question_tokens}.get(mode, total)
