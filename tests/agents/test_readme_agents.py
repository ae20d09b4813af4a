"""The Agents snippets of docs/agents.md (moved there from the README), run as written against
SmolLM2 (only the addresses change), and the same LangGraph ReAct agent over the OpenAI HTTP API
with ChatOpenAI."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from tests.server.fakes import ServerThread

pytest.importorskip("langgraph")

pytestmark = pytest.mark.real_model

README = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def _snippets() -> list[str]:
    text = README.read_text()
    start = text.index("## Agents: tool calls, structured output, cited answers")
    section = text[start:text.index("\n## ", start + 3)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run(code: str, st: ServerThread) -> list[str]:
    code = code.replace("http://localhost:8000/v1", f"http://127.0.0.1:{st.server.http_port}/v1")
    code = code.replace("localhost:50051", st.addr)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme_snippet"})  # our own docs
    return out.getvalue().splitlines()


def test_the_readme_has_the_two_agent_snippets() -> None:
    snippets = _snippets()
    assert len(snippets) == 2 and "from openai import OpenAI" in snippets[0] and "create_react_agent" in snippets[1]


def test_readme_openai_snippet_calls_the_tool_and_returns_schema_json(smol_server: ServerThread) -> None:
    lines = _run(_snippets()[0], smol_server)
    name, arguments = lines[0].split(" ", 1)
    args = json.loads(arguments)
    assert name == "multiply" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    person = json.loads(lines[1])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and isinstance(person["name"], str)


def test_readme_react_agent_calls_the_tool_gets_its_result_and_answers(smol_server: ServerThread) -> None:
    lines = _run(_snippets()[1], smol_server)
    assert lines == ["['human', 'ai', 'tool', 'ai']"]


def test_react_agent_over_the_http_api_with_chat_openai(smol_server: ServerThread) -> None:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    from ragkv.langchain import call_tools_first

    seen: list[dict] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append({"city": city})
        return f"It is sunny and 21 degrees in {city}."

    llm = ChatOpenAI(model="default", base_url=f"http://127.0.0.1:{smol_server.server.http_port}/v1",
                     api_key="none", max_tokens=64, temperature=0, max_retries=0, timeout=120)
    agent = create_react_agent(call_tools_first(llm, [get_weather]), [get_weather])
    state = agent.invoke({"messages": [("user", "What is the weather in Paris?")]})
    messages = state["messages"]
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai"]
    call = messages[1].tool_calls[0]
    assert call["name"] == "get_weather" and seen == [call["args"]] and isinstance(call["args"]["city"], str)
    assert isinstance(messages[2], ToolMessage) and messages[2].tool_call_id == call["id"]
    assert isinstance(messages[3], AIMessage) and messages[3].content.strip() and not messages[3].tool_calls
