"""Tiny random-weight models for fast tests: every served family's shape, on CPU.

Each is a real Hugging Face model directory (config, safetensors, tokenizer), so it
goes through exactly the loading path users' models take.
"""

from __future__ import annotations

from pathlib import Path

import torch

_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. Context: Question: Answer:",
    "ragkv stores the KV cache of every chunk and blends them at query time.",
    "Paris is the capital of France. The secret number is 4721. Alice met Bob.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()-\n",
]

_ARCH = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
}

_WINDOW = 8  # tiny sliding windows, so that the tests' prompts (40+ tokens) cross them
_LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# hybrids: recurrent (linear attention) layers between full-attention ones
_HYBRID = {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}

# the FAMILY_CONFIGS of hybrids, which serve FULL only (tests of chunk KV run on the others)
HYBRIDS = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "granitemoehybrid"})

# One tiny config per served family (engine.family.FAMILIES), each with the features its
# adapter handles switched on: windows, q/k norms, MoE, multipliers, soft-capping, sinks.
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": _WINDOW}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": _WINDOW, "max_window_layers": 2}),
    "qwen3": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": _WINDOW, "max_window_layers": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": _WINDOW}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"query_pre_attn_scalar": 24, "sliding_window": _WINDOW,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3_text": ("Gemma3TextConfig", {
        "query_pre_attn_scalar": 24, "sliding_window": _WINDOW, "layer_types": _LOCAL_GLOBAL,
        "final_logit_softcapping": 3.0, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": ("Phi3Config", {"sliding_window": _WINDOW, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 4.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.125}),
    "smollm3": ("SmolLM3Config", {"use_sliding_window": True, "sliding_window": _WINDOW,
                                  "no_rope_layer_interval": 2}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": _WINDOW,
                                 "intermediate_size": 64}),
    "cohere": ("CohereConfig", {"use_qk_norm": True, "logit_scale": 2.0}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": _WINDOW}),
    "ministral": ("MinistralConfig", {"sliding_window": _WINDOW, "layer_types": _LOCAL_GLOBAL}),
    "olmo3": ("Olmo3Config", {"sliding_window": _WINDOW, "layer_types": _LOCAL_GLOBAL, "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                           "original_max_position_embeddings": 64},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "exaone4": ("Exaone4Config", {"sliding_window": _WINDOW, "layer_types": _LOCAL_GLOBAL}),
    "seed_oss": ("SeedOssConfig", {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True,
                                   "attention_dropout": 0.0, "residual_dropout": 0.0}),
    "apertus": ("ApertusConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1.2e7, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "glm4_moe": ("Glm4MoeConfig", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                                   "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True,
                                   "partial_rotary_factor": 0.5}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                                            "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                                            "moe_layer_end_index": 3, "use_bias": True}),
    "minimax_m2": ("MiniMaxM2Config", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                       "rotary_dim": 8}),
    "llama4_text": ("Llama4TextConfig", {"attention_chunk_size": _WINDOW, "no_rope_layer_interval": 2,
                                         "floor_scale": 4, "attn_scale": 0.5, "num_local_experts": 4,
                                         "num_experts_per_tok": 2, "interleave_moe_layer_step": 2,
                                         "intermediate_size": 32, "intermediate_size_mlp": 64}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 24, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 12, "v_head_dim": 10, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                         "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                                         "routed_scaling_factor": 2.5, "rope_parameters": {
                                             "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                             "original_max_position_embeddings": 64, "mscale": 1.0,
                                             "mscale_all_dim": 1.0}}),
    "deepseek_v2": ("DeepseekV2Config", {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                         "qk_nope_head_dim": 12, "v_head_dim": 10, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1}),
    "qwen3_next": ("Qwen3NextConfig", {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                                       "mlp_only_layers": [2]}),
    "qwen3_5_text": ("Qwen3_5TextConfig", _HYBRID),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        "layer_types": _HYBRID["layer_types"], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
        "mamba_n_groups": 1, "mamba_chunk_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "shared_intermediate_size": 64, "embedding_multiplier": 4.0, "logits_scaling": 2.0,
        "residual_multiplier": 0.5, "attention_multiplier": 0.125}),
    "gemma4_text": ("Gemma4TextConfig", {
        "sliding_window": _WINDOW, "layer_types": _LOCAL_GLOBAL, "global_head_dim": 32,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512, "enable_moe_block": True,
        "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32, "final_logit_softcapping": 3.0,
        "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {"attention_bias": True, "rope_parameters": {
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 1e4}}),
}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model_dir(path: str | Path, arch: str = "llama", num_layers: int = 4, seed: int = 0,
                   family: bool = False, **config_overrides) -> Path:
    """Write a tiny random-weight HF model directory and return its path.

    Args:
        arch: "llama", "mistral" or "qwen2"; with `family`, any key of FAMILY_CONFIGS.
        num_layers: decoder layers (L).
        seed: weights are a pure function of (arch, num_layers, seed, family, overrides).
        family: the family test's config, every feature on; its 1-D weights (norms, biases,
            sinks) are randomized too, so that a norm applied in the wrong place shows.
    """
    import transformers

    table = FAMILY_CONFIGS if family else _ARCH
    if arch not in table:
        raise ValueError(f"arch must be one of {sorted(table)}, got {arch!r}")
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tokenizer = _tokenizer()
    config_cls_name, extra = table[arch]
    base = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, initializer_range=0.2)
    config = getattr(transformers, config_cls_name)(**{**base, **extra, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
