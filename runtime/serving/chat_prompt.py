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
from dataclasses import dataclass
from typing import Any

from kiln.runtime.serving.protocol import ChatCompletionRequest, bad_request

TOOLS_SYSTEM_PROMPT = (
    "You can call functions to help with the user's request. The functions are described "
    "in JSON Schema inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with a JSON object naming the function and giving its "
    "arguments, inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)
# The last sentence of TOOLS_SYSTEM_PROMPT in the call format of each other tool-call parser
# (`kiln serve --tool-call-parser`), so the parser can read back what the prompt asks for.
TOOL_FORMAT_INSTRUCTIONS = {
    "llama3_json": ('To call a function, reply with only a JSON object naming the function and giving its '
                    'arguments:\n{{"name": <function name>, "parameters": <arguments as a JSON object>}}'),
    "mistral": ('To call a function, reply with [TOOL_CALLS] and a JSON list of calls:\n'
                '[TOOL_CALLS][{{"name": <function name>, "arguments": <arguments as a JSON object>}}]'),
    "qwen3_coder": ("To call a function, reply with:\n<tool_call>\n<function=FUNCTION NAME>\n"
                    "<parameter=PARAMETER NAME>\nVALUE\n</parameter>\n</function>\n</tool_call>"),
}


def template_supports_tools(tokenizer: Any) -> bool:
    template = model_template(tokenizer)
    return template is not None and _supports_tools(template)


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
        reasoning = getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None)
        if reasoning:  # an earlier reply's reasoning: Qwen3's template reads one name, GPT-OSS's the other
            msg["reasoning_content"] = msg["thinking"] = reasoning
        if m.role == "tool":
            if native_tools:
                msg["tool_call_id"] = m.tool_call_id
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        if getattr(m, "name", None):
            msg["name"] = m.name
        out.append(msg)
    return out


def _with_tools_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                              tool_format: str = "hermes") -> list[dict[str, Any]]:
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    note = TOOLS_SYSTEM_PROMPT.format(tools=described)
    if tool_format in TOOL_FORMAT_INSTRUCTIONS:
        head = note[:note.index("To call a function")]
        note = head + TOOL_FORMAT_INSTRUCTIONS[tool_format].format()
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + note) if first["content"] else note
        return [first] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def conversation_chars(req: ChatCompletionRequest) -> int:
    """Characters of text in the request's messages (what the prompt-size limit counts before
    anything is rendered or tokenized)."""
    total = 0
    for m in req.messages:
        content = m.content
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text) for part in content if getattr(part, "text", None))
        for call in getattr(m, "tool_calls", None) or []:
            total += len(call.function.arguments) + len(call.function.name)
    return total


def client_chat_template(req: ChatCompletionRequest) -> tuple[str, str] | None:
    """(template, the field it came in) when the client sent its own chat template, else None."""
    kwargs_template = (req.chat_template_kwargs or {}).get("chat_template")
    if req.chat_template is not None and kwargs_template is not None:
        raise bad_request("give chat_template or chat_template_kwargs.chat_template, not both", "chat_template")
    if req.chat_template is not None:
        return req.chat_template, "chat_template"
    if kwargs_template is not None:
        if not isinstance(kwargs_template, str):
            raise bad_request("chat_template_kwargs.chat_template must be a string (a Jinja template)",
                              "chat_template_kwargs.chat_template")
        return kwargs_template, "chat_template_kwargs.chat_template"
    return None


@dataclass
class TemplateInputs:
    """What a chat template is rendered with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    variables: dict[str, Any]  # chat_template_kwargs, less the template itself
    add_generation_prompt: bool
    continue_final_message: bool


def template_inputs(template: str, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                    tool_format: str = "hermes") -> TemplateInputs:
    """The messages, tools and variables for rendering `template` (the model's or the client's);
    a template without tools gets them described in a system message asking for `tool_format`."""
    native = _supports_tools(template)
    messages = to_template_messages(req, native)
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.pop("chat_template", None)  # the client's template: see client_chat_template
    for reserved in ("conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                     "continue_final_message", "return_dict"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs.{reserved} is set by the server; pass it as a "
                              "request field instead", f"chat_template_kwargs.{reserved}")
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    template_tools = tools
    if tools and not native:
        messages = _with_tools_system_prompt(messages, tools, tool_format)
        template_tools = None
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be from the assistant",
                          "continue_final_message")
    return TemplateInputs(messages, template_tools, kwargs,
                          req.add_generation_prompt and not req.continue_final_message, req.continue_final_message)


def continue_final(text: str, inputs: TemplateInputs, param: str) -> str:
    """With continue_final_message, cut what the template wrote after the last message's text
    (its end-of-turn tokens), as transformers does for the model's own template."""
    if not inputs.continue_final_message:
        return text
    final = inputs.messages[-1]["content"].strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise bad_request("continue_final_message: the chat template does not write the final message's text "
                          "as given, so it cannot be continued", param)
    return text[:at + len(final)]


def model_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates; the default is the one used
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def _supports_tools(template: str) -> bool:
    return "tools" in template and "tool_calls" in template


def render_chat_prompt(tokenizer: Any, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                       server_template: str | None = None, tool_format: str = "hermes") -> str:
    """The prompt text for a chat request through the model's own template, or the server's
    (`kiln serve --chat-template`: the operator's, trusted like the model's), special tokens
    included as the template writes them. A client's template goes through
    kiln.runtime.serving.template_sandbox instead.

    Raises OpenAIError (400) when the model has no template or the template rejects the
    conversation (e.g. roles in an order it does not allow).
    """
    import jinja2

    template = server_template or model_template(tokenizer)
    if template is None:
        raise bad_request("this model has no chat template; use /v1/completions with a plain prompt (or start "
                          "the server with --chat-template)", "messages")
    inputs = template_inputs(template, req, tools, tool_format)
    try:
        text = tokenizer.apply_chat_template(
            inputs.messages, tools=inputs.tools, tokenize=False, add_generation_prompt=inputs.add_generation_prompt,
            continue_final_message=inputs.continue_final_message, chat_template=server_template, **inputs.variables,
        )
    except jinja2.TemplateError as e:
        raise bad_request(f"messages: the model's chat template rejected the conversation: {e}", "messages") from None
    except (ValueError, TypeError, KeyError) as e:
        raise bad_request(f"messages: cannot apply the chat template: {e}", "messages") from None
    if not isinstance(text, str):
        raise bad_request("messages: the chat template did not produce text", "messages")
    return text
