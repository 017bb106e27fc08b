"""Chat rendering: Qwen3 thinking on/off, capture == rollout prefix, spans and supervised tokens."""

from __future__ import annotations

import json

import pytest

from specforge_opd.data.assets import qwen3_tokenizer_dir
from specforge_opd.data.chat import ChatError, normalize_messages, render_conversation, render_prompt, supervised_tokens

CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 = 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "3+3 = 6."},
    {"role": "user", "content": "Thanks! Now 4+4?"},
    {"role": "assistant", "content": "4+4 = 8."},
]


@pytest.fixture(scope="module")
def qwen3_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def test_qwen3_generation_prompt_thinking(qwen3_tok):
    msgs = [{"role": "user", "content": "Hi"}]
    on = render_prompt(qwen3_tok, msgs, thinking=True)
    off = render_prompt(qwen3_tok, msgs, thinking=False)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    sys_ = render_prompt(qwen3_tok, msgs, thinking=True, system_prompt="Be brief.")
    assert sys_.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_qwen3_three_turns_thinking_on_off(qwen3_tok):
    text_on, spans_on = render_conversation(qwen3_tok, CONV, thinking=True)
    text_off, spans_off = render_conversation(qwen3_tok, CONV, thinking=False)
    history = (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 = 4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n3+3 = 6.<|im_end|>\n"
        "<|im_start|>user\nThanks! Now 4+4?<|im_end|>\n<|im_start|>assistant\n"
    )
    # the empty think block goes to the last assistant turn only, and only with thinking off
    assert text_on == history + "4+4 = 8.<|im_end|>\n"
    assert text_off == history + "<think>\n\n</think>\n\n4+4 = 8.<|im_end|>\n"
    assert text_off.count("<think>") == 1
    for thinking, text in ((True, text_on), (False, text_off)):
        # training capture and rollout see the same prefix for the same setting
        prefix = render_prompt(qwen3_tok, CONV[:-1], thinking=thinking)
        assert text.startswith(prefix) and text[len(prefix):] == "4+4 = 8.<|im_end|>\n"
    for text, spans in ((text_on, spans_on), (text_off, spans_off)):
        assert [text[a:b] for a, b in spans] == ["2+2 = 4.<|im_end|>", "3+3 = 6.<|im_end|>", "4+4 = 8.<|im_end|>"]


def test_qwen3_reasoning_content_kept_in_last_turn_only(qwen3_tok):
    conv = [dict(m) for m in CONV]
    conv[1]["content"] = "<think>\nadd them\n</think>\n\n2+2 = 4."
    conv[5]["content"] = "<think>\nfour plus four\n</think>\n\n4+4 = 8."
    text, spans = render_conversation(qwen3_tok, conv, thinking=True)
    assert "add them" not in text  # the template drops history reasoning
    assert [text[a:b] for a, b in spans][0] == "2+2 = 4.<|im_end|>"
    assert text[spans[-1][0] : spans[-1][1]] == "<think>\nfour plus four\n</think>\n\n4+4 = 8.<|im_end|>"
    assert text.startswith(render_prompt(qwen3_tok, conv[:-1], thinking=True))


def test_supervised_tokens_cover_assistant_content(qwen3_tok):
    text, spans = render_conversation(qwen3_tok, CONV, thinking=False)
    enc = supervised_tokens(qwen3_tok, text, spans)
    assert len(enc["input_ids"]) == len(enc["loss_mask"])
    sup = [t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m]
    assert qwen3_tok.decode(sup) == "2+2 = 4.<|im_end|>3+3 = 6.<|im_end|>4+4 = 8.<|im_end|>"
    assert enc["num_supervised"] == len(sup) and sup.count(qwen3_tok.convert_tokens_to_ids("<|im_end|>")) == 3
    cut = supervised_tokens(qwen3_tok, text, spans[-1:], max_length=10)  # response truncated away
    assert cut["num_supervised"] == 0 and len(cut["input_ids"]) == 10


def test_tool_columns_native_or_json(qwen3_tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    base = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": None}, {"role": "tool", "content": "3"}]
    native = [dict(m) for m in base]
    native[1]["tool_calls"] = call
    as_json = [dict(m) for m in base]
    as_json[1]["tool_calls"] = json.dumps(call)
    a = render_prompt(qwen3_tok, native, thinking=False, tools=tools)
    b = render_prompt(qwen3_tok, as_json, thinking=False, tools=json.dumps(tools))
    assert a == b
    assert '"name": "add"' in a and '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}' in a
    assert "<tool_response>\n3\n</tool_response>" in a


def test_normalize_and_errors(qwen3_tok):
    assert normalize_messages([{"from": "human", "value": "x"}, {"from": "gpt", "value": None}]) == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": ""},
    ]
    with pytest.raises(ChatError, match="empty"):
        render_prompt(qwen3_tok, [], thinking=False)
    with pytest.raises(ChatError, match=r"messages\[0\] has no `role`"):
        render_prompt(qwen3_tok, [{"content": "x"}], thinking=False)
    with pytest.raises(ChatError, match="ending with an assistant turn"):
        render_conversation(qwen3_tok, CONV[:-1], thinking=False)
    with pytest.raises(ChatError, match="not JSON"):
        render_prompt(qwen3_tok, [{"role": "user", "content": "x"}], thinking=False, tools="[oops")


@pytest.mark.embedded
def test_smollm2_template_ignores_thinking(embedded_target_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_target_dir)
    msgs = [{"role": "user", "content": "Hi"}]
    on, off = render_prompt(tok, msgs, thinking=True), render_prompt(tok, msgs, thinking=False)
    assert on == off == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    text, spans = render_conversation(tok, msgs + [{"role": "assistant", "content": "Hello!"}], thinking=False)
    assert text == on + "Hello!<|im_end|>\n" and [text[a:b] for a, b in spans] == ["Hello!<|im_end|>"]
    enc = supervised_tokens(tok, text, spans)
    assert tok.decode([t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m]) == "Hello!<|im_end|>"
