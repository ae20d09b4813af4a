"""Stable fingerprints of a model's config, weights and tokenizer.

A fingerprint is a sha256 hex digest that is the same in every process and on every
machine for the same files, so kvstore keys built from it can never mix two models.
It hashes file *contents*, never paths, mtimes or Python's `hash()`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ragkv.types import Fingerprint

# Config keys that describe where or how a file was written, not what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype", "dtype",
     "_commit_hash", "_attn_implementation", "_attn_implementation_autoset", "use_cache"}
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "tokenizer_config.json", "special_tokens_map.json")
_CHUNK = 1 << 22  # bytes per read while hashing


def hash_file(path: Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def config_digest(config_dict: dict[str, Any]) -> str:
    """sha256 of a config, with keys that do not change the computation removed."""
    clean = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(clean, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def weights_digest(model_dir: Path) -> str:
    """sha256 over (file name, file sha256) of every weight file in a model directory."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(_WEIGHT_SUFFIXES)}) in {model_dir}")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + hash_file(p).encode() + b"\n")
    return h.hexdigest()


def tokenizer_fingerprint(model_dir: Path) -> Fingerprint:
    """sha256 over the tokenizer files of a model directory (vocabulary, merges, specials)."""
    h = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        p = model_dir / name
        if p.is_file():
            found = True
            h.update(name.encode() + b"\0" + hash_file(p).encode() + b"\n")
    if not found:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {model_dir}")
    return Fingerprint(h.hexdigest())


def model_fingerprint(config_dict: dict[str, Any], weights: str, tokenizer: Fingerprint) -> Fingerprint:
    """The model fingerprint: config + weights + tokenizer, one digest."""
    h = hashlib.sha256()
    for part in ("ragkv-model-v1", config_digest(config_dict), weights, tokenizer):
        h.update(part.encode() + b"\n")
    return Fingerprint(h.hexdigest())
