"""`--device auto` / `--dtype auto`: CUDA and bfloat16 where torch sees a GPU, else CPU and float32."""

from __future__ import annotations

import pytest
import torch

from ragkv.cli.main import build_parser
from ragkv.engine.device import resolve_device, resolve_dtype
from ragkv.server.settings import DType, ServerSettings


@pytest.mark.parametrize(("cuda", "device", "dtype"), [(True, "cuda", "bfloat16"), (False, "cpu", "float32")])
def test_auto_follows_what_torch_sees(monkeypatch: pytest.MonkeyPatch, cuda: bool, device: str, dtype: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto") == device
    assert resolve_dtype("auto", "auto") == dtype
    settings = ServerSettings().resolved()
    assert (settings.device, settings.dtype) == (device, DType(dtype))


def test_explicit_choices_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cpu") == "cpu"
    assert resolve_dtype("float32", "cuda") is DType.FLOAT32  # told otherwise: no bf16
    assert ServerSettings(device="cuda:1", dtype=DType.FLOAT16).resolved().dtype is DType.FLOAT16
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of float32, bfloat16, float16, auto"):
        resolve_dtype("fp8", "cpu")


def test_serve_and_index_default_to_auto() -> None:
    p = build_parser()
    assert ServerSettings().device == "auto" and ServerSettings().dtype is DType.AUTO
    index = p.parse_args(["index", "corpus", "--out", "out"])
    assert (index.device, index.dtype) == ("auto", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_loads_on_the_gpu(tiny_llama_dir) -> None:
    from ragkv.engine import load_model

    device = resolve_device("auto")
    lm = load_model(str(tiny_llama_dir), device=device, dtype=resolve_dtype("auto", device))
    assert lm.device.type == "cuda" and lm.dtype == torch.bfloat16
