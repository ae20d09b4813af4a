"""ServerSettings: the one typed configuration of `ragkv serve`.

Each field is read, highest precedence first, from a command-line flag, the
environment (`RAGKV_<FIELD>`, e.g. RAGKV_MAX_QUEUE=32), an optional TOML or JSON
file (`--config`, keys named as the fields), and the defaults below.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ragkv.engine.decode_graphs import DecodeConfig
from ragkv.engine.focus import FocusOptions
from ragkv.engine.scheduler import SchedulerConfig
from ragkv.server.fidelity import DEFAULT_RECOMPUTE_RATIO
from ragkv.server.validation import RequestLimits
from ragkv.types import DEFAULT_COLLECTION, DType, Mode, SearchMode

_FOCUS = FocusOptions()  # the engine's focus defaults: the settings below that it shares are read from it

ENV_PREFIX = "RAGKV_"
S3_SCHEME = "s3://"


SYSTEM_PROMPT_POLICIES = ("prefix", "suffix", "strict")


@dataclass(frozen=True, slots=True)
class CollectionSpec:
    """One served collection: a name and its index directory."""

    name: str  # collection name clients use
    index_dir: Path  # directory the indexer wrote (for an S3 source: the local copy's folder)
    source: str | None = None  # s3://bucket/prefix synced into index_dir before serving; None = local

    @classmethod
    def parse(cls, text: str) -> CollectionSpec:
        """Read `NAME=DIR`, or a bare `DIR` for the collection "default"; DIR may be s3://bucket/prefix."""
        name, sep, path = text.partition("=")
        if not sep or text.startswith(S3_SCHEME):
            name, path = DEFAULT_COLLECTION, text
        if not name or not path:
            raise ValueError(f"index must be DIR or NAME=DIR, got {text!r}")
        if path.startswith(S3_SCHEME):
            bucket, _, prefix = path[len(S3_SCHEME):].partition("/")
            if not bucket:
                raise ValueError(f"index {text!r} names no bucket: use s3://bucket/prefix")
            return cls(name, index_cache_dir() / bucket / (prefix.strip("/") or "_root"), path)
        return cls(name, Path(path))


