"""Chat rendering shared by rollout, SFT capture and evaluation (DESIGN.md section 3, thinking mode).

Rollout and benchmarks render a *generation prompt* (``render_prompt``); the
SFT stage renders a *whole conversation* and needs to know which characters
are assistant content (``render_conversation``), so it can build its loss
mask. The two must agree: the text before the last assistant turn of
``render_conversation(messages)`` is, character for character,
``render_prompt(messages[:-1])`` for the same thinking setting. That is why
``render_conversation`` is built from ``render_prompt`` rather than from the
template's own full-conversation rendering: Qwen3's template renders the last
assistant turn of a finished conversation with an empty think block whatever
``enable_thinking`` says, while its generation prompt adds that block only
when thinking is off.

Thinking is passed to the template as ``enable_thinking``; templates that do
not know it (SmolLM2's) ignore it.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Sequence

from specforge_opd.errors import UserError

log = logging.getLogger(__name__)

_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class ChatError(UserError, ValueError):
    """A conversation cannot be rendered; the message names the turn and the fix."""


def _maybe_json(value: Any, what: str) -> Any:
    """Datasets store tool columns either natively (list/dict) or as a JSON string: accept both."""
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return None
        try:
            return json.loads(s)
        except json.JSONDecodeError as e:
            raise ChatError(f"{what} is a string but not JSON ({e}); pass a list of dicts or a JSON string") from None
    return value


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages in the OpenAI form the chat templates expect.

    Accepts ``{"role", "content"}`` and ShareGPT's ``{"from", "value"}``
    (human/gpt), ``content`` None (becomes ""), and ``tool_calls`` given as a
    JSON string or a native list.

    Raises:
        ChatError: an empty list, a message that is not a dict, or one without a role.
    """
    if not messages:
        raise ChatError("messages is empty; pass at least one {'role': 'user', 'content': ...} turn")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] is a {type(m).__name__}, expected a dict with role and content")
        role = m.get("role", m.get("from"))
        if role is None:
            raise ChatError(f"messages[{i}] has no `role` (or ShareGPT `from`) key")
        role = _ROLE_ALIASES.get(role, role)
        content = m.get("content", m.get("value"))
        msg = {k: v for k, v in m.items() if k not in ("from", "value")}
        msg["role"] = role
        msg["content"] = "" if content is None else str(content)
        if "tool_calls" in msg:
            calls = _maybe_json(msg["tool_calls"], f"messages[{i}].tool_calls")
            if calls:
                msg["tool_calls"] = list(calls) if isinstance(calls, (list, tuple)) else [calls]
            else:
                msg.pop("tool_calls")
        out.append(msg)
    return out


def _apply(tokenizer, messages: list[dict], *, thinking: bool, generation: bool, tools=None) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; use a chat/instruct target")
    kwargs: dict[str, Any] = {"enable_thinking": thinking}
    tools = _maybe_json(tools, "tools")
    if tools:
        kwargs["tools"] = list(tools) if isinstance(tools, (list, tuple)) else [tools]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)


def render_prompt(
    tokenizer,
    messages: Sequence[dict],
    *,
    thinking: bool,
    system_prompt: Optional[str] = None,
    tools=None,
) -> str:
    """The generation prompt for ``messages`` (``add_generation_prompt=True``).

    Args:
        tokenizer: an HF tokenizer with a chat template.
        messages: the conversation so far, ending with a user (or tool) turn.
        thinking: Qwen3 thinking mode; off adds the template's empty think block.
        system_prompt: prepended as a system turn unless ``messages`` has one.
        tools: tool schemas (list, or a JSON string).

    Returns:
        The prompt text; tokenize it with ``add_special_tokens=False``.

    Raises:
        ChatError: empty or malformed messages, or a tokenizer without a chat template.
    """
    msgs = normalize_messages(messages)
    if system_prompt is not None and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return _apply(tokenizer, msgs, thinking=thinking, generation=True, tools=tools)


