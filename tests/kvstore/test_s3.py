"""S3 tier against moto's server on loopback: layout, multipart, no overwrite, damage, a dead
endpoint, and what a 403 and a 404 mean."""

from __future__ import annotations

import json
import socket

import boto3
import pytest

from ragkv.errors import StoreError
from ragkv.kvstore import Compression, S3Settings, S3Tier
from ragkv.kvstore.fileformat import encode
from ragkv.kvstore.tiers.s3 import MIN_PART_BYTES
from tests.kvstore.conftest import MODEL_FP, TOKENIZER_FP, assert_same, make_entry


def _tier(bucket, settings, prefix="p/q", compression=Compression.NONE):
    return S3Tier(bucket, prefix, MODEL_FP, TOKENIZER_FP, settings, compression)


def test_object_layout(bucket, s3_settings, s3_client):
    t = _tier(bucket, s3_settings, prefix="/runs/kv/")
    e = make_entry(1)
    t.put(e)
    name = f"runs/kv/{MODEL_FP}/{e.key.hex[:2]}/{e.key.hex}.safetensors"
    assert t.object_key(e.key) == name
    assert [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]] == [name]


def test_missing_object_is_a_plain_miss(bucket, s3_settings):
    t = _tier(bucket, s3_settings)
    assert t.get(make_entry(1).key) is None
    s = t.stats()
    assert (s.misses, s.errors, s.rejected) == (1, 0, 0)


def test_large_object_goes_up_in_parts(bucket, s3_settings, s3_client):
    settings = S3Settings(
        endpoint_url=s3_settings.endpoint_url, region="us-east-1", max_attempts=2,
        multipart_threshold=MIN_PART_BYTES, part_bytes=MIN_PART_BYTES,
    )
    t = _tier(bucket, settings)
    e = make_entry(1, shape=(4, 4, 768, 64))  # fp32 K and V of 3 MiB each: two parts
    assert len(encode(e)) > MIN_PART_BYTES
    t.put(e)
    etag = s3_client.head_object(Bucket=bucket, Key=t.object_key(e.key))["ETag"]
    assert etag.strip('"').endswith("-2")  # a two-part upload
    assert_same(t.get(e.key), e)


def test_put_never_overwrites_an_existing_object(bucket, s3_settings, s3_client, caplog):
    first = _tier(bucket, s3_settings)
    second = _tier(bucket, s3_settings, compression=Compression.INT8)
    e = make_entry(1)
    first.put(e)
    before = s3_client.get_object(Bucket=bucket, Key=first.object_key(e.key))["Body"].read()
    assert second.put(e)  # the key is stored: by the object already there
    after = s3_client.get_object(Bucket=bucket, Key=first.object_key(e.key))["Body"].read()
    assert after == before
    assert "kept the existing object" in caplog.text
    assert_same(second.get(e.key), e)  # bit-exact: the uncompressed original survived


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_model"])
def test_damaged_object_is_a_counted_miss_and_removed(bucket, s3_settings, s3_client, damage):
    t = _tier(bucket, s3_settings)
    e = make_entry(1)
    data = bytearray(encode(e))
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-10]
    else:
        data = bytearray(encode(make_entry(1, model_fp="model-b")))
    s3_client.put_object(Bucket=bucket, Key=t.object_key(e.key), Body=bytes(data))
    assert t.get(e.key) is None
    assert t.stats().rejected == 1
    assert not t.contains(e.key)  # removed, so a good copy can take its place
    t.put(e)
    assert_same(t.get(e.key), e)


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: connections are refused


def test_endpoint_down_gives_misses_and_clear_put_errors():
    settings = S3Settings(endpoint_url=_dead_endpoint(), region="us-east-1", max_attempts=2,
                          connect_timeout_s=1.0, read_timeout_s=1.0)
    t = S3Tier("some-bucket", "p", MODEL_FP, TOKENIZER_FP, settings)
    e = make_entry(1)
    assert t.get(e.key) is None
    assert not t.contains(e.key)
    with pytest.raises(StoreError, match=e.key.hex):
        t.put(e)
    s = t.stats()
    assert s.errors == 3 and s.misses == 1 and s.puts == 0
    t.close()


@pytest.mark.parametrize("bucket_name", ["", "ab", "Bad_Bucket", "a..b", "../x"])
def test_bad_bucket_names_are_refused(bucket_name, s3_settings):
    with pytest.raises(ValueError, match="bucket"):
        S3Tier(bucket_name, "p", MODEL_FP, TOKENIZER_FP, s3_settings)


@pytest.mark.parametrize("prefix", ["../etc", "a/../b", "a//b", "a/./b", ".hidden", "a\\b", "a b"])
def test_path_traversal_in_prefixes_is_refused(prefix, s3_settings):
    with pytest.raises(ValueError, match="prefix"):
        S3Tier("good-bucket", prefix, MODEL_FP, TOKENIZER_FP, s3_settings)


def _user_tier(s3_endpoint, bucket, iam, actions):
    """A tier signed by a new IAM user of moto's that may do only `actions` on the bucket."""
    name = f"kv-user-{len(actions)}-{bucket}"
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="kv", PolicyDocument=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": actions,
                       "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}],
    }))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
    return S3Tier(bucket, "p/q", MODEL_FP, TOKENIZER_FP, S3Settings(endpoint_url=s3_endpoint), client=client)


def test_access_denied_is_an_error_and_not_found_a_miss(s3_endpoint, bucket, monkeypatch):
    # S3 answers a missing key with 403 to a caller without s3:ListBucket (terraform/ grants it
    # unconditionally for that reason): a 403 must stay visible as an error, a 404 is a miss.
    from moto import settings as moto_settings

    iam = boto3.client("iam", endpoint_url=s3_endpoint, region_name="us-east-1")
    reader = _user_tier(s3_endpoint, bucket, iam, ["s3:GetObject", "s3:ListBucket"])
    denied = _user_tier(s3_endpoint, bucket, iam, ["s3:ListBucket"])
    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks IAM from here on
    key = make_entry(1).key

    assert reader.get(key) is None
    assert (reader.stats().misses, reader.stats().errors) == (1, 0)  # 404: a plain miss

    assert denied.get(key) is None
    assert (denied.stats().misses, denied.stats().errors) == (1, 1)  # 403: counted and logged
    with pytest.raises(StoreError, match="AccessDenied"):
        reader.delete(key)  # no s3:DeleteObject: the tier's delete fails loudly
    for t in (reader, denied):
        t.close()


@pytest.mark.parametrize("layered", [False, True])
def test_an_object_past_the_size_cap_is_not_read(bucket, s3_settings, s3_client, layered):
    """Issue 71: whoever can write the KV prefix could make the server read any size into memory.
    An object past S3Settings.max_object_bytes is a counted error and a miss, read neither whole
    nor layer by layer."""
    import dataclasses

    from ragkv.errors import StoreError

    e = make_entry(1)
    data = encode(e)
    t = _tier(bucket, dataclasses.replace(s3_settings, max_object_bytes=len(data) - 1))
    s3_client.put_object(Bucket=bucket, Key=t.object_key(e.key), Body=bytes(data))
    if layered:
        with pytest.raises(StoreError, match="more than a KV object may be"):
            t._source(e.key)
    else:
        assert t.get(e.key) is None
        assert t.stats().errors == 1
    assert_same(_tier(bucket, s3_settings).get(e.key), e)  # within the default cap it reads
