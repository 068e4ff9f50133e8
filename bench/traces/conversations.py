"""Multi-turn rollouts with tool calls in other tools' dumps: what the policy decoded, and what
the agent loop inserted.

An agentic rollout interleaves the policy's turns with tool responses. The policy decodes its
turns; the tool responses are appended to the context by the agent loop (a prefill, masked out of
the loss: verl's ``response_mask``), never drafted or verified. So only the policy's turns are
generated tokens here; the tool responses are counted (``tool_tokens``) and left out. A simulated
rollout is then the policy's turns decoded back to back: the tool's latency, the prefill of its
response and any draft copied from it are not modelled (say so wherever a figure comes from such a
dump).

Two shapes are read:

- **decoded text** (verl's ``trainer.rollout_data_dir``: ``output`` is the response decoded with the
  special tokens stripped, tool responses included): the segments matching ``tool_pattern`` are
  the tool's. The default matches Hermes-style blocks as Qwen2.5's and Llama's templates write them
  (``<tool_response>...</tool_response>``, with the role headers around them left by stripping
  ``<|im_start|>``/``<|im_end|>``); ``--tool-response-pattern REGEX`` names another, ``none`` keeps
  the whole text.
- **chat messages** (TRL's conversational ``completion``, an evaluation dump's samples, a prompt
  that is a whole conversation): the assistant messages are the policy's (their ``tool_calls``
  included); ``tool``, ``user`` and ``system`` messages are context. A prompt conversation with
  tool calls is rendered by the tokenizer's chat template; a template that ignores ``tool_calls``
  gets them inline as Hermes-style ``<tool_call>`` blocks.

    python -m pytest -q tests/test_trace_conversations.py
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

from bench.traces.format import TraceError

TOOL_RESPONSE_PATTERN = r"(?:\n?user\n)?<tool_response>.*?</tool_response>(?:\n?assistant\n)?"
POLICY_ROLES = ("assistant",)


class Generated(NamedTuple):
    """One rollout's output split: the text the policy decoded, and the tool responses left out."""

    text: str
    tool_segments: int = 0
    tool_text: str = ""


def tool_regex(pattern: str | None):
    """The compiled tool-response pattern (``none``: no tool segments); a bad one is a TraceError."""
    if pattern is None or pattern == "none":
        return None
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise TraceError(f"--tool-response-pattern {pattern!r} is not a regular expression ({exc}); "
                         f"pass one, or none to keep the whole output") from None


def split_decoded(text: str, regex) -> Generated:
    """Decoded output text without the tool responses ``regex`` matches.

    Example: "call<tool_call>x</tool_call>\\nuser\\n<tool_response>\\n5\\n</tool_response>\\nassistant\\nIt is 5."
    -> Generated("call<tool_call>x</tool_call>It is 5.", 1, "\\nuser\\n<tool_response>...").
    """
    if regex is None:
        return Generated(text)
    found = list(regex.finditer(text))
    if not found:
        return Generated(text)
    kept, tools, at = [], [], 0
    for m in found:
        kept.append(text[at:m.start()])
        tools.append(m.group(0))
        at = m.end()
    kept.append(text[at:])
    return Generated("".join(kept), len(found), "".join(tools))


def is_messages(value) -> bool:
    """Whether a dump field is a conversation: a list of {role, content} messages."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _messages(value) -> list[dict]:
    return [dict(m) for m in (value.tolist() if hasattr(value, "tolist") else value)]


def _calls_text(message: dict) -> str:
    """An assistant message's tool calls as Hermes-style blocks (how Qwen2.5's template writes them)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>")
    return "\n".join(out)


def split_messages(value, where: str) -> Generated:
    """A conversation's policy turns (assistant content and tool calls) and the rest left out."""
    msgs = _messages(value)
    kept, tools, left = [], 0, []
    for m in msgs:
        content = m.get("content")
        text = "" if content is None else content if isinstance(content, str) else json.dumps(content)
        if m["role"] in POLICY_ROLES:
            calls = _calls_text(m)
            kept.append(text + ("\n" + calls if text and calls else calls))
        else:
            tools += m["role"] == "tool"
            left.append(text)
    if not kept:
        raise TraceError(f"{where}: the output conversation has no assistant message, so nothing the policy "
                         f"decoded (roles: {sorted({m['role'] for m in msgs})})")
    return Generated("".join(kept), tools, "".join(left))


def render_prompt(value, tokenizer, where: str) -> list[int]:
    """A prompt conversation's token ids by the tokenizer's chat template (generation prompt added);
    tool calls inline where the template ignores them."""
    msgs = _messages(value)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise TraceError(f"{where}: the prompt is a list of chat messages but the tokenizer has no chat "
                         f"template; pass the run's tokenizer")
    if "tool_calls" not in str(template):
        for m in msgs:
            if m.get("tool_calls"):
                calls = _calls_text(m)
                m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
                del m["tool_calls"]
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
    try:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    except Exception as exc:  # a template that refuses a role or a field: say where
        raise TraceError(f"{where}: the tokenizer's chat template cannot render this conversation ({exc}); "
                         f"pass the run's tokenizer") from exc
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns an encoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
