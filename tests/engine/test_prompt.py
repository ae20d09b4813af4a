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


_GEMMA_LIKE = (  # Gemma 1/2's shape: no system role (it raises), turns in <start_of_turn> markers
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_WITH_SYSTEM = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("template", [_GEMMA_LIKE, _WITH_SYSTEM], ids=["no-system-role", "system-role"])
def test_segments_render_what_the_chat_template_renders(template) -> None:  # noqa: ANN001
    """[prefix][chunks][question] decodes to the template's own rendering of the conversation; a
    template without a system role gets the system prompt folded into the user turn."""
    from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT, PromptFormat
    from ragkv.evals.testing import _tokenizer

    tok = _tokenizer()
    tok.chat_template = template
    fmt = PromptFormat.for_tokenizer(tok)
    chunks = ["Paris is the capital of France.", "The secret number is 4721."]
    content = "Context:\n" + "".join(c + "\n\n" for c in chunks) + "Question: What is the number?"
    if template is _GEMMA_LIKE:
        turns = [{"role": "user", "content": f"{DEFAULT_SYSTEM_PROMPT}\n\n{content}"}]
    else:
        turns = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": content}]
    rendered = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert tok.decode(fmt.prompt_ids(chunks, "What is the number?")) == rendered
    assert DEFAULT_SYSTEM_PROMPT in tok.decode(fmt.prefix_ids())  # in the prefix: every chunk's KV sees it
