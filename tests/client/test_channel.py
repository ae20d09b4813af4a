"""The SDK's bearer token never goes in plaintext to another machine unless the caller says so
(issue 71): a token over a plaintext channel to a host that is not loopback is refused with what
to do, and warned about with `insecure=True`; TLS, loopback and no token are unaffected."""

from __future__ import annotations

import warnings

import pytest

from ragkv.channel import ChannelConfig
from ragkv.client import AsyncRagClient, RagClient


@pytest.mark.parametrize("target", ["10.0.0.5:50051", "rag.example.com:443", "[2001:db8::1]:50051"])
def test_a_token_in_plaintext_to_another_host_is_refused(target: str) -> None:
    with pytest.raises(ValueError, match="plaintext .* tls=True .* insecure=True"):
        ChannelConfig.create(target, token="secret")
    with pytest.raises(ValueError, match="plaintext"):
        RagClient(target, token="secret")


def test_insecure_sends_it_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="plaintext to 10.0.0.5:50051"):
        config = ChannelConfig.create("10.0.0.5:50051", token="secret", insecure=True)
    assert config.metadata() == (("authorization", "Bearer secret"),)
    with pytest.warns(UserWarning, match="plaintext"):
        RagClient("10.0.0.5:50051", token="secret", insecure=True).close()


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "localhost:50051", "[::1]:50051", "127.0.0.2:1",
                                    "unix:/tmp/ragkv.sock"])
def test_loopback_tls_and_no_token_need_nothing(target: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ChannelConfig.create(target, token="secret")
        ChannelConfig.create("10.0.0.5:50051", token="secret", tls=True)
        ChannelConfig.create("10.0.0.5:50051")


def test_the_async_client_and_the_langchain_model_refuse_too() -> None:
    import asyncio

    async def make() -> None:
        AsyncRagClient("10.0.0.5:50051", token="secret")

    with pytest.raises(ValueError, match="plaintext"):
        asyncio.run(make())
    from ragkv.langchain import RagKVChatModel

    with pytest.raises(ValueError, match="plaintext"):
        RagKVChatModel(target="10.0.0.5:50051", api_key="secret").invoke("hi")
