"""OpenAI chat messages -> the model's prompt, through its chat template.

The messages go to the tokenizer's Jinja chat template as plain dicts, with the request's
`tools` passed as the template's `tools` variable (what Qwen, Hermes, Llama 3.1 and
Mistral templates expect). Assistant tool calls carry their arguments as a dict, since
templates serialize them with `tojson`.

Many small models' templates (SmolLM2's among them) know nothing of tools. For those, the
tools are described in a system message in the Hermes format the tool parser reads back
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), earlier assistant tool calls
are written into the assistant's text in that same format, and tool results are given as
`<tool_response>` blocks, so a conversation with tools renders on any template.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.runtime.serving.protocol import ChatCompletionRequest, bad_request

TOOLS_SYSTEM_PROMPT = (
    "You can call functions to help with the user's request. The functions are described "
    "in JSON Schema inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with a JSON object naming the function and giving its "
    "arguments, inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates; the default is the one used
        template = template.get("default") or next(iter(template.values()), "")
    return isinstance(template, str) and "tools" in template and "tool_calls" in template


def _text(content: Any, where: str) -> str:
    """A message's content as one string (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(f"{where}[{j}]: content of type {part.type!r} is not supported "
                              "(this server serves text-only models)", f"{where}[{j}].type")
        parts.append(part.text)
    return "".join(parts)


def _tool_call_text(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def to_template_messages(req: ChatCompletionRequest, native_tools: bool) -> list[dict[str, Any]]:
    """The request's messages as the dicts a chat template reads."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        role = "system" if m.role == "developer" else m.role  # templates predate "developer"
        msg: dict[str, Any] = {"role": role, "content": _text(m.content, where)}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for k, call in enumerate(m.tool_calls):
                try:
                    args = json.loads(call.function.arguments) if call.function.arguments else {}
                except json.JSONDecodeError:
                    raise bad_request(f"messages[{i}].tool_calls[{k}].function.arguments must be a JSON "
                                      "object serialized as a string",
                                      f"messages[{i}].tool_calls[{k}].function.arguments") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            if native_tools:
                msg["tool_calls"] = calls
            else:
                text = [msg["content"]] if msg["content"] else []
                text += [_tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
                msg["content"] = "\n".join(text)
        if m.role == "tool":
            if native_tools:
                msg["tool_call_id"] = m.tool_call_id
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        if getattr(m, "name", None):
            msg["name"] = m.name
        out.append(msg)
    return out


def _with_tools_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    note = TOOLS_SYSTEM_PROMPT.format(tools=described)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + note) if first["content"] else note
        return [first] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def render_chat_prompt(tokenizer: Any, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> str:
    """The prompt text for a chat request (special tokens included, as the template writes them).

    Raises OpenAIError (400) when the model has no template or the template rejects the
    conversation (e.g. roles in an order it does not allow).
    """
    import jinja2

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions with a plain prompt", "messages")
    native = template_supports_tools(tokenizer)
    messages = to_template_messages(req, native)
    kwargs = dict(req.chat_template_kwargs or {})
    for reserved in ("conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                     "continue_final_message", "return_dict"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs.{reserved} is set by the server; pass it as a "
                              "request field instead", f"chat_template_kwargs.{reserved}")
    template_tools = tools
    if tools and not native:
        messages = _with_tools_system_prompt(messages, tools)
        template_tools = None
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be from the assistant",
                          "continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=template_tools, tokenize=False,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message, **kwargs,
        )
    except jinja2.TemplateError as e:
        raise bad_request(f"messages: the model's chat template rejected the conversation: {e}", "messages") from None
    except (ValueError, TypeError, KeyError) as e:
        raise bad_request(f"messages: cannot apply the chat template: {e}", "messages") from None
    if not isinstance(text, str):
        raise bad_request("messages: the chat template did not produce text", "messages")
    return text
