"""Model families: how one decoder layer of each architecture computes, as data.

The engine has one layer function (`engine.forward.layer_forward`); everything that
differs between architectures is said here, once per family, and read through an
`Adapter` built for the loaded model:

- how a layer computes pre-RoPE Q, K and V (separate or fused projections, q/k norms
  per head or over the whole projection, before RoPE or after it (Hunyuan: folded into
  the query), gated attention (Qwen3-Next), latent attention stored as its latent
  (DeepSeek), Gemma 4's layers of different widths in one cache);
- how the residual stream goes: which norms sit before and after attention and the
  MLP (pre-norm, Gemma's sandwich, OLMo 2's post-norm, Cohere's parallel block), and
  Granite's multipliers;
- the MLP or mixture-of-experts block (it runs on the active tokens only, so selective
  recompute never sends the other tokens through the experts);
- per layer: its attention (scale, sliding window or attention chunk, logit
  soft-capping, sinks), which rotary table it uses (Gemma 3's local and global tables,
  SmolLM3's and Llama 4's no-RoPE layers), whose KV it reads (Gemma 4's shared layers),
  or the recurrent module it has instead (hybrids: Gated DeltaNet, Mamba-2);
- the embedding and the logits (Granite's multipliers, Cohere's logit scale, Gemma's
  final soft-capping, Gemma 4's per-layer inputs).

To add a family: a `Family` entry in `FAMILIES` and its tiny test config in
`evals.testing.FAMILY_CONFIGS` (tests/engine/test_families.py runs every one), nothing
else; docs/models.md says more.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import torch.nn.functional as F

from ragkv.engine.rope import RopeTables
from ragkv.errors import UnsupportedModelError


class QKNorm(str, enum.Enum):
    """Where a family normalizes queries and keys before RoPE."""

    NONE = "none"
    HEAD = "head"  # per head, after the projection is split into heads (Qwen3, Gemma 3, Cohere)
    PROJECTION = "projection"  # over the whole projection, before the split (OLMo 2)
    # per head, after RoPE (Hunyuan). The norm's weight does not commute with the rotation, its
    # division by the RMS does: keys are stored normalized without the weight (so a chunk's key
    # re-rotates exactly) and both weights scale the rotated query, which leaves q . k unchanged
    AFTER_ROPE = "after_rope"


@dataclass(frozen=True, slots=True)
class Family:
    """What one architecture does differently from Llama's decoder layer."""

    model_type: str  # config.model_type
    # the residual stream: norms by their attribute names on the layer, None = no norm there
    attn_in: str | None = "input_layernorm"  # before attention (None: OLMo 2's post-norm)
    attn_out: str | None = None  # on attention's output, before the residual add (Gemma 2/3, OLMo 2)
    mlp_in: str | None = "post_attention_layernorm"  # before the MLP
    mlp_out: str | None = None  # on the MLP's output, before the residual add (Gemma 2/3, OLMo 2)
    parallel: bool = False  # attention and MLP read the same normed input (Cohere)
    qk_norm: QKNorm = QKNorm.NONE
    q_norm: str = "q_norm"  # the attention module's q/k norms, by attribute name
    k_norm: str = "k_norm"
    mlp: str = "mlp"  # the layer's MLP or MoE block, by attribute name (Llama 4: feed_forward)
    shared_mlp: str | None = None  # an MLP added to `mlp`'s output; a layer without `mlp` runs it alone (Granite 4)
    # hybrids: the recurrent token mixer some layers have instead of attention, by attribute name
    # (Gated DeltaNet's linear_attn, Mamba-2's mamba); only FULL mode serves them (docs/models.md)
    recurrent: str | None = None
    gated_attention: bool = False  # q_proj also yields a per-head output gate: out * sigmoid(gate) (Qwen3-Next)
    fused_qkv: bool = False  # one `qkv_proj` (Phi-3)
    rope_interleaved: bool = False  # RoPE rotates pairs (0, 1), (2, 3)... (Cohere)
    rope_per_layer_type: bool = False  # the rotary module takes the layer type (Gemma 3)
    rope_half_table: bool = False  # the rotary module returns D/2-wide tables for the halves (gpt-oss)
    rope_table_to_pairs: bool = False  # the rotary module's table is for halves, the rotation is interleaved:
    # the adapter spreads each frequency over its pair (ERNIE 4.5)
    rope_complex: bool = False  # the rotary module returns complex frequencies [1, S, D/2] (Llama 4)
    # multi-head latent attention (DeepSeek V3): the cache holds one latent head per token,
    # [decoupled RoPE key; normed c_kv], and the key/value up-projections are absorbed into
    # the query and the output (`Adapter.qkv`, `attn_output`)
    mla: bool = False
    # Gemma 4's layer: per-layer head dim and KV heads (the cache is padded to the widest),
    # later layers reading an earlier layer's KV, a scale-free norm on V (V = the raw key where
    # attention_k_eq_v), per-layer inputs riding after the hidden state, its MoE block, layer_scalar
    gemma4: bool = False
    temperature_tuning: bool = False  # no-RoPE layers scale queries by position when the config says so
    # (Llama 4's attn_temperature_tuning: 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)))
    nope_global: bool = False  # layers without a window take no RoPE when others have one (EXAONE 4)
    attn_softcap: bool = False  # scores are soft-capped by attn_logit_softcapping (Gemma 2; Gemma 3
    # keeps the setting but transformers never applies it, so neither do we)
    notes: str = ""  # what the adapter handles, for docs/models.md


