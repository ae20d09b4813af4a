"""langchain-tests' standard suites: chat model unit tests, and the integration suites run
against a real gRPC server on loopback (fake backend), so they cost no model time.

Skipped by the suites' own flags: multimodal inputs (the server answers text questions
from retrieved chunks), serialization (not lc-serializable), VCR timing; and, here only,
tool calling, tool choice and structured output: the fake backend answers with the
question's words, so those run against SmolLM2 in tests/agents/test_standard_agents.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ragkv.langchain import RagKVChatModel, RagKVRetriever
from tests.server.fakes import ServerThread

# The suites hold async tests; pytest-asyncio runs them. Its mark lands on the sync
# tests too, where it does nothing but warn.
pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function .*> is marked with '@pytest.mark.asyncio'"),
]


class TestRagKVChatModelUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[RagKVChatModel]:
        return RagKVChatModel

    @property
    def chat_model_params(self) -> dict:
        return {"target": "127.0.0.1:1", "collection": "default", "mode": "blend"}

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        env = {"RAGKV_ADDR": "10.0.0.7:50051", "RAGKV_AUTH_TOKEN": "secret-token"}
        return env, {}, {"target": "10.0.0.7:50051", "api_key": "secret-token"}


class TestRagKVChatModelIntegration(ChatModelIntegrationTests):
    @property
    def has_tool_calling(self) -> bool:
        return False  # on the fake backend; tests/agents/test_standard_agents.py runs them on SmolLM2

    @property
    def has_structured_output(self) -> bool:
        return False  # likewise
    @pytest.fixture(autouse=True)
    def _server(self, fake_server: ServerThread) -> None:
        self.addr = fake_server.addr

    @property
    def chat_model_class(self) -> type[RagKVChatModel]:
        return RagKVChatModel

    @property
    def chat_model_params(self) -> dict:
        return {"target": self.addr, "top_k": 2, "timeout": 10}

    @property
    def supports_model_override(self) -> bool:
        return False  # `model` is a label; the server decides which model answers

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        llm = RagKVChatModel(**self.chat_model_params)
        if not stream:
            return llm.invoke("cached context please")
        full = None
        for chunk in llm.stream("cached context please"):
            full = chunk if full is None else full + chunk
        return full


class TestRagKVRetrieverIntegration(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _server(self, fake_server: ServerThread) -> None:
        self.addr = fake_server.addr

    @property
    def retriever_constructor(self) -> type[RagKVRetriever]:
        return RagKVRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"target": self.addr, "top_k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "what is in the collection?"

    @property
    def num_results_arg_name(self) -> str:
        return "top_k"
