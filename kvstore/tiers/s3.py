"""S3Tier: chunk files as objects, `{prefix}/{model_fp}/{key[:2]}/{key}.safetensors`.

Works against AWS, MinIO or a moto server (bucket, prefix, region and endpoint URL
are settings). Retries with exponential backoff and jitter are botocore's
("standard" mode). Objects over `multipart_threshold` bytes go up in parts. Every
put is conditional (`If-None-Match: *`), so an object under a key is never
replaced: chunk keys name their content's inputs, so the object already there is
kept and a differing one is logged. Reads are verified like disk reads; an object
that fails verification is deleted (S3 has no rename), so a later put can replace it.

A get that cannot reach S3 is a counted, logged miss; a put that cannot raises StoreError.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ragkv.errors import KVFormatError, StoreError
from ragkv.kvstore.compression import Compression
from ragkv.kvstore.entry import KVEntry
from ragkv.kvstore.fileformat import read_header
from ragkv.kvstore.keys import ChunkKey
from ragkv.kvstore.tiers.base import Tier
from ragkv.kvstore.tiers.durable import DurableTier

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
MIN_PART_BYTES = 5 * 1024 * 1024  # S3's smallest part but the last
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9._=+-]*")
_MISSING = {"NoSuchKey", "404", "NotFound"}
_HEAD_BYTES = 1 << 16  # the first ranged GET of a layered read: header and the start of k
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


def check_bucket(bucket: str) -> str:
    """Return `bucket` if it is a valid S3 bucket name, else raise ValueError."""
    if not isinstance(bucket, str) or _BUCKET.fullmatch(bucket) is None or ".." in bucket:
        raise ValueError(f"S3 bucket {bucket!r} is not a valid bucket name (3-63 of [a-z0-9.-])")
    return bucket


def check_prefix(prefix: str) -> str:
    """Return `prefix` without surrounding slashes if every segment is a plain name, else raise ValueError."""
    stripped = prefix.strip("/")
    if stripped and not all(_SEGMENT.fullmatch(seg) for seg in stripped.split("/")):
        raise ValueError(
            f"S3 prefix {prefix!r} is not allowed: segments of [A-Za-z0-9._=+-], "
            "none empty or starting with '.'"
        )
    return stripped


@dataclass(frozen=True, slots=True)
class S3Settings:
    """How to reach S3 and how hard to try."""

    endpoint_url: str | None = None  # e.g. http://127.0.0.1:9000 for MinIO/moto; None for AWS
    region: str | None = None  # e.g. us-east-1; None takes boto3's default chain
    max_attempts: int = 5  # total tries per request, with exponential backoff between
    connect_timeout_s: float = 5.0  # seconds to open a connection
    read_timeout_s: float = 60.0  # seconds to wait for a response's bytes
    multipart_threshold: int = 64 * 1024 * 1024  # bytes; larger objects go up in parts
    part_bytes: int = 16 * 1024 * 1024  # bytes per part (at least 5 MiB)
    max_workers: int = 8  # threads for get_many / put_many
    # bytes an object may have to be read (a chunk's KV: 8B-model bf16 KV of 2K tokens is 256 MiB):
    # whoever can write the KV prefix cannot make the server read gigabytes into memory
    max_object_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_object_bytes < 1:
            raise ValueError(f"max_object_bytes must be >= 1, got {self.max_object_bytes}")
        if self.part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be >= {MIN_PART_BYTES} (S3's minimum), got {self.part_bytes}")
        if self.multipart_threshold < self.part_bytes:
            raise ValueError(
                f"multipart_threshold {self.multipart_threshold} must be >= part_bytes {self.part_bytes}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        """Endpoint and region from the AWS variables boto3 itself reads (AWS_ENDPOINT_URL_S3,
        AWS_ENDPOINT_URL, AWS_REGION, AWS_DEFAULT_REGION); None where unset."""
        env = os.environ if env is None else env
        return cls(endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None,
                   region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None)


def make_client(settings: S3Settings) -> Any:
    """A boto3 S3 client with these settings' endpoint, region, retries and timeouts."""
    config = Config(
        retries={"max_attempts": settings.max_attempts, "mode": "standard"},
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
        max_pool_connections=max(10, settings.max_workers * 2),
        s3={"addressing_style": "path"} if settings.endpoint_url else None,
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=settings.endpoint_url, region_name=settings.region, config=config
    )


