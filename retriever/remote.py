"""Index folders to and from S3: ``s3://bucket/prefix`` holds an index as a folder would.

An index folder is relocatable (its manifest names its KV relative to itself), so moving
it is copying files. ``upload`` and ``download`` copy a folder tree like ``aws s3 sync``:
a file whose size matches and whose copy is not older is skipped, and ``manifest.json``
goes last in both directions, so a reader never sees a complete manifest beside an old
chunk database. This module knows nothing of what the files hold.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ragkv.errors import RagKVError
from ragkv.kvstore.tiers.s3 import S3Settings, check_bucket, check_prefix, make_client
from ragkv.retriever.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"
Include = Callable[[str], bool]  # relative posix path -> copy it?


def is_s3_uri(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` names an S3 location rather than a local folder."""
    return str(text).startswith(S3_SCHEME)


@dataclass(frozen=True, slots=True)
class S3Location:
    """A folder in S3."""

    bucket: str  # bucket name
    prefix: str  # key prefix without surrounding slashes; "" = the bucket's root

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        """Read ``s3://bucket/prefix``; raises ValueError naming the bad URI."""
        if not is_s3_uri(uri):
            raise ValueError(f"{uri!r} is not an S3 URI: expected s3://bucket/prefix")
        bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
        return cls(check_bucket(bucket), check_prefix(prefix))

    @property
    def uri(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{S3_SCHEME}{self.bucket}"

    def key(self, rel: str) -> str:
        """The object key of ``rel`` (a posix path inside this folder)."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def cache_dir(self, root: Path) -> Path:
        """The local folder under ``root`` that mirrors this location."""
        return Path(root) / self.bucket / (self.prefix or "_root")


def safe_relative(rel: str, uri: str) -> PurePosixPath:
    """``rel`` (an object key's remainder under a folder) as a relative path that stays inside it.

    An object key is any string S3 accepts, so a key written by whoever can write the prefix
    (`v1/../../x`, `/etc/x`, `a\\b`) must never pick where a local file lands.

    Raises:
        RagKVError: the key has an empty, ``.`` or ``..`` segment, a backslash, a NUL or a
            drive/absolute root (the message names the object and why).
    """
    why = None
    if not rel:
        why = "is empty"
    elif "\\" in rel or "\x00" in rel:
        why = "holds a backslash or a NUL"
    elif rel.startswith("/"):
        why = "is absolute"
    elif any(part in ("", ".", "..") for part in rel.split("/")):
        why = "has an empty, '.' or '..' segment"
    elif ":" in rel.split("/")[0] and len(rel.split("/")[0]) == 2:
        why = "starts with a drive letter"
    if why is not None:
        raise RagKVError(f"refusing to sync {uri}/{rel}: the object's key {why}, so its local path could "
                         f"escape the sync folder; nothing was written. Remove or rename the object "
                         f"(whoever can write this prefix can plant such keys)")
    return PurePosixPath(rel)


def _inside(local: Path, rel: str, uri: str) -> Path:
    """The local path of ``rel`` under ``local``, checked to resolve inside it (symlinks included)."""
    path = local / safe_relative(rel, uri)
    root = local.resolve()
    if not path.resolve().is_relative_to(root):
        raise RagKVError(f"refusing to sync {uri}/{rel}: it resolves to {path.resolve()}, outside {root} "
                         f"(a symlink in the sync folder?); nothing was written")
    return path


def _everything(rel: str) -> bool:
    return True


def _manifest_last(rels: list[str]) -> list[str]:
    return sorted(rels, key=lambda r: (PurePosixPath(r).name == MANIFEST_NAME, r))


def _list(client: Any, loc: S3Location) -> dict[str, tuple[int, float]]:
    """rel path -> (size in bytes, last modified in unix seconds) of every object under ``loc``."""
    out: dict[str, tuple[int, float]] = {}
    start = f"{loc.prefix}/" if loc.prefix else ""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=start):
        for obj in page.get("Contents", ()):
            rel = obj["Key"][len(start):]
            if rel and not rel.endswith("/"):
                out[rel] = (int(obj["Size"]), obj["LastModified"].timestamp())
    return out


def upload(local: Path, dest: S3Location, include: Include = _everything,
           settings: S3Settings | None = None) -> int:
    """Copy the files under ``local`` that ``include`` accepts to ``dest``; returns files sent.

    Raises:
        RagKVError: S3 refused or could not be reached (the message names the object).
    """
    local = Path(local)
    if not local.is_dir():
        raise ValueError(f"{local} is not a folder: nothing to upload to {dest.uri}")
    client = make_client(settings or S3Settings.from_env())
    rels = [p.relative_to(local).as_posix() for p in local.rglob("*")
            if p.is_file() and not p.name.startswith(".")]
    rels = [r for r in rels if include(r)]
    try:
        remote = _list(client, dest)
        sent = 0
        for rel in _manifest_last(rels):
            st = (local / rel).stat()
            have = remote.get(rel)
            if have is not None and have[0] == st.st_size and have[1] >= st.st_mtime:
                continue
            client.upload_file(str(local / rel), dest.bucket, dest.key(rel))
            sent += 1
    except (BotoCoreError, ClientError) as exc:
        raise RagKVError(f"upload of {local} to {dest.uri} failed: {exc}; check the bucket, the "
                         f"credentials and AWS_ENDPOINT_URL_S3 / AWS_REGION, then rerun") from exc
    log.info("uploaded %d of %d files from %s to %s", sent, len(rels), local, dest.uri)
    return sent


def download(src: S3Location, local: Path, include: Include = _everything, *, missing_ok: bool = False,
             settings: S3Settings | None = None) -> int:
    """Copy the objects under ``src`` that ``include`` accepts into ``local``; returns files fetched.

    Args:
        missing_ok: an empty ``src`` fetches nothing (a first run); else it raises.

    Raises:
        RagKVError: S3 refused or could not be reached, or ``src`` holds no file.
    """
    local = Path(local)
    client = make_client(settings or S3Settings.from_env())
    try:
        remote = {rel: v for rel, v in _list(client, src).items() if include(rel)}
        # every key is checked before the first byte is written: a bad key stops the whole sync
        paths = {rel: _inside(local, rel, src.uri) for rel in remote}
        if not remote and not missing_ok:
            raise RagKVError(f"{src.uri} holds no index files: build one with "
                             f"`ragkv index CORPUS --out {src.uri}`")
        got = 0
        for rel in _manifest_last(list(remote)):
            size, mtime = remote[rel]
            path = paths[rel]
            if path.is_file() and path.stat().st_size == size and path.stat().st_mtime >= mtime:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            try:
                client.download_file(src.bucket, src.key(rel), tmp)
                os.chmod(tmp, 0o644)
                os.utime(tmp, (mtime, mtime))
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
            got += 1
    except (BotoCoreError, ClientError) as exc:
        raise RagKVError(f"download of {src.uri} to {local} failed: {exc}; check the bucket, the "
                         f"credentials and AWS_ENDPOINT_URL_S3 / AWS_REGION, then rerun") from exc
    log.info("fetched %d of %d files from %s to %s", got, len(remote), src.uri, local)
    return got
