"""StoreConfig: which tiers a store has, their budgets and policies, and how files are compressed.

Built in code or from the CLI's simple specs with `StoreConfig.from_uris`:
`gpu`, `cpu`, `disk:/path`, `s3://bucket/prefix` (the kinds of `kvstore.tiers.kinds`, which
also say what a spec of each takes). Tiers are always looked at in their kinds' order (GPU,
CPU, disk, S3), whatever order the specs come in.

Knows nothing of the tiers' implementations.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from ragkv.kvstore.compression import Compression, check_supported
from ragkv.kvstore.eviction import Policy
from ragkv.kvstore.tiers import kinds as tier_kinds
from ragkv.kvstore.tiers.base import Tier
from ragkv.kvstore.tiers.s3 import S3Settings, check_bucket, check_prefix

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(size: int | str) -> int:
    """Bytes from an int or a string such as "512MiB", "8GB", "1048576".

    Raises:
        ValueError: naming the string when it is not a size.
    """
    if isinstance(size, bool):
        raise ValueError(f"size {size!r} is not a byte count")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"size {size} is negative")
        return size
    m = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {size!r} is not a byte count (e.g. 1048576, 512MiB, 8GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier of a store: its kind (`kvstore.tiers.kinds`) and what that kind takes."""

    kind: str  # the kind's name ("cpu", "disk", ...): a wire `Tier` names its built-in kind
    path: str | None = None  # a path kind (disk): root directory (files go under {path}/{model_fp}/)
    bucket: str | None = None  # a bucket kind (s3): bucket name
    prefix: str = ""  # a bucket kind: object name prefix, without surrounding slashes
    budget_bytes: int | None = None  # byte budget of a budgeted kind; None is unbounded
    policy: Policy = Policy.LRU  # eviction policy of a budgeted kind

    def __post_init__(self) -> None:
        k = tier_kinds.kind(self.kind)  # ValueError naming the kinds there are
        if not k.configurable:
            raise ValueError(f"{k.name!r} is not a tier a store is configured with "
                             f"({', '.join(c.uri for c in tier_kinds.kinds(configurable=True))})")
        object.__setattr__(self, "kind", k.name)
        object.__setattr__(self, "policy", Policy(self.policy))
        if k.path and not self.path:
            raise ValueError(f"{k.name} tier needs a path, e.g. '{k.name}:/var/cache/ragkv'")
        if not k.path and self.path is not None:
            raise ValueError(f"{k.name} tier takes no path, got {self.path!r}")
        if k.bucket:
            check_bucket(self.bucket or "")
            object.__setattr__(self, "prefix", check_prefix(self.prefix))
        elif self.bucket is not None or self.prefix:
            raise ValueError(f"{k.name} tier takes no bucket or prefix, got {self.bucket!r} {self.prefix!r}")
        if not k.budgeted and self.budget_bytes is not None:
            raise ValueError(f"{k.name} tier has no byte budget, got {self.budget_bytes}")
        if self.budget_bytes is not None:
            object.__setattr__(self, "budget_bytes", parse_bytes(self.budget_bytes))

    @property
    def tier_kind(self) -> tier_kinds.TierKind:
        return tier_kinds.kind(self.kind)

    @property
    def tier(self) -> Tier:
        """The tier its hits report (the wire's)."""
        return self.tier_kind.reports

    @classmethod
    def parse(cls, uri: str, budget_bytes: int | None = None, policy: Policy = Policy.LRU) -> TierSpec:
        """A spec from a kind's name (`gpu`, `cpu`), `NAME:/path` (`disk:/path`) or
        `NAME://bucket/prefix` (`s3://bucket/prefix`)."""
        if not isinstance(uri, str):
            raise TypeError(f"tier spec must be a str, got {type(uri).__name__}")
        for k in tier_kinds.kinds(configurable=True):
            if k.bucket and uri.startswith(f"{k.name}://"):
                bucket, _, prefix = uri.removeprefix(f"{k.name}://").partition("/")
                return cls(k.name, bucket=bucket, prefix=prefix)
            if k.path and uri.startswith(f"{k.name}:"):
                path = uri.removeprefix(f"{k.name}:")
                if path.startswith("//"):
                    path = path[2:]  # disk:///abs/path
                return cls(k.name, path=path, budget_bytes=budget_bytes, policy=policy)
            if not (k.path or k.bucket) and uri == k.name:
                return cls(k.name, budget_bytes=budget_bytes, policy=policy)
        raise ValueError(f"tier spec {uri!r} is not one of: "
                         f"{', '.join(k.uri for k in tier_kinds.kinds(configurable=True))}")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The tiers of one store, top-down, and how it writes files."""

    tiers: tuple[TierSpec, ...]  # one per tier kind, sorted GPU, CPU, DISK, S3
    compression: Compression = Compression.NONE  # how disk/S3 files store K and V
    write_through: frozenset[Tier] | None = None  # durable tiers a put writes to; None = all of them
    s3: S3Settings = field(default_factory=S3Settings)  # endpoint, region, retries, multipart
    prefetch_workers: int = 4  # threads loading prefetched keys
    device: str = "cpu"  # where layered reads dequantize compressed files: the engine's device ("cuda:0")

    def __post_init__(self) -> None:
        specs = tuple(sorted(self.tiers, key=lambda s: s.tier_kind.rank))
        kinds = [s.tier for s in specs]  # the tiers their hits report: one of each in a store
        if not specs:
            raise ValueError("a store needs at least one tier")
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"each tier may appear once, got {[k.value for k in kinds]}")
        object.__setattr__(self, "tiers", specs)
        object.__setattr__(self, "compression", check_supported(self.compression))
        if self.write_through is not None:
            wt = frozenset(Tier(t) for t in self.write_through)
            durable = [s.tier for s in specs if s.tier_kind.durable]
            bad = [t.value for t in wt if t not in durable]
            if bad:
                raise ValueError(
                    f"write_through {sorted(bad)} must name durable tiers of this store "
                    f"({[k.value for k in durable]})"
                )
            object.__setattr__(self, "write_through", wt)
        if self.prefetch_workers < 1:
            raise ValueError(f"prefetch_workers must be >= 1, got {self.prefetch_workers}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must name a torch device (cpu, cuda, cuda:0), got {self.device!r}") from None

    @property
    def durable_writes(self) -> frozenset[Tier]:
        """The durable tiers a put writes to."""
        if self.write_through is not None:
            return self.write_through
        return frozenset(s.tier for s in self.tiers if s.tier_kind.durable)

    @classmethod
    def from_uris(
        cls,
        uris: Iterable[str],
        *,
        budgets: Mapping[Tier | str, int | str] | None = None,
        policy: Policy | str = Policy.LRU,
        compression: Compression | str = Compression.NONE,
        endpoint_url: str | None = None,
        region: str | None = None,
        write_through: Iterable[Tier | str] | None = None,
        prefetch_workers: int = 4,
        s3: S3Settings | None = None,
        device: str = "cpu",
    ) -> StoreConfig:
        """A config from CLI-style specs.

        Args:
            uris: e.g. ["cpu", "disk:/var/cache/ragkv", "s3://bucket/kv"].
            budgets: byte budget per tier, e.g. {"cpu": "8GiB", Tier.DISK: 500 * 2**30}.
            policy: eviction policy of every budgeted tier.
            compression: how disk/S3 files store K and V ("none", "int8", "fp8", "int4", "int2").
            endpoint_url: S3 endpoint (MinIO, moto); None for AWS.
            region: S3 region.
            write_through: durable tiers a put writes to; None = all configured.
            prefetch_workers: threads for prefetch.
            s3: full S3 settings; endpoint_url/region, when given, override its fields.
            device: where layered reads dequantize compressed files (the engine's device).
        """
        budget_of: dict[str, int] = {}
        configured = tier_kinds.kinds(configurable=True)
        for name, size in (budgets or {}).items():
            try:
                k = tier_kinds.kind(name)
                if not k.configurable:
                    raise ValueError
            except ValueError:
                raise ValueError(f"budget for {name!r}: not a tier ({[c.name for c in configured]})") from None
            if not k.budgeted:
                raise ValueError(f"{k.name} tier has no byte budget, got {size}")
            budget_of[k.name] = parse_bytes(size)
        specs = []
        for uri in uris:
            spec = TierSpec.parse(uri)
            if spec.tier_kind.budgeted:
                spec = replace(spec, budget_bytes=budget_of.get(spec.kind), policy=Policy(policy))
            specs.append(spec)
        settings = s3 or S3Settings()
        if endpoint_url is not None:
            settings = replace(settings, endpoint_url=endpoint_url)
        if region is not None:
            settings = replace(settings, region=region)
        return cls(
            tiers=tuple(specs),
            compression=Compression(compression),
            write_through=None if write_through is None else frozenset(Tier(t) for t in write_through),
            s3=settings,
            prefetch_workers=prefetch_workers,
            device=device,
        )