def _turn_end(tokenizer, msgs: list[dict], *, thinking: bool, tools) -> str:
    """What the template writes after the last assistant turn's content (``<|im_end|>\\n`` for ChatML)."""
    full = _apply(tokenizer, msgs, thinking=thinking, generation=False, tools=tools)
    content = msgs[-1]["content"]
    visible = content.split("</think>")[-1].lstrip("\n") if "</think>" in content else content
    at = full.rfind(visible) if visible else -1
    if at < 0:
        eos = getattr(tokenizer, "eos_token", None) or ""
        return eos + "\n" if eos else ""
    return full[at + len(visible):]


def render_conversation(
    tokenizer,
    messages: Sequence[dict],
    *,
    thinking: bool,
    system_prompt: Optional[str] = None,
    tools=None,
) -> tuple[str, list[tuple[int, int]]]:
    """A whole conversation and the character spans of its assistant content.

    The conversation must end with an assistant turn. The text up to that turn
    is ``render_prompt(messages[:-1], thinking=...)`` exactly, so the SFT
    capture sees the same prefix as a rollout; the turn's content follows
    verbatim, then the template's end of turn.

    Each span ``(start, end)`` covers an assistant turn's content plus the end
    of turn token (eos, e.g. ``<|im_end|>``) that a generation ends with, but not
    the newline after it. Earlier assistant turns are located in the prefix as
    the template rendered them (Qwen3 drops their reasoning); a turn that the
    template rewrote beyond recognition gets no span (logged).

    Returns:
        ``(text, spans)``; spans sorted, non-overlapping, in character units.

    Raises:
        ChatError: empty/malformed messages, or the last turn is not an assistant turn.
    """
    msgs = normalize_messages(messages)
    if system_prompt is not None and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    if msgs[-1]["role"] != "assistant":
        raise ChatError(
            f"render_conversation needs a conversation ending with an assistant turn, got `{msgs[-1]['role']}` last; "
            "use render_prompt for a generation prompt"
        )
    prefix = _apply(tokenizer, msgs[:-1], thinking=thinking, generation=True, tools=tools)
    last = msgs[-1]["content"]
    end = _turn_end(tokenizer, msgs, thinking=thinking, tools=tools)
    text = prefix + last + end
    eos = getattr(tokenizer, "eos_token", None) or ""
    eos_len = len(eos) if eos and end.startswith(eos) else 0

    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(msgs[:-1]):
        if m["role"] != "assistant" or not m["content"]:
            continue
        c = m["content"]
        visible = c.split("</think>")[-1].lstrip("\n") if "</think>" in c else c
        at = prefix.find(visible, cursor) if visible else -1
        if at < 0:
            log.warning("assistant turn %d was rewritten by the chat template; it is not supervised", i)
            continue
        stop = at + len(visible)
        if eos and prefix.startswith(eos, stop):
            stop += len(eos)
        spans.append((at, stop))
        cursor = stop
    spans.append((len(prefix), len(prefix) + len(last) + eos_len))
    return text, spans


def supervised_tokens(tokenizer, text: str, spans: Sequence[tuple[int, int]], max_length: Optional[int] = None) -> dict:
    """Tokenize a rendered conversation and mark the tokens inside assistant spans.

    A token is supervised when its first character lies inside a span.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int] (0/1, same length),
        "num_supervised": int}``. The SFT stage drops samples whose
        ``num_supervised`` is 0 (for example a response truncated away by ``max_length``).
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = []
    si = 0
    spans = sorted(spans)
    for start, stop in offsets:
        while si < len(spans) and spans[si][1] <= start:
            si += 1
        inside = si < len(spans) and spans[si][0] <= start < spans[si][1] and stop > start
        mask.append(1 if inside else 0)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": list(ids), "loss_mask": mask, "num_supervised": int(sum(mask))}
