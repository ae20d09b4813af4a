"""engine.prompt: the system prompt is in the prefix; chat history sits between the chunks and the question."""

from __future__ import annotations

import pytest

from ragkv.engine import Engine, load_model
from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT, PromptFormat, history_text


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):  # noqa: ANN001, ANN201
    return load_model(str(tiny_llama_dir)).tokenizer


def test_system_prompt_changes_only_the_prefix(tokenizer) -> None:  # noqa: ANN001
    mine = PromptFormat.for_tokenizer(tokenizer, "Reply in French.")
    default = PromptFormat.for_tokenizer(tokenizer)
    assert mine.prefix_ids() != default.prefix_ids()
    assert "Reply in French." in tokenizer.decode(mine.prefix_ids())
    assert DEFAULT_SYSTEM_PROMPT not in tokenizer.decode(mine.prefix_ids())
    assert mine.chunk_ids("Some chunk text.") == default.chunk_ids("Some chunk text.")
    assert mine.question_ids("why?") == default.question_ids("why?")


def test_history_goes_before_the_question_after_the_chunks(tokenizer) -> None:  # noqa: ANN001
    fmt = PromptFormat.for_tokenizer(tokenizer)
    history = [("user", "Who met Bob?"), ("assistant", "Alice did.")]
    ids = fmt.prompt_ids(["Alice met Bob in Paris."], "Where?", history)
    text = tokenizer.decode(ids)
    chunk_at, user_at, assistant_at, question_at = (
        text.index("Alice met Bob in Paris."), text.index("User: Who met Bob?"),
        text.index("Assistant: Alice did."), text.index("Question: Where?"))
    assert chunk_at < user_at < assistant_at < question_at
    assert len(fmt.question_ids("Where?", history)) > len(fmt.question_ids("Where?"))
    assert fmt.question_ids("Where?", ()) == fmt.question_ids("Where?")


def test_history_text_rejects_other_roles() -> None:
    assert history_text([]) == ""
    with pytest.raises(ValueError, match="'system'"):
        history_text([("system", "x")])


def test_engine_takes_the_system_prompt(tiny_llama_dir) -> None:  # noqa: ANN001
    engine = Engine(load_model(str(tiny_llama_dir)), system_prompt="Be terse.")
    assert "Be terse." in engine.lm.tokenizer.decode(engine.prompt.prefix_ids())
