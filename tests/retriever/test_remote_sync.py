"""S3 index sync as an attacker who can write the index prefix would try it, against moto.

Whoever can write ``s3://bucket/v1/`` (the Batch job that parses untrusted documents, say)
picks object keys; none of them may pick where a serving host writes a file.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest

from ragkv.errors import RagKVError
from ragkv.kvstore import S3Settings
from ragkv.retriever.remote import S3Location, download, safe_relative
from tests.kvstore.conftest import s3_endpoint  # noqa: F401  (the moto server fixture)

BAD_KEYS = [
    "v1/../../../../x.txt",  # climbs out of the sync folder
    "v1/a/../../escape.txt",
    "v1//etc/x.txt",  # an empty segment: the remainder is absolute
    "v1/./manifest.json",
    "v1/a\\..\\..\\x.txt",  # a backslash: a separator on Windows
    "v1/C:/x.txt",
]


@pytest.fixture
def s3(s3_endpoint: str):  # noqa: F811
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"ix-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    settings = S3Settings(endpoint_url=s3_endpoint, region="us-east-1", max_attempts=1,
                          connect_timeout_s=2.0, read_timeout_s=10.0)
    return client, bucket, settings


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_a_key_that_would_escape_is_refused_and_nothing_is_written(s3, tmp_path: Path, bad: str) -> None:
    client, bucket, settings = s3
    client.put_object(Bucket=bucket, Key="v1/chunks.sqlite", Body=b"good")
    client.put_object(Bucket=bucket, Key=bad, Body=b"import os  # planted")
    assert any(o["Key"] == bad for o in client.list_objects_v2(Bucket=bucket)["Contents"]), \
        "moto kept the key as sent (else this test proves nothing)"
    sync = tmp_path / "deep" / "sync" / "folder" / "v1"
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(RagKVError, match="refusing to sync") as info:
        download(S3Location(bucket, "v1"), sync, settings=settings)
    assert bad[len("v1/"):] in str(info.value)  # the message names the object
    assert {p for p in tmp_path.rglob("*") if p.is_file()} == {p for p in before if p.is_file()}, \
        "nothing is written, not even the good file"


def test_a_symlink_in_the_sync_folder_does_not_lead_out(s3, tmp_path: Path) -> None:
    client, bucket, settings = s3
    sync, outside = tmp_path / "sync", tmp_path / "outside"
    sync.mkdir()
    outside.mkdir()
    (sync / "kv").symlink_to(outside, target_is_directory=True)
    client.put_object(Bucket=bucket, Key="v1/kv/x.kv", Body=b"kv")
    with pytest.raises(RagKVError, match="outside"):
        download(S3Location(bucket, "v1"), sync, settings=settings)
    assert list(outside.iterdir()) == []


def test_ordinary_keys_still_sync(s3, tmp_path: Path) -> None:
    client, bucket, settings = s3
    for key in ("v1/manifest.json", "v1/kv/ab/cd.kv", "v1/shard-00000-of-00002/chunks.sqlite", "v1/a..b/c"):
        client.put_object(Bucket=bucket, Key=key, Body=key.encode())
    assert download(S3Location(bucket, "v1"), tmp_path, settings=settings) == 4
    assert (tmp_path / "kv" / "ab" / "cd.kv").read_bytes() == b"v1/kv/ab/cd.kv"
    assert (tmp_path / "a..b" / "c").is_file()


@pytest.mark.parametrize("rel", ["", "..", "a/../b", "/abs", "a//b", "a\\b", "a\x00b"])
def test_safe_relative_refuses(rel: str) -> None:
    with pytest.raises(RagKVError):
        safe_relative(rel, "s3://b/p")
