"""engine.prompt: the system prompt is in the prefix; chat history sits between the chunks and the question."""

from __future__ import annotations

import pytest

from ragkv.engine import Engine, load_model
from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT, PromptFormat, history_text


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_model(str(tiny_llama_dir)).tokenizer


def test_system_prompt_changes_only_the_prefix(tokenizer) -> None:
    mine = PromptFormat.for_tokenizer(tokenizer, "Reply in French.")
    default = PromptFormat.for_tokenizer(tokenizer)
    assert mine.prefix_ids() != default.prefix_ids()
    assert "Reply in French." in tokenizer.decode(mine.prefix_ids())
    assert DEFAULT_SYSTEM_PROMPT not in tokenizer.decode(mine.prefix_ids())
    assert mine.chunk_ids("Some chunk text.") == default.chunk_ids("Some chunk text.")
    assert mine.question_ids("why?") == default.question_ids("why?")


def test_history_goes_before_the_question_after_the_chunks(tokenizer) -> None:
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


def test_engine_takes_the_system_prompt(tiny_llama_dir) -> None:
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
def test_segments_render_what_the_chat_template_renders(template) -> None:
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


# -- a conversation in the chat template's own turns: each call's prompt and answer are a
# token prefix of the next call's, whatever the template --

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Gemma's: no system role (raises), user and model turns that must alternate, no tool role
GEMMA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
         "{{ raise_exception('System role not supported') }}{% endif %}"
         "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"page": %d}}\n</tool_call>'


def _templated(tokenizer, template: str):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
        "<start_of_turn>", "<end_of_turn>"]})
    return tok


def _loop_is_a_token_prefix_chain(fmt: PromptFormat, history: list[tuple[str, str]]) -> int:
    """Run a tool loop of 4 calls; assert each call's question segment plus its answer's tokens
    begin the next call's. Returns how many calls rendered as real turns."""
    before = "You can call these tools: lookup.\n\n"
    agent: list[tuple[str, str]] = []
    prev = fmt.turn_ids("Which page says it?", history, before, agent) or fmt.question_ids(
        "Which page says it?", history, before)
    real = 0
    for step in range(4):
        answer = CALL % step
        answer_ids = fmt.tokenizer(answer, add_special_tokens=False)["input_ids"]
        agent += [("assistant", answer), ("tool", f"<tool_response>\npage {step} says 4721\n</tool_response>")]
        ids = fmt.turn_ids("Which page says it?", history, before, agent)
        assert ids is not None, "a conversation with turns must render as real turns"
        real += 1
        assert ids[:len(prev) + len(answer_ids)] == prev + answer_ids, f"step {step}: not a token prefix"
        text = fmt.tokenizer.decode(ids)
        assert text.index("Which page says it?") < text.index(CALL % step) < text.index(f"page {step} says")
        prev = ids
    return real


@pytest.mark.parametrize("template", [CHATML, LLAMA3, GEMMA], ids=["chatml", "llama3", "gemma"])
@pytest.mark.parametrize("history", [[], [("user", "Who chose it?"), ("assistant", "Alice.")]],
                         ids=["no-history", "history"])
def test_a_tool_loop_renders_real_turns_each_call_a_token_prefix_of_the_next(tokenizer, template, history) -> None:
    fmt = PromptFormat.for_tokenizer(_templated(tokenizer, template))
    assert _loop_is_a_token_prefix_chain(fmt, history) == 4


def test_the_shipped_models_template_renders_real_turns(smollm2) -> None:
    fmt = PromptFormat.for_tokenizer(smollm2.tokenizer)
    assert _loop_is_a_token_prefix_chain(fmt, [("user", "Who chose it?"), ("assistant", "Alice.")]) == 4
    ids = fmt.turn_ids("Which page?", [], "", [("assistant", CALL % 1), ("tool", "<tool_response>\nx\n</tool_response>")])
    text = smollm2.tokenizer.decode(ids)
    assert "<|im_start|>assistant\n" + CALL % 1 + "<|im_end|>" in text and "<|im_start|>tool\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_single_question_or_no_template_keeps_one_segment(tokenizer) -> None:
    plain = PromptFormat.for_tokenizer(tokenizer)
    assert plain.turn_ids("Why?", [("user", "Hi")]) is None  # no chat template
    chat = PromptFormat.for_tokenizer(_templated(tokenizer, CHATML))
    assert chat.turn_ids("Why?") is None  # a single question: question_ids, as before
    assert chat.turn_ids("Why?", [("assistant", "Hello.")]) is None  # a conversation must open with the user


@pytest.mark.parametrize("template", [CHATML, LLAMA3, GEMMA], ids=["chatml", "llama3", "gemma"])
def test_a_follow_up_questions_segment_begins_with_the_earlier_call_and_its_answer(tokenizer, template) -> None:
    """The KV tree can only reuse a conversation's earlier turns when the follow-up renders
    them as they were when asked: the first call's segment and answer, token for token."""
    fmt = PromptFormat.for_tokenizer(_templated(tokenizer, template))
    before = "You can call these tools: lookup.\n\n"
    first = fmt.question_ids("Who chose it?", (), before)
    answer = "Alice chose it."
    answer_ids = fmt.tokenizer(answer, add_special_tokens=False)["input_ids"]
    follow = fmt.turn_ids("And when?", [("user", "Who chose it?"), ("assistant", answer)], before)
    assert follow is not None and follow[:len(first) + len(answer_ids)] == first + answer_ids
    assert fmt.tokenizer.decode(follow).count("Question: ") == 2