class _ObjectSource:
    """An object read by byte ranges (kvstore.layered's ByteSource).

    Opening fetches the head (header and the start of k) with one ranged GET, whose
    Content-Range gives the size; each later reader is one streaming ranged GET.
    """

    def __init__(self, client: Any, bucket: str, name: str, max_bytes: int = 1 << 30) -> None:
        self._s3, self._bucket, self._name = client, bucket, name
        resp = client.get_object(Bucket=bucket, Key=name, Range=f"bytes=0-{_HEAD_BYTES - 1}")
        self._head = resp["Body"].read()
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        self.size = int(total) if total.isdigit() else len(self._head)
        if self.size > max_bytes:
            raise StoreError(f"s3://{bucket}/{name} is {self.size} bytes, more than a KV object may be "
                             f"({max_bytes}, S3Settings.max_object_bytes): not read")

    def reader(self, start: int, end: int) -> _BodyReader:
        if end <= len(self._head):
            return _BodyReader(memoryview(self._head)[start:end])
        try:
            body = self._s3.get_object(Bucket=self._bucket, Key=self._name, Range=f"bytes={start}-{end - 1}")["Body"]
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"s3 ranged get of s3://{self._bucket}/{self._name} failed: {e}") from e
        return _BodyReader(body)

    def close(self) -> None:
        self._head = b""


class _BodyReader:
    """Sequential reads from a GET's streaming body (or from bytes already fetched)."""

    def __init__(self, body: Any) -> None:
        self._body = body
        self._pos = 0

    def readinto(self, view: memoryview) -> int:
        if isinstance(self._body, memoryview):
            part = self._body[self._pos:self._pos + len(view)]
            self._pos += len(part)
        else:
            try:
                part = self._body.read(len(view))
            except Exception as e:  # botocore and urllib3 both raise from a broken stream
                raise StoreError(f"s3 read failed mid-object: {e}") from e
        view[:len(part)] = part
        return len(part)