def index_cache_dir() -> Path:
    """Where `ragkv serve` keeps local copies of s3:// indexes: $RAGKV_CACHE_DIR/indexes
    (the root engine.model_loading.cache_dir names; read here so settings never import torch)."""
    import os

    return Path(os.environ.get("RAGKV_CACHE_DIR") or Path.home() / ".cache" / "ragkv") / "indexes"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Everything `ragkv serve` can be told."""

    indexes: tuple[CollectionSpec, ...] = ()  # served collections (--index, repeatable)
    # gRPC (and HTTP) bind address: loopback by default; any other address needs credentials
    # (api_keys_file, auth_token_file) or insecure_no_auth (server.api_keys.check_exposure)
    host: str = "127.0.0.1"
    port: int = 50051  # gRPC port; 0 = any free port
    metrics_port: int | None = 9464  # Prometheus /metrics port; None = off
    metrics_host: str = "127.0.0.1"  # /metrics bind address (no credentials: keep it on loopback or a private network)
    http_port: int | None = None  # OpenAI-compatible HTTP API port (server/openai_api.py); None = off
    model: str | None = None  # model spec; None = the one the index was built with
    device: str = "auto"  # torch device for the engine; auto = cuda when torch sees a GPU, else cpu
    dtype: DType = DType.AUTO  # model and KV dtype; auto = bfloat16 on cuda, float32 on cpu
    model_check: bool = True  # run the quick correctness gate at start (engine.check); off = --skip-model-check
    max_queue: int = 16  # Queries admitted at once (decoding + waiting)
    kv_budget_bytes: int = 4 * 1024**3  # KV cache bytes of all Queries in flight (engine.scheduler)
    max_batch: int = 16  # Queries decoding in one batched step at most
    prompt_slice_s: float = 0.05  # seconds of prompt work between two decode steps, as a token budget (engine.scheduler)
    prompt_share: float = 0.6  # the engine's share prompt work gets while requests decode (engine.scheduler)
    # prompt tokens one step of a prompt pass computes at most: longer prompts' layers run in pieces
    # (chunked prefill, engine.forward.layer_steps); 0 = a whole layer per step; None ("auto") =
    # the rows of a layer that last prompt_slice_s at the engine's measured speed (Engine.step_rows)
    prompt_step_tokens: int | None = None
    # prompt rows one step may carry from several passes at the same layer, run as one forward
    # (engine.scheduler); 0 = one pass per step
    prompt_batch_rows: int = 512
    # decode steps over one KV pool, each batch bucket's step shape-static (engine.decode_graphs): auto =
    # on CUDA, where a ragged step is launch-bound; on; off. The pool is kv_budget_bytes: requests' caches
    # are runs of it, and the KV tree keeps its device tier (at most kv_tree_bytes) in it, reserving none.
    decode_pool: str = "auto"
    cuda_graphs: str = "auto"  # capture each bucket's pooled step as a CUDA graph: auto (wherever CUDA is) or off
    retrieve_workers: int = 1  # threads for retrieval and KV prefetch starts
    grace_seconds: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    auth_token_file: Path | None = None  # bearer token file; else $RAGKV_AUTH_TOKEN; else no auth
    api_keys_file: Path | None = None  # named API keys, JSON (server.api_keys: collections, per-minute limits)
    insecure_no_auth: bool = False  # serve a non-loopback host with no credentials (logged as a warning)
    # bytes of one request: gRPC messages and HTTP bodies past it are refused before they are parsed
    max_request_bytes: int = 8 * 1024**2
    # the largest share of kv_tree_bytes one key's conversations may hold while another key's need room
    kv_tree_key_share: float = 0.5
    tls_cert: Path | None = None  # PEM certificate chain; TLS when set with tls_key
    tls_key: Path | None = None  # PEM private key
    kv_cpu_bytes: int = 2 * 1024**3  # bytes of KV kept in the CPU tier
    kv_gpu_bytes: int = 0  # bytes of KV kept in the GPU tier (CUDA only)
    # the KV tree (engine.kv.tree): served prompts' KV on the engine's device, so a conversation's
    # next call computes only what is new; at most this, and counted in kv_budget_bytes (admission
    # evicts what no request holds to make room); 0 = off
    kv_tree_bytes: int = 1024**3
    # an answer that may end in tool calls pins its tree path ahead of LRU eviction until the agent's
    # next call (engine.kv.tree): for a request's retain_seconds, at most this; else the learned tool
    # latency (p90 of the gaps seen, >= 1 s, at most this), kv_tree_retain_default_s before any; 0 = no pins
    kv_tree_retain_max_s: float = 60.0
    kv_tree_retain_default_s: float = 10.0
    # what the KV tree moves off the device (least recently used first, engine.kv.tree) goes to CPU
    # memory, at most this, then to kv_tree_dir; 0 = no host tier
    kv_tree_host_bytes: int = 2 * 1024**3
    # the KV tree's disk tier (kvstore.tree_files): spilled conversations as checksummed KV files,
    # everything in memory written there at shutdown, found again by the next server; None = off
    kv_tree_dir: Path | None = None
    kv_tree_disk_bytes: int = 16 * 1024**3
    # a follow-up question whose retrieval gives other chunks carries its conversation's earlier turns
    # from the KV tree as one more chunk, blended (blend mode; engine.kv.conversation); off = computed again
    kv_tree_follow_ups: bool = True
    # the Responses API's stored responses (server.response_store): in memory, and with a directory
    # also one file each there, so a restarted server finds them; None = memory only (lost on restart)
    responses_dir: Path | None = None
    responses_max_count: int = 10_000  # stored responses at most; least recently used dropped first
    responses_max_bytes: int = 256 * 1024**2  # bytes of all stored conversations and responses, as JSON
    responses_max_age_s: float = 30 * 86400.0  # seconds a stored response is found after it was stored
    # while other keys hold stored responses, a key past this share of the count or bytes drops its own first
    responses_key_share: float = 0.5
    kv_disk_dir: Path | None = None  # disk tier directory; None = the index's own
    kv_s3_uri: str | None = None  # s3://bucket/prefix of the S3 tier; None = off
    # write KV computed at serve time back to the S3 tier; off = read S3 only (the deploy's serving
    # hosts may not write the index's KV: docs/security.md)
    kv_s3_writeback: bool = True
    kv_compression: str = "auto"  # how KV computed at serve time is written back: none, int8, fp8; auto = as the index
    # disk and S3 hits go to the engine once their headers pass, each layer as its bytes are
    # verified, so reading overlaps compute (layer-wise pipelining); off = read whole first
    kv_layered: bool = True
    # the loading controller (server/loading_controller.py): per chunk, read its KV or recompute it, whichever
    # its tier's measured speed and the engine's prefill rate say is cheaper; off = always read
    kv_controller: bool = True
    max_question_chars: int = 4096  # characters
    default_top_k: int = 4  # chunks
    max_top_k: int = 32  # chunks
    # mode when a request leaves it unspecified: blend, the one held-out questions on both models found
    # closest to full prefill at the same speed; no focus rule beat it out of sample (docs/quality.md, issue 53)
    default_mode: Mode = Mode.BLEND
    # blend's ratio for a request that sets none; None = each collection's calibrated choice at
    # fidelity_kl, or DEFAULT_RECOMPUTE_RATIO (0.15) for an index without a calibration (server/fidelity.py)
    default_recompute_ratio: float | None = None
    # the largest next-token KL from full prefill (nats) a collection's default ratio may be predicted
    # at: its index's calibration gives the cheapest ratio that meets it; None = off (the default ratio)
    fidelity_kl: float | None = 0.01
    # blend's ratio for a request that brings its own system prompt (prefix policy) and sets no ratio:
    # every chunk then follows another prefix than its KV's, none is exact (docs/quality.md); None = the default
    system_prompt_recompute_ratio: float | None = None
    focus_keep: float = _FOCUS.keep  # FOCUS keeps chunks scoring at least this x the best (docs/quality.md)
    # FOCUS keeping several chunks hands over to blend over all of them (FocusOptions.handover);
    # on a neighbour index it then reads the neighbour KV (NeighbourOptions.serves_plain). On:
    # multi-passage questions lose most to full prefill when chunks are dropped (docs/quality.md)
    focus_handover: bool = True
    # ... only when the two runners-up score on average at least this x the best: a lookup has one
    # chunk far above the rest, and answers over it (FocusOptions.spread, docs/quality.md)
    focus_spread: float = _FOCUS.spread
    # ... or when at least this many chunks score within focus_keep of the best: a lookup is over one
    # passage (FocusOptions.several, docs/quality.md); 0 = never
    focus_several: int = _FOCUS.several
    # a lookup over neighbour KV blends its kept chunks at this share of their tokens; 0.0 = reuses their
    # KV as stored; None = the request's recompute ratio; 1.0 = recomputes them, exact over the kept chunks
    # (FocusOptions.lookup_ratio, docs/quality.md)
    focus_lookup_ratio: float | None = _FOCUS.lookup_ratio
    # a lookup answers over the chunks scoring at least this x the best; None = focus_keep; 1.0 = the
    # best alone (FocusOptions.lookup_keep, docs/quality.md)
    focus_lookup_keep: float | None = _FOCUS.lookup_keep
    # the quality guard: blend (and focus blending several chunks) runs a request as full prefill
    # when holding this share of the question's attention needs more chunk tokens than its
    # recompute ratio allows (BlendOptions.fallback_full); None = off. Counted in
    # ragkv_quality_fallbacks_total
    quality_guard_mass: float | None = None
    # answer length of a request that sets none; None = OpenAI's convention: until the model stops,
    # up to the room left in the model's context and max_new_tokens
    default_max_new_tokens: int | None = None  # tokens
    max_new_tokens: int = 1024  # tokens: the server's cap on any answer
    # a request whose system message is not its index's: served with its instructions computed in
    # front of the chunks (prefix), or placed after them (suffix), or refused (strict)
    system_prompt_policy: str = "prefix"
    log_level: str = "INFO"  # logging level name
    default_search_mode: SearchMode = SearchMode.HYBRID  # search when a request names none (docs/retrieval.md)
    fusion: str = "rrf"  # hybrid fusion: rrf (reciprocal rank) or weighted (normalized scores)
    dense_weight: float = 1.0  # hybrid: weight of the dense (FAISS) list, >= 0
    lexical_weight: float = 1.0  # hybrid: weight of the lexical (BM25) list, >= 0
    search_candidates: int = 50  # chunks each search hands to fusion and to the reranker
    reranker: Path | None = None  # cross-encoder folder reordering the candidates; None = no reranking
    # where the FAISS index searches: cpu (a search is far below the prefill), or cuda (the gpu
    # extra's faiss-gpu; the index file is a CPU index, moved at start)
    faiss_device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.kv_budget_bytes < 1 or self.max_batch < 1 or self.prompt_slice_s <= 0:
            raise ValueError(f"kv_budget_bytes, max_batch and prompt_slice_s must be > 0, got "
                             f"{self.kv_budget_bytes}, {self.max_batch}, {self.prompt_slice_s}")
        if self.prompt_step_tokens is not None and self.prompt_step_tokens < 0:
            raise ValueError(f"prompt_step_tokens must be >= 0 (0 = a whole layer per step), got "
                             f"{self.prompt_step_tokens}")
        if self.prompt_batch_rows < 0:
            raise ValueError(f"prompt_batch_rows must be >= 0 (0 = one pass per step), got {self.prompt_batch_rows}")
        if not 0 < self.prompt_share < 1:
            raise ValueError(f"prompt_share must be in (0, 1), got {self.prompt_share}: the share of the engine's "
                             f"time prompt work gets while requests decode")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not 0.0 < self.kv_tree_key_share <= 1.0:
            raise ValueError(f"kv_tree_key_share must be in (0, 1], got {self.kv_tree_key_share}")
        if self.kv_tree_bytes < 0:
            raise ValueError(f"kv_tree_bytes must be >= 0 (0 turns the KV tree off), got {self.kv_tree_bytes}")
        if self.kv_tree_host_bytes < 0 or self.kv_tree_disk_bytes < 0:
            raise ValueError(f"kv_tree_host_bytes and kv_tree_disk_bytes must be >= 0 (0 = no such tier), got "
                             f"{self.kv_tree_host_bytes} and {self.kv_tree_disk_bytes}")
        if not 0 <= self.kv_tree_retain_max_s < float("inf") or not 0 <= self.kv_tree_retain_default_s < float("inf"):
            raise ValueError(f"kv_tree_retain_max_s and kv_tree_retain_default_s must be seconds >= 0, got "
                             f"{self.kv_tree_retain_max_s} and {self.kv_tree_retain_default_s}")
        if self.responses_max_count < 1 or self.responses_max_bytes < 1 \
                or not 0 < self.responses_max_age_s < float("inf"):
            raise ValueError(f"responses_max_count, responses_max_bytes and responses_max_age_s must be > 0, got "
                             f"{self.responses_max_count}, {self.responses_max_bytes}, {self.responses_max_age_s}")
        if not 0.0 < self.responses_key_share <= 1.0:
            raise ValueError(f"responses_key_share must be in (0, 1], got {self.responses_key_share}")
        if self.retrieve_workers < 1:
            raise ValueError(f"retrieve_workers must be >= 1, got {self.retrieve_workers}")
        if self.kv_compression not in ("auto", "none", "int8", "fp8", "int4", "int2"):
            raise ValueError(f"kv_compression must be auto, none, int8, fp8, int4 or int2, got {self.kv_compression!r}")
        if self.faiss_device not in ("cpu", "cuda"):
            raise ValueError(f"faiss_device must be cpu or cuda, got {self.faiss_device!r}")
        for name in ("default_recompute_ratio", "system_prompt_recompute_ratio"):
            ratio = getattr(self, name)
            if ratio is not None and not 0.0 <= ratio <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {ratio}")
        if self.fidelity_kl is not None and not self.fidelity_kl > 0.0:
            raise ValueError(f"fidelity_kl must be a KL in nats > 0 (e.g. 0.01), or off; got {self.fidelity_kl}")
        self.decode()  # raises naming a bad value
        if self.system_prompt_policy not in SYSTEM_PROMPT_POLICIES:
            raise ValueError(f"system_prompt_policy must be one of {', '.join(SYSTEM_PROMPT_POLICIES)}, got "
                             f"{self.system_prompt_policy!r}")
        if self.default_max_new_tokens is not None and not 1 <= self.default_max_new_tokens <= self.max_new_tokens:
            raise ValueError(f"default_max_new_tokens must be in [1, max_new_tokens={self.max_new_tokens}], got "
                             f"{self.default_max_new_tokens}")
        if self.quality_guard_mass is not None and not 0.0 < self.quality_guard_mass <= 1.0:
            raise ValueError(f"quality_guard_mass must be in (0, 1], got {self.quality_guard_mass}")
        self.focus()  # FocusOptions checks its fields, naming them
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"TLS needs both tls_cert and tls_key, got cert={self.tls_cert} key={self.tls_key}")
        names = [c.name for c in self.indexes]
        if len(set(names)) != len(names):
            raise ValueError(f"collection names must be unique, got {names}")

    def resolved(self) -> ServerSettings:
        """These settings with `auto` device and dtype made concrete (imports torch when auto)."""
        from ragkv.engine.device import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        return dataclasses.replace(self, device=device, dtype=resolve_dtype(self.dtype, device))

    def key_ring(self):  # -> server.api_keys.KeyRing
        """The keys callers must present: the --api-keys file's and the single token's (none = open).

        Raises:
            ValueError: the keys file or the token file is unreadable or malformed.
        """
        from ragkv.server.api_keys import load_key_ring, read_token

        return load_key_ring(self.api_keys_file, read_token(self.auth_token_file))

    def served_model(self, manifest_model: str) -> str:
        """The model to load: --model, else the first index's own (`manifest_model`) when every
        index is on this machine. An index synced from S3 was written by the indexing job, which
        parses untrusted documents: its manifest does not choose what the server loads.

        Raises:
            ValueError: an s3:// index and no --model (naming the flag).
        """
        if self.model is not None:
            return self.model
        remote = [spec.source for spec in self.indexes if spec.source is not None]
        if remote:
            raise ValueError(f"--model is required to serve {remote[0]}: an index's manifest names the model it was "
                             "built with, but whoever writes the index (the indexing job, which parses untrusted "
                             "documents) does not choose what this server loads. Pass --model NAME or DIR (the model "
                             "the index was built with; an index built with another is refused by name)")
        return manifest_model

    def focus(self) -> FocusOptions:
        """How FOCUS picks its chunks, from the --focus-* settings."""
        return FocusOptions(keep=self.focus_keep, handover=self.focus_handover, spread=self.focus_spread,
                            several=self.focus_several,
                            lookup_ratio=self.focus_lookup_ratio, lookup_keep=self.focus_lookup_keep)

    def decode(self) -> DecodeConfig:
        """How the engine decodes: over one pool and with CUDA graphs, or ragged. The pool is the KV
        budget: the requests' KV and the KV tree's device tier (`DecodePool.share`), which admission
        counts together against it."""
        return DecodeConfig(self.decode_pool, self.cuda_graphs, self.kv_budget_bytes)

    def scheduler(self) -> SchedulerConfig:
        """The engine scheduler's budgets, from the --kv-budget-bytes, --max-batch and --prompt-* settings."""
        return SchedulerConfig(self.kv_budget_bytes, self.max_batch, prompt_share=self.prompt_share,
                               prompt_slice_s=self.prompt_slice_s, prompt_batch_rows=self.prompt_batch_rows)

    def limits(self) -> RequestLimits:
        """The request bounds these settings imply."""
        return RequestLimits(
            max_question_chars=self.max_question_chars,
            default_top_k=self.default_top_k,
            max_top_k=self.max_top_k,
            default_mode=self.default_mode,
            default_recompute_ratio=(DEFAULT_RECOMPUTE_RATIO if self.default_recompute_ratio is None
                                     else self.default_recompute_ratio),
            default_max_new_tokens=self.default_max_new_tokens,
            max_new_tokens=self.max_new_tokens,
        )


