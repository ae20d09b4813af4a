"""langchain-tests' standard tool-calling, tool-choice and structured-output tests, run
against SmolLM2 served by ragkv: through `RagKVChatModel` (gRPC) and through
`ChatOpenAI` (the OpenAI HTTP API).

The rest of the standard suite (invoke, stream, usage, stop...) runs against a fake
backend in tests/langchain/test_standard.py; here only the tests of what agents need are
collected (`_agent_tests_only`). None is skipped. What the interface and the grammar
hold, these tests assert and pass: a forced call is made, names the right tool, and its
arguments validate; structured output parses as its schema (a looping string is closed
before the token budget ends: engine.constrain's closing window).

Where an assertion depends on the model's judgement rather than on the interface, the
test runs and is marked xfail (not strict: a better model passes it), with the reason:
- test_tool_calling, test_tool_calling_async: assert the argument *value* {"input": 3}
  for "magic_function(3)". The grammar holds the call to the schema (an integer
  "input"); SmolLM2-135M writes 100. tests/agents/test_openai_agents.py asserts the
  interface part (one call, the named tool, a valid integer argument).
- test_agent_loop: asserts that a question about the weather makes the model call
  get_weather with tool_choice unset ("auto"). The grammar admits a call or text; the
  135M model answers in text. With tool_choice "required" it calls
  (test_tool_choice passes), and after the tool's result it answers.
- ChatOpenAI's test_json_mode: `response_format={"type": "json_object"}` carries no
  schema, so any JSON object is valid; the test wants "setup" and "punchline" keys,
  which only the prompt asks for. (RagKVChatModel's json_mode sends the schema along
  and passes.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

pytest.importorskip("langchain_tests")

from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from ragkv.langchain import RagKVChatModel
from tests.server.fakes import ServerThread

AGENT_TESTS = frozenset({
    "test_tool_calling", "test_tool_calling_async", "test_bind_runnables_as_tools",
    "test_tool_message_histories_string_content", "test_tool_message_histories_list_content",
    "test_tool_choice", "test_tool_calling_with_no_arguments", "test_tool_message_error_status",
    "test_structured_few_shot_examples", "test_structured_output", "test_structured_output_async",
    "test_structured_output_pydantic_2_v1", "test_structured_output_optional_param", "test_json_mode",
    "test_agent_loop", "test_unicode_tool_call_integration",
})

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:The test <Function .*> is marked with '@pytest.mark.asyncio'"),
]


def _agent_tests_only(cls: type) -> type:
    """Collect only the suite's agent tests in `cls` (the others are not collected: None)."""
    for name in dir(ChatModelIntegrationTests):
        if name.startswith("test_") and name not in AGENT_TESTS:
            setattr(cls, name, None)
    return cls


def _judged(name: str, reason: str) -> Callable:
    """The suite's test `name`, run as it is, marked xfail for a reason of the model's judgement."""
    base = getattr(ChatModelIntegrationTests, name)

    @functools.wraps(base)
    def test(self, *args, **kwargs):
        return base(self, *args, **kwargs)

    test.pytestmark = [*getattr(base, "pytestmark", []),  # its own marks (parametrize) kept, not mutated
                       pytest.mark.xfail(reason=f"the model's judgement: {reason}", strict=False)]
    return test


_VALUE = "SmolLM2-135M calls magic_function with input 100 for 'magic_function(3)' (the schema holds, the value is its own)"
_AUTO = "with tool_choice auto SmolLM2-135M answers the weather question in text instead of calling get_weather"


class _AgentSuite(ChatModelIntegrationTests):
    test_tool_calling = _judged("test_tool_calling", _VALUE)
    test_tool_calling_async = _judged("test_tool_calling_async", _VALUE)
    test_agent_loop = _judged("test_agent_loop", _AUTO)

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False


@_agent_tests_only
class TestRagKVChatModelAgents(_AgentSuite):
    @pytest.fixture(autouse=True)
    def _server(self, smol_server: ServerThread) -> None:
        self.addr = smol_server.addr

    @property
    def chat_model_class(self) -> type[RagKVChatModel]:
        return RagKVChatModel

    @property
    def chat_model_params(self) -> dict:
        return {"target": self.addr, "top_k": 2, "timeout": 120, "max_tokens": 64}


@_agent_tests_only
class TestChatOpenAIAgents(_AgentSuite):
    test_json_mode = _judged("test_json_mode", "json_object carries no schema; SmolLM2-135M writes other keys")

    @pytest.fixture(autouse=True)
    def _server(self, smol_server: ServerThread) -> None:
        self.base_url = f"http://127.0.0.1:{smol_server.server.http_port}/v1"

    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        import httpx

        # a client of its own per test: langchain-openai's shared one outlives each test's event loop
        return {"base_url": self.base_url, "api_key": "none", "model": "default", "max_retries": 0, "timeout": 120,
                "max_tokens": 64, "temperature": 0, "extra_body": {"top_k": 2},
                "http_async_client": httpx.AsyncClient(timeout=120)}