class S3Tier(DurableTier):
    """Chunk files in one bucket under one prefix, for one model. No byte budget."""

    tier = Tier.S3
    streams_layers = True

    def __init__(
        self,
        bucket: str,
        prefix: str,
        model_fp: str,
        tokenizer_fp: str,
        settings: S3Settings = S3Settings(),
        compression: Compression = Compression.NONE,
        client: Any = None,
    ) -> None:
        super().__init__(model_fp, tokenizer_fp, None, compression)
        self.bucket = check_bucket(bucket)
        self.prefix = check_prefix(prefix)
        self.settings = settings
        self._s3 = make_client(settings) if client is None else client
        self._pool = ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="kvstore-s3")

    def object_key(self, key: ChunkKey) -> str:
        """The object name of `key`'s file."""
        name = f"{self.model_fp}/{key.shard}/{key.hex}{SUFFIX}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def _failed(self, what: str, key: ChunkKey, e: Exception) -> None:
        self._counters.add(errors=1)
        logger.warning("s3 tier %s of key %s in s3://%s failed: %s", what, key.hex, self.bucket, e)

    def _read(self, key: ChunkKey) -> bytearray | None:
        try:
            resp = self._s3.get_object(Bucket=self.bucket, Key=self.object_key(key))
            size = int(resp.get("ContentLength") or 0)
            if size > self.settings.max_object_bytes:  # checked before a byte of the body is read
                resp["Body"].close()
                self._failed("get", key, StoreError(f"the object is {size} bytes, more than a KV object may be "
                                                    f"({self.settings.max_object_bytes})"))
                return None
            return bytearray(resp["Body"].read())
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return None
            self._failed("get", key, e)
        except Exception as e:  # botocore, and urllib3 from a body cut off mid-read
            self._failed("get", key, e)
        return None

    def _source(self, key: ChunkKey) -> _ObjectSource | None:
        name = self.object_key(key)
        try:
            return _ObjectSource(self._s3, self.bucket, name, self.settings.max_object_bytes)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING | {"InvalidRange"}:
                return None
            raise StoreError(f"s3 get of s3://{self.bucket}/{name} failed: {e}") from e
        except Exception as e:  # botocore, and urllib3 from a body cut off mid-read
            raise StoreError(f"s3 get of s3://{self.bucket}/{name} failed: {e}") from e

    def _write(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        name = self.object_key(key)
        try:
            if len(data) > self.settings.multipart_threshold:
                self._put_multipart(name, data)
            else:
                self._s3.put_object(Bucket=self.bucket, Key=name, Body=bytes(data), IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _EXISTS:
                self._note_existing(key, data)
                return True
            self._failed("put", key, e)
            raise StoreError(f"s3 put of key {key.hex} to s3://{self.bucket}/{name} failed: {e}") from e
        except BotoCoreError as e:
            self._failed("put", key, e)
            raise StoreError(f"s3 put of key {key.hex} to s3://{self.bucket}/{name} failed: {e}") from e
        return True

    def _put_multipart(self, name: str, data: bytes | bytearray | memoryview) -> None:
        upload_id = self._s3.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        try:
            view = memoryview(data)
            step = self.settings.part_bytes
            parts = []
            for number, start in enumerate(range(0, len(view), step), start=1):
                resp = self._s3.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number,
                    Body=bytes(view[start : start + step]),
                )
                parts.append({"PartNumber": number, "ETag": resp["ETag"]})
            self._s3.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, IfNoneMatch="*",
            )
        except BaseException:
            try:
                self._s3.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            except (ClientError, BotoCoreError) as e:
                logger.warning("s3 tier could not abort upload %s of %s: %s", upload_id, name, e)
            raise

    def _note_existing(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        """An object is already under `key`: keep it, and say so if it differs from ours."""
        try:
            existing = self._s3.get_object(
                Bucket=self.bucket, Key=self.object_key(key), Range="bytes=0-65535"
            )["Body"].read()
            theirs, ours = read_header(existing), read_header(data)
        except (ClientError, BotoCoreError, KVFormatError):
            return  # unreadable now; a get will verify (and replace) it
        if theirs != ours:
            logger.warning(
                "s3 tier kept the existing object for key %s (%s) instead of ours (%s)",
                key.hex, theirs.compression.value, ours.compression.value,
            )

    def _discard(self, key: ChunkKey, reason: str, source: object | None = None) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.object_key(key))
            logger.warning("s3 tier deleted s3://%s/%s: %s", self.bucket, self.object_key(key), reason)
        except (ClientError, BotoCoreError) as e:
            self._failed("delete of a bad object", key, e)

    def contains(self, key: ChunkKey) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self.object_key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in _MISSING:
                self._failed("head", key, e)
        except BotoCoreError as e:
            self._failed("head", key, e)
        return False

    def delete(self, key: ChunkKey) -> bool:
        existed = self.contains(key)
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        except (ClientError, BotoCoreError) as e:
            self._failed("delete", key, e)
            raise StoreError(f"s3 delete of key {key.hex} failed: {e}") from e
        return existed

    def get_many(self, keys: Sequence[ChunkKey]) -> list[KVEntry | None]:
        """Concurrent gets (S3 latency hides behind parallel requests)."""
        return list(self._pool.map(self.get, keys))

    def put_many(self, entries: Iterable[KVEntry]) -> list[bool]:
        """Concurrent puts; once all have finished, raises the first error if any failed."""
        futures = [self._pool.submit(self.put, e) for e in entries]
        for f in futures:
            f.exception()  # wait for every put before raising any error
        return [f.result() for f in futures]

    def _usage(self) -> tuple[int, int]:
        # Listing a bucket to count is too slow for stats(); report what this process wrote.
        with self._counters.lock:
            return self._counters.puts, self._counters.bytes_written

    def close(self) -> None:
        self._pool.shutdown(wait=True)