_HINTS = typing.get_type_hints(ServerSettings)
_FIELDS = tuple(f.name for f in dataclasses.fields(ServerSettings))


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(name: str, raw: object) -> object:
    """Convert a raw value (a string from env, or a TOML/JSON value) to the field's type."""
    hint = _HINTS[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "off")):
            return None
        if name == "prompt_step_tokens" and isinstance(raw, str) and raw.strip().lower() == "auto":
            return None  # sized from the engine's measured speed
        hint = next(a for a in args if a is not type(None))
    if name == "indexes":
        items = raw.split(",") if isinstance(raw, str) else list(raw)  # type: ignore[arg-type]
        return tuple(i if isinstance(i, CollectionSpec) else CollectionSpec.parse(str(i).strip()) for i in items if i)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return raw if isinstance(raw, hint) else hint(str(raw).lower())
        except ValueError:
            allowed = ", ".join(m.value for m in hint)
            raise ValueError(f"{name} must be one of {allowed}, got {raw!r}") from None
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        word = str(raw).strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{name} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")
        return word in _TRUE
    try:
        return hint(raw)
    except (TypeError, ValueError):
        also = " or auto" if name == "prompt_step_tokens" else ""
        raise ValueError(f"{name} must be a {hint.__name__}{also}, got {raw!r}") from None


