"""Splitting a corpus across machines: which documents belong to shard i of N.

A document's shard is sha256(doc id) mod N: stable across machines and runs, and
independent of which other documents exist, so re-running one shard on a changed
corpus touches only its own documents.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from ragkv.retriever.manifest import ShardSpec
from ragkv.retriever.records import DocId

ENV_ARRAY_INDEX = "AWS_BATCH_JOB_ARRAY_INDEX"  # set by AWS Batch on each array child
ENV_ARRAY_SIZE = "AWS_BATCH_JOB_ARRAY_SIZE"  # set by our Terraform job definition


def shard_of(doc_id: DocId, count: int) -> int:
    """The shard (0 <= shard < count) that owns ``doc_id``."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def resolve_shard(flag: str | None, env: Mapping[str, str] = os.environ) -> ShardSpec | None:
    """The shard to index: ``--shard i/N`` first, else the AWS Batch array variables, else None.

    Raises:
        ValueError: the flag is malformed, or only one of the two variables is set.
    """
    if flag:
        return ShardSpec.parse(flag)
    index, size = env.get(ENV_ARRAY_INDEX), env.get(ENV_ARRAY_SIZE)
    if index is None and size is None:
        return None
    if index is None or size is None:
        raise ValueError(
            f"{ENV_ARRAY_INDEX}={index!r} and {ENV_ARRAY_SIZE}={size!r}: set both (or pass --shard i/N)"
        )
    return ShardSpec.parse(f"{index}/{size}")