class _Norms(TypedDict, total=False):
    """A residual-stream layout shared by several families: Family's norm fields, by name."""

    attn_in: str | None
    attn_out: str | None
    mlp_in: str | None
    mlp_out: str | None


_SANDWICH = _Norms(attn_out="post_attention_layernorm", mlp_in="pre_feedforward_layernorm",
                   mlp_out="post_feedforward_layernorm")
_POST_NORM = _Norms(attn_in=None, attn_out="post_attention_layernorm", mlp_in=None, mlp_out="post_feedforward_layernorm")

_HYBRID_NOTES = ("hybrid: {mixer} layers, the model's own module with its conv and recurrent state per request, "
                 "full attention {every} layer (gated output, per-head q/k norm, partial rotary); FULL mode only, "
                 "the KV tree holding the recurrent state where prompts end")

_MLA_NOTES = ("multi-head latent attention stored as its latent: one KV head of [RoPE key; normed c_kv] "
              "(qk_rope_head_dim + kv_lora_rank per token, re-rotated on its RoPE part only), the key "
              "up-projection absorbed into the query and the value up-projection into the output; "
              "interleaved RoPE; yarn mscale; MoE with shared experts and grouped routing after dense first layers")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", notes="pre-norm; Llama 3 rope scaling through the model's rotary module"),
    Family("mistral", notes="sliding window on every layer when configured"),
    Family("qwen2", notes="q/k/v biases; sliding window on the layers its layer_types name"),
    Family("qwen3", qk_norm=QKNorm.HEAD, notes="per-head q/k RMSNorm before RoPE"),
    Family("qwen3_moe", qk_norm=QKNorm.HEAD, notes="per-head q/k norm; sparse MoE blocks (top-k experts "
           "run on the active tokens only)"),
    Family("mixtral", notes="sparse MoE blocks; sliding window when configured"),
    Family("gemma", notes="embedding scaled by sqrt(hidden) in its module; (1 + w) RMSNorm"),
    Family("gemma2", **_SANDWICH, attn_softcap=True, notes="sandwich norms; attention logit soft-capping; sliding window "
           "on alternate layers; final logit soft-capping; query_pre_attn_scalar"),
    Family("gemma3_text", **_SANDWICH, qk_norm=QKNorm.HEAD, rope_per_layer_type=True,
           notes="sandwich norms; per-head q/k norm; local (sliding) and global layers with their own "
           "rotary tables"),
    Family("phi3", fused_qkv=True, notes="fused qkv_proj; partial rotary when configured"),
    Family("olmo2", **_POST_NORM, qk_norm=QKNorm.PROJECTION,
           notes="post-norm residual; q/k RMSNorm over the whole projection"),
    Family("granite", notes="embedding, attention, residual and logit multipliers"),
    Family("smollm3", notes="no RoPE on the layers no_rope_layers marks 0"),
    Family("gpt_oss", rope_half_table=True, notes="attention sinks; sliding window on alternate layers; MoE with its own "
           "router; yarn rope scaling"),
    Family("cohere", parallel=True, qk_norm=QKNorm.HEAD, rope_interleaved=True,
           notes="parallel attention and MLP from one LayerNorm; interleaved RoPE; logit scale; "
           "optional per-head q/k LayerNorm"),
    Family("starcoder2", notes="LayerNorm with biases; biased projections; sliding window when configured"),
    Family("ministral", notes="sliding window on the layers its layer_types name"),
    Family("olmo3", **_POST_NORM, qk_norm=QKNorm.PROJECTION, rope_per_layer_type=True,
           notes="OLMo 2's post-norm and q/k norm; sliding window on the layers its layer_types name, "
           "rope scaling on the global layers only (their own rotary table)"),
    Family("exaone4", **_POST_NORM, qk_norm=QKNorm.HEAD, nope_global=True,
           notes="post-norm residual; per-head q/k RMSNorm; sliding window on the layers its layer_types name, "
           "no RoPE on the global layers when it has windowed ones"),
    Family("seed_oss", notes="q/k/v biases, output projection and MLP biases when configured"),
    Family("apertus", attn_in="attention_layernorm", mlp_in="feedforward_layernorm", qk_norm=QKNorm.HEAD,
           notes="per-head q/k RMSNorm; the model's own xIELU MLP; Llama 3 rope scaling"),
    Family("glm4_moe", qk_norm=QKNorm.HEAD, notes="partial rotary; q/k/v biases; optional per-head q/k norm; "
           "MoE with shared experts and grouped top-k routing (the model's own block) after dense first layers"),
    Family("ernie4_5_moe", rope_interleaved=True, rope_table_to_pairs=True,
           notes="interleaved RoPE from the halves' table; biases; MoE with shared experts and its own router "
           "on the layers its config names"),
    Family("minimax_m2", qk_norm=QKNorm.PROJECTION, notes="q/k RMSNorm over the whole projection; partial "
           "rotary; MoE with sigmoid routing and a score-correction bias (the model's own block)"),
    Family("llama4_text", qk_norm=QKNorm.AFTER_ROPE, q_norm="qk_norm", k_norm="qk_norm", mlp="feed_forward",
           rope_interleaved=True, rope_complex=True, temperature_tuning=True,
           notes="chunked local attention (attention_chunk_size) on its RoPE layers, global no-RoPE layers with "
           "position-scaled queries; L2 q/k norm after RoPE (it commutes with the rotation); interleaved RoPE "
           "from complex frequencies; MoE with a shared expert and sigmoid routing on its moe_layers"),
    Family("qwen3_next", recurrent="linear_attn", gated_attention=True, qk_norm=QKNorm.HEAD,
           notes=_HYBRID_NOTES.format(mixer="Gated DeltaNet (linear attention)", every="every 4th")),
    Family("qwen3_5_text", recurrent="linear_attn", gated_attention=True, qk_norm=QKNorm.HEAD,
           notes=_HYBRID_NOTES.format(mixer="Gated DeltaNet (linear attention)", every="every 4th")
           + "; multimodal RoPE, text positions"),
    Family("qwen3_5_moe_text", recurrent="linear_attn", gated_attention=True, qk_norm=QKNorm.HEAD,
           notes=_HYBRID_NOTES.format(mixer="Gated DeltaNet (linear attention)", every="every 4th")
           + "; multimodal RoPE, text positions"),
    Family("granitemoehybrid", recurrent="mamba", mlp="block_sparse_moe", shared_mlp="shared_mlp",
           notes=_HYBRID_NOTES.format(mixer="Mamba-2", every="a few") + "; Granite's multipliers; "
           "attention without RoPE unless the config names it; MoE plus a shared MLP"),
    Family("gemma4_text", **_SANDWICH, qk_norm=QKNorm.HEAD, rope_per_layer_type=True, gemma4=True,
           notes="sandwich norms; per-head q/k norm and a scale-free V norm; local and global layers with their "
           "own head dims, KV heads and rotary tables (the cache padded to the widest, fewer KV heads repeated); "
           "V = the raw key on global layers with attention_k_eq_v; the last layers read an earlier layer's KV "
           "(num_kv_shared_layers); per-layer input embeddings; the MoE block beside the MLP; layer_scalar"),
    Family("hunyuan_v1_dense", qk_norm=QKNorm.AFTER_ROPE, q_norm="query_layernorm", k_norm="key_layernorm",
           notes="per-head q/k RMSNorm after RoPE: keys stored normalized without the norm's weight (exact "
           "re-rotation), both weights folded into the rotated query; NTK-alpha rope scaling"),
    Family("deepseek_v3", mla=True, notes=_MLA_NOTES),
    Family("deepseek_v2", mla=True, rope_interleaved=True, rope_complex=True,
           notes=_MLA_NOTES.replace("interleaved RoPE; yarn mscale", "interleaved RoPE from complex frequencies")
           .replace("grouped routing", "its own routing")),
)}


