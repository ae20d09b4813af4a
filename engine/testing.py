"""Tiny random-weight models for fast tests: Llama, Mistral and Qwen2 shapes on CPU.

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
                   **config_overrides) -> Path:
    """Write a tiny random-weight HF model directory and return its path.

    Args:
        arch: "llama", "mistral" or "qwen2".
        num_layers: decoder layers (L).
        seed: weights are a pure function of (arch, num_layers, seed, overrides).
    """
    import transformers

    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {sorted(_ARCH)}, got {arch!r}")
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tokenizer = _tokenizer()
    config_cls_name, extra = _ARCH[arch]
    config = getattr(transformers, config_cls_name)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, initializer_range=0.2,
        **{**extra, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
