"""The kinds of storage tier kvstore builds, in one registry keyed by kind (`TierKind`).

A kind says how a store is configured with it (its name in a spec: `cpu`, `disk:/path`,
`s3://bucket/prefix`), where it sits in the lookup order, whether what it holds outlives the
process (a put writes through to it), how to build it from a spec, and which tier a hit from
it reports to the engine and the client (`ragkv.types.Tier`, the wire's word, which knows
nothing of lookup order or durability). A new kind registers here (`register`): the public
API (`TierSpec`, `StoreConfig.from_uris`, the wire `Tier`) does not change. A kind another
part of ragkv attaches to a running store (the cluster's peer tier, `TieredStore.attach`)
has a place in the order and no builder.

Built-in kinds, in lookup order: gpu, cpu, disk, peer, s3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ragkv.types import Tier

if TYPE_CHECKING:
    from ragkv.kvstore.compression import Compression
    from ragkv.kvstore.eviction import Policy
    from ragkv.kvstore.tiers.base import StorageTier
    from ragkv.kvstore.tiers.s3 import S3Settings


class TierSpec(Protocol):
    """What a builder reads of a spec (`kvstore.config.TierSpec`, which imports this module)."""

    @property
    def kind(self) -> str: ...
    @property
    def path(self) -> str | None: ...
    @property
    def bucket(self) -> str | None: ...
    @property
    def prefix(self) -> str: ...
    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def policy(self) -> Policy: ...


class StoreSettings(Protocol):
    """What a builder reads of the store's settings (`kvstore.config.StoreConfig`)."""

    @property
    def compression(self) -> Compression: ...
    @property
    def s3(self) -> S3Settings: ...


Build = Callable[[TierSpec, StoreSettings, str, str], "StorageTier"]  # (spec, settings, model_fp, tokenizer_fp)


@dataclass(frozen=True, slots=True)
class TierKind:
    """One kind of storage tier."""

    name: str  # its key here and its word in a spec ("disk" in disk:/path)
    reports: Tier  # the tier a hit from it reports (engine, metrics, the client)
    rank: int  # lookup order: a store looks at lower ranks first
    durable: bool  # what it holds outlives the process: a put writes through to it
    build: Build | None = None  # the tier a spec describes; None: attached by its owner, never configured
    path: bool = False  # its spec names a path (name:/path)
    bucket: bool = False  # its spec names a bucket and a prefix (name://bucket/prefix)
    budgeted: bool = True  # its spec may give a byte budget

    @property
    def configurable(self) -> bool:
        """Whether a store is configured with it (a `TierSpec`), not attached later."""
        return self.build is not None

    @property
    def uri(self) -> str:
        """How a spec names it, for messages and help."""
        return f"{self.name}://bucket/prefix" if self.bucket else f"{self.name}:/path" if self.path else self.name


_KINDS: dict[str, TierKind] = {}


def register(kind: TierKind) -> TierKind:
    """Add a kind; ValueError when its name is taken."""
    if kind.name in _KINDS:
        raise ValueError(f"a storage tier kind named {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def kind(name: str | Tier) -> TierKind:
    """The kind of that name (a wire `Tier` names the built-in kind reporting it).

    Raises:
        ValueError: no such kind, naming the ones there are.
    """
    key = name.value if isinstance(name, Tier) else str(name)
    found = _KINDS.get(key)
    if found is None:
        raise ValueError(f"{key!r} is not a storage tier ({', '.join(k.name for k in kinds())})")
    return found


def kinds(configurable: bool = False) -> tuple[TierKind, ...]:
    """Every kind in lookup order (only those a store is configured with, when `configurable`)."""
    return tuple(sorted((k for k in _KINDS.values() if k.configurable or not configurable), key=lambda k: k.rank))


def _gpu(spec: TierSpec, config: StoreSettings, model_fp: str, tokenizer_fp: str) -> StorageTier:
    from ragkv.kvstore.tiers.memory import GpuTier

    return GpuTier(model_fp, tokenizer_fp, spec.budget_bytes, spec.policy)


def _cpu(spec: TierSpec, config: StoreSettings, model_fp: str, tokenizer_fp: str) -> StorageTier:
    from ragkv.kvstore.tiers.memory import CpuTier

    return CpuTier(model_fp, tokenizer_fp, spec.budget_bytes, spec.policy)


def _disk(spec: TierSpec, config: StoreSettings, model_fp: str, tokenizer_fp: str) -> StorageTier:
    from ragkv.kvstore.tiers.disk import DiskTier

    assert spec.path is not None, "a disk spec without a path passed its checks: a bug"
    return DiskTier(spec.path, model_fp, tokenizer_fp, spec.budget_bytes, spec.policy, config.compression)


def _s3(spec: TierSpec, config: StoreSettings, model_fp: str, tokenizer_fp: str) -> StorageTier:
    from ragkv.kvstore.tiers.s3 import S3Tier

    assert spec.bucket is not None, "an s3 spec without a bucket passed its checks: a bug"
    return S3Tier(spec.bucket, spec.prefix, model_fp, tokenizer_fp, config.s3, config.compression)


register(TierKind("gpu", Tier.GPU, 0, durable=False, build=_gpu))  # device memory (CUDA only)
register(TierKind("cpu", Tier.CPU, 1, durable=False, build=_cpu))  # host memory, pinned when CUDA is there
register(TierKind("disk", Tier.DISK, 2, durable=True, build=_disk, path=True))  # files on a local SSD
# another replica's host tier through Ray's object store: attached by a cluster replica, after the local tiers
register(TierKind("peer", Tier.PEER, 3, durable=False))
register(TierKind("s3", Tier.S3, 4, durable=True, build=_s3, bucket=True, budgeted=False))  # an S3-compatible bucket
