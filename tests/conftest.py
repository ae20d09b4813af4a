"""Shared fixtures: no hub at test time, tiny random models, and the shipped SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from engine.testing import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real shipped model (converted from GGUF once, then loaded from the cache)."""
    from engine import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
