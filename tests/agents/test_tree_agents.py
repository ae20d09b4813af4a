"""LangGraph ReAct agents against a SmolLM2 server with the KV tree on (the server's default):
the loop runs as it does without the tree, and its second call is served from the tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.fakes import ServerThread, settings

pytest.importorskip("langgraph")

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def tree_server(smol_index: Path, smollm2):
    from ragkv.retriever import Retriever
    from ragkv.server.assembly import assemble_pipeline
    from ragkv.server.settings import CollectionSpec

    retriever = Retriever.open(smol_index)

    def factory(s):  # share the session's loaded model
        return assemble_pipeline(smollm2, {"default": (smol_index, retriever)}, s)

    st = ServerThread(settings(indexes=(CollectionSpec("default", smol_index),), http_port=0,
                               kv_tree_bytes=256 << 20), factory)
    yield st
    st.stop()


def _weather_tool(seen: list):  # a langchain tool
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    return get_weather


def test_react_agent_over_grpc_hits_the_tree_from_its_second_call(tree_server: ServerThread) -> None:
    from langgraph.prebuilt import create_react_agent

    from ragkv.langchain import RagKVChatModel, call_tools_first

    seen: list[str] = []
    weather = _weather_tool(seen)
    llm = RagKVChatModel(target=tree_server.addr, max_tokens=32, mode="blend", top_k=2)
    agent = create_react_agent(call_tools_first(llm, [weather]), [weather])
    messages = agent.invoke({"messages": [("user", "What is the weather in Lisbon?")]})["messages"]
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai"] and len(seen) == 1
    first, second = messages[1], messages[3]
    assert first.response_metadata["tree_prompt_tokens"] == 0
    # the second call's context (prefix and chunks, blended) and its question came from the tree
    assert second.response_metadata["tree_prompt_tokens"] > 0
    assert second.usage_metadata["input_token_details"]["cache_read"] > \
        first.usage_metadata["input_token_details"]["cache_read"]


def test_react_agent_over_http_hits_the_tree_from_its_second_call(tree_server: ServerThread) -> None:
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    from ragkv.langchain import call_tools_first

    seen: list[str] = []
    weather = _weather_tool(seen)
    llm = ChatOpenAI(model="default", base_url=f"http://127.0.0.1:{tree_server.server.http_port}/v1",
                     api_key="none", max_tokens=32, temperature=0, max_retries=0, timeout=120,
                     extra_body={"mode": "focus", "top_k": 2})
    agent = create_react_agent(call_tools_first(llm, [weather]), [weather])
    messages = agent.invoke({"messages": [("user", "What is the weather in Oslo?")]})["messages"]
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai"] and len(seen) == 1
    first, second = messages[1].usage_metadata, messages[3].usage_metadata
    assert second["input_tokens"] > first["input_tokens"]
    assert second["input_token_details"]["cache_read"] > first["input_token_details"]["cache_read"]


# -- agents with their own instructions (issue 74): served over the index's chunk KV, not refused


def test_react_agent_with_its_own_prompt_answers_over_grpc(tree_server: ServerThread) -> None:
    from langgraph.prebuilt import create_react_agent

    from ragkv.langchain import RagKVChatModel, call_tools_first

    seen: list[str] = []
    weather = _weather_tool(seen)
    llm = RagKVChatModel(target=tree_server.addr, max_tokens=32, mode="blend", top_k=2)
    agent = create_react_agent(call_tools_first(llm, [weather]), [weather],
                               prompt="You are a weather desk. Use the tool, then answer in one short sentence.")
    messages = agent.invoke({"messages": [("user", "What is the weather in Rome?")]})["messages"]
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai"] and len(seen) == 1  # its argument is the model's
    first, last = messages[1], messages[3]
    assert first.response_metadata["system_prompt"] == "prefix"
    assert last.response_metadata["system_prompt"] == "prefix" and last.content.strip()
    # the loop's second call found its context (its instructions in front of the chunks) in the tree
    assert last.response_metadata["tree_prompt_tokens"] > 0


def test_openai_agents_sdk_with_instructions_and_a_forced_tool_call(tree_server: ServerThread) -> None:
    """The Agents SDK, unchanged, as a user of a small model runs it: its own instructions, a
    function tool it must call, no max_output_tokens; then a follow-up turn on the stored
    conversation (previous_response_id). What is asserted is the interface (no 400 for the
    instructions, no `incomplete` for an answer that ends by itself: a tool call ends by its
    grammar), never the 135M model's judgement: whether its free text after a tool result ends
    by itself is its own, so the tool's output is the agent's answer (stop_on_first_tool)."""
    import asyncio

    import openai

    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)  # no traces sent anywhere
    seen: list[str] = []

    @function_tool
    def lookup(city: str) -> str:
        """Look up the weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tree_server.server.http_port}/v1",
                                    api_key="none", max_retries=0, timeout=600)
        agent = Agent(name="weather", instructions="Use the lookup tool, then answer in one short sentence.",
                      model=OpenAIResponsesModel(model="default", openai_client=client), tools=[lookup],
                      model_settings=ModelSettings(tool_choice="lookup"), tool_use_behavior="stop_on_first_tool")
        first = await Runner.run(agent, "What is the weather in Madrid?")
        follow = await Runner.run(agent, "And in Lisbon?", previous_response_id=first.last_response_id)
        return first, follow

    first, follow = asyncio.run(run())  # no 400 for the instructions; no `incomplete` (ModelBehaviorError)
    assert len(seen) == 2  # one call each turn, its arguments the model's
    assert first.final_output.startswith("It is sunny") and follow.final_output.startswith("It is sunny")
    for result in (first, follow):
        (response,) = result.raw_responses
        assert response.usage.output_tokens > 0
    assert follow.raw_responses[0].usage.input_tokens > first.raw_responses[0].usage.input_tokens  # the earlier turns