# Multimodal checkpoints (the model types people download: Gemma 3 from 4B up, Gemma 4,
# Qwen3.5) are served as their language model: the text model's class, its weights read out of
# the checkpoint (`engine.model_loading`), the vision and audio towers left on disk.
LANGUAGE_MODELS: dict[str, str] = {
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}


@dataclass(frozen=True, slots=True)
class _MlaDims:
    """Multi-head latent attention's widths (DeepSeek V2/V3 config names)."""

    nope: int  # qk_nope_head_dim: each head's key part without RoPE (from c_kv)
    rope: int  # qk_rope_head_dim: the RoPE key, one for all heads
    rank: int  # kv_lora_rank: c_kv, the compressed KV
    v: int  # v_head_dim
    interleaved: bool  # rope_interleave with a halves' table (V3): pairs (0, 1), (2, 3)... laid out as evens, odds


# gated attention's q_proj split into its query and gate halves: (w_q, b_q, w_g, b_g), None = no bias
_GateSplit = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
_Fused = tuple[torch.Tensor, torch.Tensor | None]  # (weight [N1 + N2 + ..., in], bias [N1 + N2 + ...] or None)


def _fuse(projections: Sequence[Any]) -> _Fused | None:
    """Plain linear layers over the same input as one weight (and bias), their own weights (and
    biases) made views of it, so the model's modules compute as before and hold no second copy;
    None when any is not a plain `nn.Linear`, or their inputs, dtypes or devices differ."""
    if not projections or any(type(p) is not torch.nn.Linear for p in projections):
        return None
    first = projections[0].weight
    if any(p.in_features != projections[0].in_features or p.weight.dtype != first.dtype
           or p.weight.device != first.device for p in projections):
        return None
    weight = torch.cat([p.weight.detach() for p in projections])  # [sum N, in]
    has_bias = any(p.bias is not None for p in projections)
    bias = torch.cat([p.bias.detach() if p.bias is not None else first.new_zeros(p.out_features)
                      for p in projections]) if has_bias else None  # [sum N]
    off = 0
    for p in projections:
        n = p.out_features
        p.weight = torch.nn.Parameter(weight[off:off + n], requires_grad=False)
        if p.bias is not None and bias is not None:
            p.bias = torch.nn.Parameter(bias[off:off + n], requires_grad=False)
        off += n
    return weight, bias


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends."""

    scaling: float  # softmax scale
    window: int | None  # key j is visible to query i iff i - window < j <= i; None = every earlier key
    chunk: int | None = None  # chunked attention (Llama 4): key j is visible iff j // chunk == i // chunk
    softcap: float | None = None  # scores pass through cap * tanh(score / cap) (Gemma 2)
    sinks: torch.Tensor | None = None  # [H] per-head sink logits in the softmax's denominator (gpt-oss)

    @property
    def locality(self) -> tuple[int | None, int | None]:
        """(window, chunk): which earlier keys a query sees; (None, None) = all of them."""
        return self.window, self.chunk

    @property
    def is_global(self) -> bool:
        return self.window is None and self.chunk is None


class Adapter:
    """A loaded model's layers, as its family computes them."""

    def __init__(self, model: Any, family: Family) -> None:
        self.family = family
        self.model = model
        cfg = model.config
        self.base = model.model  # the decoder stack: embed_tokens, layers, norm
        self.layers = list(self.base.layers)
        # hybrids: the layers whose token mixer is recurrent (no attention, no KV)
        self.recurrent_layers = frozenset(
            i for i, layer in enumerate(self.layers)
            if family.recurrent and getattr(layer, family.recurrent, None) is not None)
        attn0 = next(layer.self_attn for i, layer in enumerate(self.layers) if i not in self.recurrent_layers)
        # each layer's place in a decode cache: a hybrid's recurrent layers have none (-1), so its
        # cache holds its attention layers only
        attending = [i for i in range(len(self.layers)) if i not in self.recurrent_layers]
        slot = {layer: n for n, layer in enumerate(attending)}
        self.cache_layer = tuple(slot.get(i, -1) for i in range(len(self.layers)))
        self.kv_layers = len(attending)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = config_value(cfg, "num_key_value_heads") or cfg.num_attention_heads
        self.head_dim = config_value(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads
        self.kv_source = tuple(range(len(self.layers)))  # the layer whose K/V each layer attends to
        self.hidden = cfg.hidden_size
        self.per_layer_input = 0  # Gemma 4: width of each layer's input riding after the hidden state
        if family.gemma4:
            self._gemma4_geometry(cfg)
        if family.mla:  # one latent head: [RoPE key (rope), c_kv (rank)]
            self.mla = _MlaDims(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim,
                                bool(getattr(cfg, "rope_interleave", False)) and not family.rope_interleaved)
            self.num_kv_heads, self.head_dim = 1, self.mla.rope + self.mla.rank
        self.layer_types: tuple[str, ...] = tuple(getattr(cfg, "layer_types", None) or
                                                  ["full_attention"] * len(self.layers))
        self.attention = tuple(
            LayerAttention(1.0, None) if i in self.recurrent_layers else  # never read: no attention there
            self._layer_attention(layer.self_attn, cfg, family, kind)
            for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)))
        self.rope_kinds = sorted(set(self.layer_types)) if family.rope_per_layer_type else ["*"]
        no_rope = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = uses RoPE, 0 = none
        if family.nope_global and any(a.window for a in self.attention):
            no_rope = [a.window is not None for a in self.attention]
        if getattr(self.base, "rotary_emb", True) is None:  # Granite 4 without position_embedding_type "rope"
            no_rope = [0] * len(self.layers)
        self.rope_kind = tuple(-1 if no_rope is not None and not no_rope[i] else
                               (self.rope_kinds.index(self.layer_types[i]) if family.rope_per_layer_type else 0)
                               for i in range(len(self.layers)))
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.residual_multiplier = float(getattr(cfg, "residual_multiplier", 1.0) or 1.0)
        self.logit_scale = float(getattr(cfg, "logit_scale", 1.0) or 1.0)
        self.logits_divisor = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self._has_qk_norm = hasattr(attn0, family.q_norm)
        # a weighted q/k norm after RoPE: its weights go onto the rotated query (fold_key_norm)
        self.folds_key_norm = family.qk_norm is QKNorm.AFTER_ROPE and any(
            hasattr(getattr(getattr(layer, "self_attn", None), family.k_norm, None), "weight")
            for layer in self.layers)
        self._gate_split: dict[int, _GateSplit] = {}  # gated attention: layer -> q and gate weights
        # Llama 4: (attn_scale, floor_scale) of the no-RoPE layers' query temperature; None = none
        self.temperature = (float(cfg.attn_scale), float(cfg.floor_scale)) if (
            family.temperature_tuning and getattr(cfg, "attn_temperature_tuning", False)) else None
        # one matmul where the model has several over the same input (fused at load: the model's own
        # modules keep views of the fused weights, so no byte is held twice): q, k and v; gate and up
        self._qkv = {i: f for i in range(len(self.layers)) if (f := self._fuse_qkv(i)) is not None}
        self._gate_up = {i: f for i in range(len(self.layers)) if (f := self._fuse_gate_up(i)) is not None}

    def _fuse_qkv(self, i: int) -> _Fused | None:
        """Layer i's q, k and v projections as one weight [(H + 2 Hkv) D, hidden] (and bias), or None
        where the family projects otherwise (latent, Gemma 4, gated, already fused) or they are not
        plain linear layers (quantized, adapters)."""
        fam = self.family
        if i in self.recurrent_layers or fam.mla or fam.gemma4 or fam.fused_qkv or fam.gated_attention:
            return None
        attn = self.layers[i].self_attn
        return _fuse([getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")])

    def _fuse_gate_up(self, i: int) -> _Fused | None:
        """Layer i's MLP gate and up projections as one weight [2 I, hidden], where its MLP is the
        plain gated one (`down(act(gate(x)) * up(x))`, checked on a random input at load), else None."""
        mlp = getattr(self.layers[i], self.family.mlp, None)
        if mlp is None or self.family.shared_mlp or not callable(getattr(mlp, "act_fn", None)) \
                or type(getattr(mlp, "down_proj", None)) is not torch.nn.Linear:
            return None
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if type(gate) is not torch.nn.Linear or type(up) is not torch.nn.Linear or gate.bias is not None \
                or up.bias is not None:
            return None
        x = torch.randn(2, gate.in_features, generator=torch.Generator().manual_seed(i)).to(gate.weight)
        want = mlp(x[None])[0]  # [2, hidden]: the module's own forward
        fused = _fuse([gate, up])
        if fused is None:
            return None
        g, u = F.linear(x, fused[0]).chunk(2, -1)
        if not torch.allclose(mlp.down_proj(mlp.act_fn(g) * u), want, rtol=1e-3, atol=1e-5):
            return None  # another MLP behind the same names: the model's own forward serves it
        return fused

    def _gemma4_geometry(self, cfg: Any) -> None:
        """Gemma 4: each layer's (KV heads, head dim), its KV source, and the cache's widths (the widest)."""
        geometry: list[tuple[int, int]] = []
        sources: list[int] = []
        store: dict[str, int] = {}  # layer type -> the last layer that stores KV for later ones
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if attn.is_kv_shared_layer:
                src = store[attn.layer_type]
                geometry.append(geometry[src])
                sources.append(src)
            else:
                geometry.append((attn.k_proj.out_features // attn.head_dim, attn.head_dim))
                sources.append(i)
            if attn.store_full_length_kv:
                store[attn.layer_type] = i
        self._geometry = tuple(geometry)
        self.kv_source = tuple(sources)
        self.num_kv_heads = max(h for h, _ in geometry)
        self.head_dim = max(d for _, d in geometry)
        if any(self.num_kv_heads % h for h, _ in geometry):
            raise UnsupportedModelError(f"Gemma 4 layers' KV heads {sorted({h for h, _ in geometry})} do not divide "
                                        f"the widest ({self.num_kv_heads}): one cache cannot hold them all")
        self.per_layer_input = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)

    @staticmethod
    def _layer_attention(attn: Any, cfg: Any, family: Family, layer_type: str) -> LayerAttention:
        # per-layer families set the window on the module (EXAONE 4 keeps it on every layer and
        # says is_sliding); the others window every layer by config
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
        if not getattr(attn, "is_sliding", True):
            window = None
        sinks = getattr(attn, "sinks", None)
        softcap = getattr(attn, "attn_logit_softcapping", None) if family.attn_softcap else None
        chunk = getattr(cfg, "attention_chunk_size", None) if layer_type == "chunked_attention" else None
        return LayerAttention(float(attn.scaling), int(window) if window else None, int(chunk) if chunk else None,
                              softcap or None, sinks.detach() if sinks is not None else None)

    @property
    def localities(self) -> frozenset[tuple[int | None, int | None]]:
        """The distinct (window, chunk) localities of the layers ((None, None) = global attention)."""
        return frozenset(a.locality for a in self.attention)

    def scoring_layers(self, candidates: Sequence[int]) -> list[int]:
        """The layers whose attention may score chunk tokens, among `candidates`.

        A sliding-window (or chunked) layer's question sees only its last `window` keys (its
        own attention chunk), so it says nothing about the chunks before them: where the model
        has global layers, only those score (the candidates' global ones, else the global layer
        nearest them). A model windowed everywhere scores on its windowed layers, as the model sees.
        """
        cands = list(candidates)
        glob = [i for i, a in enumerate(self.attention) if a.is_global]
        if not glob or len(glob) == len(self.attention):
            return cands
        inside = [i for i in cands if i in glob]
        if inside:
            return inside
        mid = sum(cands) / len(cands)
        return [min(glob, key=lambda i: (abs(i - mid), i))]

    # -- the layer's pieces, in the order layer_forward calls them --------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[S] -> [S, hidden] (Gemma 4 with per-layer inputs: [S, hidden + L * per_layer_input],
        each layer's input riding after the hidden state, sliced with it)."""
        h: torch.Tensor = self.base.embed_tokens(ids)
        if self.per_layer_input:
            per_layer = self.base.project_per_layer_inputs(h[None], self.base.get_per_layer_inputs(ids[None], h[None]))
            return torch.cat([h, per_layer[0].reshape(h.shape[0], -1).to(h.dtype)], -1)  # [S, L, P] -> [S, L*P]
        return h * self.embedding_multiplier if self.embedding_multiplier != 1.0 else h

    def attn_input(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """What layer i's attention reads: the normed residual (or the residual itself)."""
        norm = self.family.attn_in
        if self.per_layer_input:
            h = h[:, :self.hidden]
        return getattr(self.layers[i], norm)(h) if norm else h

    def qkv(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-RoPE q [H, S, D], k [Hkv, S, D] and v [Hkv, S, D] of layer i from its input x: [S, hidden]."""
        attn, fam, s = self.layers[i].self_attn, self.family, x.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if fam.mla:
            return self._mla_qkv(attn, x)
        if fam.gemma4:
            return self._gemma4_qkv(i, attn, x)
        if fam.fused_qkv:
            q, k, v = attn.qkv_proj(x).split([hq * d, hk * d, hk * d], -1)  # [S, H*D], [S, Hkv*D] x 2
        elif fam.gated_attention:
            w_q, b_q, _, _ = self._gates(i)
            q, k, v = F.linear(x, w_q, b_q), attn.k_proj(x), attn.v_proj(x)  # [S, H*D], [S, Hkv*D] x 2
        elif (fused := self._qkv.get(i)) is not None:
            qkv: torch.Tensor = F.linear(x, fused[0], fused[1])  # [S, (H + 2 Hkv) * D]
            q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d], qkv[:, (hq + hk) * d:]  # [S, H*D], [S, Hkv*D] x 2
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if fam.qk_norm is QKNorm.PROJECTION:
            q, k = getattr(attn, fam.q_norm)(q), getattr(attn, fam.k_norm)(k)
        q, k, v = q.view(s, hq, d), k.view(s, hk, d), v.view(s, hk, d)  # [S, H, D], [S, Hkv, D] x 2
        if fam.qk_norm is QKNorm.HEAD and self._has_qk_norm:
            q, k = getattr(attn, fam.q_norm)(q), getattr(attn, fam.k_norm)(k)
        elif fam.qk_norm is QKNorm.AFTER_ROPE and hasattr(attn, fam.q_norm):  # weights after RoPE: fold_key_norm
            q, k = _unit_rms(q, getattr(attn, fam.q_norm)), _unit_rms(k, getattr(attn, fam.k_norm))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def _mla_qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Latent attention's q [H, S, rope + rank], k and v [1, S, rope + rank] (before RoPE).

        The key is the latent itself: [k_pe; c_kv]. Head h's key would be [W_uk[h] c_kv; k_pe],
        so q_nope . (W_uk[h] c_kv) = (W_uk[h]^T q_nope) . c_kv: the query carries the
        up-projection instead (absorbed), and scores are the model's. The value is the same
        latent; `attn_output` takes its c_kv part through W_uv. The RoPE parts come first
        (RopeTables rotates the first R dims); an interleaved model's pairs are laid out as
        evens then odds, which its own rotation does too.
        """
        m, s, h = self.mla, x.shape[0], self.num_heads
        q = attn.q_proj(x) if getattr(attn, "q_proj", None) is not None else \
            attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q_nope, q_pe = q.view(s, h, m.nope + m.rope).split([m.nope, m.rope], -1)  # [S, H, nope], [S, H, rope]
        c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([m.rank, m.rope], -1)  # [S, rank], [S, rope]
        c_kv = attn.kv_a_layernorm(c_kv)
        w_uk = attn.kv_b_proj.weight.view(h, m.nope + m.v, m.rank)[:, : m.nope]  # [H, nope, rank]
        q_abs = torch.einsum("shn,hnr->hsr", q_nope, w_uk)  # [H, S, rank]
        if m.interleaved:
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], -1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], -1)
        q = torch.cat([q_pe.transpose(0, 1), q_abs], -1)  # [H, S, rope + rank]
        k = torch.cat([k_pe, c_kv], -1)[None]  # [1, S, rope + rank]
        return q, k, k.clone()

    def _gemma4_qkv(self, i: int, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gemma 4's q [H, S, D], k and v [Hkv, S, D] in the cache's widths: the layer's own head
        dim zero-padded to D (scores and outputs unchanged), its KV heads repeated to Hkv (each
        query head still reads its own). A layer reading an earlier layer's KV has none: zeros."""
        s, h = x.shape[0], self.num_heads
        hk, d = self._geometry[i]
        pad = self.head_dim - d
        q = attn.q_norm(attn.q_proj(x).view(s, h, d))  # [S, H, d]
        if attn.is_kv_shared_layer:
            k = v = x.new_zeros(s, self.num_kv_heads, self.head_dim)
        else:
            raw = attn.k_proj(x).view(s, hk, d)  # [S, hk, d]
            v = attn.v_norm(attn.v_proj(x).view(s, hk, d) if attn.v_proj is not None else raw)
            k = attn.k_norm(raw)
            if hk != self.num_kv_heads:
                k, v = (t.repeat_interleave(self.num_kv_heads // hk, 1) for t in (k, v))
            if pad:
                k, v = F.pad(k, (0, pad)), F.pad(v, (0, pad))
        if pad:
            q = F.pad(q, (0, pad))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def fold_key_norm(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """The rotated query [H, S, D] of a layer whose q/k norms follow RoPE, times both norms'
        weights: its scores against keys stored without the key norm's weight are the model's."""
        attn = self.layers[i].self_attn
        if not hasattr(attn, self.family.k_norm):
            return q
        folded: torch.Tensor = q * (getattr(attn, self.family.q_norm).weight * getattr(attn, self.family.k_norm).weight)
        return folded

    def _gates(self, i: int) -> _GateSplit:
        """Gated attention's q_proj split once into its query and gate halves: (w_q, b_q, w_g, b_g),
        each head's [query; gate] rows apart (the model chunks its output per head)."""
        if i not in self._gate_split:
            proj, h, d = self.layers[i].self_attn.q_proj, self.num_heads, self.head_dim
            w = proj.weight.view(h, 2, d, -1)  # [H, 2, D, hidden]
            b = proj.bias.view(h, 2, d) if proj.bias is not None else None
            self._gate_split[i] = (w[:, 0].reshape(h * d, -1), None if b is None else b[:, 0].reshape(-1),
                                   w[:, 1].reshape(h * d, -1), None if b is None else b[:, 1].reshape(-1))
        return self._gate_split[i]

    def attn_output(self, i: int, out: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's heads [S, H*D] through the output projection: [S, hidden]. `x` [S, hidden],
        attention's input, is read by gated attention (its output gate)."""
        attn = self.layers[i].self_attn
        if self.family.gated_attention:
            if x is None:
                raise ValueError(f"layer {i} has gated attention: attn_output needs attention's input x")
            _, _, w_g, b_g = self._gates(i)
            out = out * torch.sigmoid(F.linear(x, w_g, b_g))
        if self.family.mla:  # each head's weighted latent [S, H, rank] through its W_uv: [S, H, v]
            m, s, h = self.mla, out.shape[0], self.num_heads
            w_uv = attn.kv_b_proj.weight.view(h, m.nope + m.v, m.rank)[:, m.nope:]  # [H, v, rank]
            lat = out.view(s, h, m.rope + m.rank)[..., m.rope:]  # [S, H, rank]
            out = torch.einsum("shr,hvr->shv", lat, w_uv).reshape(s, h * m.v)
        elif self.family.gemma4 and self._geometry[i][1] != self.head_dim:  # drop the padding
            s, d = out.shape[0], self._geometry[i][1]
            out = out.view(s, self.num_heads, self.head_dim)[..., :d].reshape(s, self.num_heads * d)
        projected: torch.Tensor = attn.o_proj(out)
        return projected

    def residual(self, i: int, h: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input h, attention's input x and attention's output a."""
        layer, fam, m = self.layers[i], self.family, self.residual_multiplier
        if fam.gemma4:
            return self._gemma4_residual(i, h, a)
        if fam.parallel:
            return h + a + self.mlp(i, x)
        if fam.attn_out:
            a = getattr(layer, fam.attn_out)(a)
        h = h + a * m if m != 1.0 else h + a
        y = self.mlp(i, getattr(layer, fam.mlp_in)(h) if fam.mlp_in else h)
        if fam.mlp_out:
            y = getattr(layer, fam.mlp_out)(y)
        return h + y * m if m != 1.0 else h + y

    def _gemma4_residual(self, i: int, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Gemma 4's layer after attention: sandwich norms, the MLP beside the MoE block (which
        reads the residual, not the MLP's input), the layer's own input, layer_scalar."""
        layer, hid = self.layers[i], self.hidden
        hs = h[:, :hid] + layer.post_attention_layernorm(a)  # [S, hidden]
        y = layer.mlp(layer.pre_feedforward_layernorm(hs))
        if layer.enable_moe_block:
            _, weights, index = layer.router(hs)
            moe = layer.experts(layer.pre_feedforward_layernorm_2(hs), index, weights)
            y = layer.post_feedforward_layernorm_1(y) + layer.post_feedforward_layernorm_2(moe)
        hs = hs + layer.post_feedforward_layernorm(y)
        if self.per_layer_input:
            p = self.per_layer_input
            gate = layer.act_fn(layer.per_layer_input_gate(hs)) * h[:, hid + i * p:hid + (i + 1) * p]
            hs = hs + layer.post_per_layer_input_norm(layer.per_layer_projection(gate))
        hs = hs * layer.layer_scalar
        return torch.cat([hs, h[:, hid:]], -1) if self.per_layer_input else hs

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP or mixture of experts over x: [S, hidden] (the active tokens only)."""
        layer, fam = self.layers[i], self.family
        block = getattr(layer, fam.mlp, None)
        if (fused := self._gate_up.get(i)) is not None and block is not None:  # gate and up in one matmul
            g, u = F.linear(x, fused[0]).chunk(2, -1)  # [S, I] each
            out_: torch.Tensor = block.down_proj(block.act_fn(g) * u)
            return out_
        y = block(x[None]) if block is not None else None  # MoE blocks expect [B, S, hidden]
        if isinstance(y, tuple):  # MoE blocks also return their router scores
            y = y[0]
        if fam.shared_mlp:
            shared = getattr(layer, fam.shared_mlp)(x[None])
            y = shared if y is None else y + shared
        if y is None:
            raise UnsupportedModelError(f"layer {i} has neither an MLP ({fam.mlp!r}) nor a shared one")
        out: torch.Tensor = y.reshape(x.shape)
        return out

    def recurrent(self, i: int, x: torch.Tensor, state: Any) -> torch.Tensor:
        """Layer i's recurrent token mixer (the model's own module) over one request's next
        tokens x: [S, hidden] -> [S, hidden], carrying its conv and recurrent state in `state`
        (`new_recurrent_state`), which it updates."""
        mixer = self.family.recurrent
        if mixer is None:
            raise ValueError(f"the {self.family.model_type} family has no recurrent layers (layer {i})")
        out: torch.Tensor = getattr(self.layers[i], mixer)(hidden_states=x[None], cache=state)[0]
        return out

    @staticmethod
    def recurrent_state_bytes(state: Any) -> int:
        """Bytes a recurrent state holds (its layers' conv and recurrent state tensors)."""
        return sum(t.numel() * t.element_size() for layer in getattr(state, "layers", ())
                   for name in ("conv_states", "recurrent_states")
                   for t in (getattr(layer, name, None) or {}).values() if isinstance(t, torch.Tensor))

    @staticmethod
    def copy_recurrent_layer(src: Any, dst: Any, i: int) -> None:
        """Layer i's conv and recurrent state in `src`, copied into `dst` (both `new_recurrent_state`s)."""
        import copy

        dst.layers[i] = copy.deepcopy(src.layers[i])

    def new_recurrent_state(self) -> Any:
        """An empty state for one request's recurrent layers: transformers' own cache for the
        model, of which those layers read and write their conv and recurrent states."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, V] float32 next-token logits."""
        if self.per_layer_input:
            h = h[:, :self.hidden]
        out = _lm_head(self.model.lm_head, self.base.norm(h))
        if self.logit_scale != 1.0:
            out = out * self.logit_scale
        if self.logits_divisor != 1.0:
            out = out / self.logits_divisor
        if self.final_softcap:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out.float()

    def rotary(self, positions: torch.Tensor, like: torch.Tensor) -> RopeTables:
        """Rotary tables at positions [S] for every layer."""
        emb = self.base.rotary_emb
        if emb is None:  # no layer rotates (Granite 4 without RoPE)
            return RopeTables((), (), self.rope_kind, self.family.rope_interleaved)
        cos, sin = [], []
        for kind in self.rope_kinds:
            if self.family.rope_complex:  # [1, S, R/2] complex -> each frequency over its pair
                f = emb(like, positions[None, :])[0]
                c, s = f.real.repeat_interleave(2, -1).to(like.dtype), f.imag.repeat_interleave(2, -1).to(like.dtype)
            else:
                c, s = emb(like, positions[None, :], kind) if self.family.rope_per_layer_type else \
                    emb(like, positions[None, :])  # [1, S, R]
                c, s = c[0].to(like.dtype), s[0].to(like.dtype)  # [S, R] (OLMo 2's come in float32)
            if self.family.rope_table_to_pairs:  # [f0..fR/2, f0..fR/2] -> [f0, f0, f1, f1...]
                half = c.shape[-1] // 2
                c, s = c[:, :half].repeat_interleave(2, -1), s[:, :half].repeat_interleave(2, -1)
            if self.family.rope_half_table:  # one table per half: the same rotation as rotate_half's
                c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
            cos.append(c)
            sin.append(s)
        q_scale = None
        if self.temperature is not None:  # [S] float32, read on the no-RoPE layers
            attn_scale, floor_scale = self.temperature
            q_scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return RopeTables(tuple(cos), tuple(sin), self.rope_kind, self.family.rope_interleaved, q_scale)


def config_value(config: Any, name: str) -> Any:
    """A config's model-wide `name`, or None when it has none, or has one per layer (Gemma 4's
    head dim and KV heads: transformers refuses the model-wide read, the adapter reads each layer's)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _unit_rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """x [..., D] divided by its RMS as the RMSNorm module `norm` divides (float32, its eps),
    without the weight. A rotation keeps the RMS, so this commutes with RoPE."""
    eps: float = getattr(norm, "variance_epsilon", 0.0) or getattr(norm, "eps", 1e-6)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def family_of(config: Any) -> Family:
    """The family serving config's architecture.

    Raises:
        UnsupportedModelError: naming the architecture and the ones served.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in LANGUAGE_MODELS:  # a multimodal checkpoint: its language model is what is served
        return family_of(config.get_text_config())
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; ragkv serves decoders of types "
            f"{', '.join(sorted(FAMILIES))} (docs/models.md says how to add one)")
    return FAMILIES[model_type]


_FEW_ROWS = 64  # up to a decode batch's rows: a float32 head on CPU runs as its weight times their transpose


def _lm_head(head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The LM head over h [S, hidden] -> [S, V].

    On CPU, a batched decode step's few rows (2 to `_FEW_ROWS`) go through a float32 head as
    W @ h^T: MKL's sgemm of a few rows against the tall [V, hidden] weight reads it about
    once per row (SmolLM2's 49K x 576 head: 37 ms for 2 rows and 55 ms for 3, against 9 and
    13 ms this way), which undid what batching decode saves. The two differ by float rounding
    only, as a batch's rows already differ from each row alone (tests/engine/test_scheduler.py).
    One row (a prompt's last token, a lone decode step), bf16 and fp16 heads (there the
    module's own kernel is the faster) and GPUs run the module as it is."""
    weight = getattr(head, "weight", None)
    if (type(head) is not torch.nn.Linear or not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32
            or h.device.type != "cpu" or h.dim() != 2 or not 1 < h.shape[0] <= _FEW_ROWS):
        out: torch.Tensor = head(h)
        return out
    rows = weight.mm(h.t()).t()  # [S, V]
    return rows if head.bias is None else rows + head.bias