def read_config_file(path: Path) -> dict[str, object]:
    """Read a TOML (.toml) or JSON (.json) settings file into a field -> value dict."""
    text = Path(path).read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    elif path.suffix == ".toml":
        import tomllib  # Python >= 3.11

        data = tomllib.loads(text)
    else:
        raise ValueError(f"config file must end in .toml or .json, got {path}")
    data = data.get("server", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of settings")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"config file {path}: unknown settings {unknown} (known: {list(_FIELDS)})")
    return data


def load_settings(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> ServerSettings:
    """Merge defaults < file < environment < flags into one ServerSettings.

    Args:
        flags: Field -> value from the command line; None values are "not given".
        env: The environment (os.environ by default); only RAGKV_<FIELD> keys count.
        config_file: Optional TOML/JSON file.

    Raises:
        ValueError: A value does not parse, or names an unknown setting.
    """
    import os

    env = os.environ if env is None else env
    values: dict[str, object] = {}
    if config_file is not None:
        values.update({k: _parse(k, v) for k, v in read_config_file(config_file).items()})
    for name in _FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _parse(name, raw)
    for name, value in (flags or {}).items():
        if name not in _FIELDS:
            raise ValueError(f"unknown setting {name!r}")
        if value is not None and value != ():
            values[name] = _parse(name, value)
    return ServerSettings(**values)
