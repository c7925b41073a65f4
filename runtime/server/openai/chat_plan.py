"""How a chat request with tools or reasoning is rendered, constrained and read back.

- ``tool_choice`` ``auto``: the tools go into the prompt and the server's
  ``--tool-call-parser`` reads calls out of the answer (400 without one).
- ``required`` or a named function: decoding is constrained by a JSON schema of a call list
  ``[{"name": ..., "parameters": {...}}]`` built from the tools' parameter schemas (as
  SGLang does), so any model, however small, answers with valid calls.
- ``none`` (or no tools): the tools are left out and the answer is plain content.

A chat template that renders tools itself (it names ``tools``) gets them as
``apply_chat_template(tools=...)``; for one that does not (the embedded SmolLM2's), the
tools and the expected call format are put into the system message instead
(``instructions``), and earlier calls are written in that format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvflow.runtime.server.openai.protocol import ChatCompletionRequest, ChatMessage
from kvflow.runtime.server.parsers import (
    ReasoningParser,
    ToolCallItem,
    ToolCallParser,
    make_reasoning_parser,
    make_tool_call_parser,
)
from kvflow.runtime.wire.errors import RequestError

__all__ = ["ChatPlan", "plan_chat"]


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request asks beyond plain text."""

    tools: list[dict[str, Any]]  # OpenAI tool objects to render; [] when none apply
    tool_parser: ToolCallParser | None  # auto: reads calls out of free text
    forced_calls: bool  # required / named: the answer is a JSON call list (constrained)
    reasoning: ReasoningParser | None
    stream_reasoning: bool
    parallel_tool_calls: bool

    @property
    def shapes_output(self) -> bool:
        return self.tool_parser is not None or self.forced_calls or self.reasoning is not None

    def json_schema(self) -> str | None:
        """The constraint of a required/named choice: a list of calls to the given tools."""
        if not self.forced_calls:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": t["function"]["name"]},
                    "parameters": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def render_messages(
        self, messages: list[ChatMessage], template_has_tools: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Messages for the chat template and the extra template arguments (``tools``)."""
        rendered = []
        for message in messages:
            entry: dict[str, Any] = {"role": message.role, "content": content_text(message)}
            # for the template to render or not, as SGLang passes them
            if message.name is not None:
                entry["name"] = message.name
            if message.reasoning_content is not None:
                entry["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                calls = [
                    ToolCallItem(c.function.name, c.function.arguments_text)
                    for c in message.tool_calls
                ]
                if template_has_tools:
                    entry["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {
                                "name": c.function.name,
                                "arguments": _arguments(c.function.arguments_text),
                            },
                        }
                        for c in message.tool_calls
                    ]
                else:
                    text = self._render_calls(calls)
                    entry["content"] = f"{entry['content']}\n{text}" if entry["content"] else text
            if message.role == "tool" and message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            rendered.append(entry)
        if not self.tools:
            return rendered, {}
        if template_has_tools:
            return rendered, {"tools": self.tools}
        prompt = self._instructions()
        if rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
        return rendered, {}

    def _render_calls(self, calls: list[ToolCallItem]) -> str:
        if self.tool_parser is not None:
            return self.tool_parser.render_calls(calls)
        return json.dumps(
            [{"name": c.name, "parameters": json.loads(c.arguments or "{}")} for c in calls]
        )

    def _instructions(self) -> str:
        if self.tool_parser is not None:
            return self.tool_parser.instructions(self.tools)
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        return (
            f"You can call these functions (JSON schemas):\n{listed}\n\n"
            'Answer with a JSON list of calls: [{"name": <function-name>, '
            '"parameters": <arguments-json-object>}]'
        )


def content_text(message: ChatMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise RequestError(
                400, f"message content of type {part.get('type')!r} is not supported"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RequestError(400, f"tool call arguments are not JSON: {err}") from err


def plan_chat(
    body: ChatCompletionRequest, tool_parser_name: str | None, reasoning_parser_name: str | None
) -> ChatPlan:
    """Check ``tools``/``tool_choice`` against each other and the server's parsers."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise RequestError(400, "tool_choice needs tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if not isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if choice.function.name not in names:
            raise RequestError(
                400, f"tool_choice names {choice.function.name!r}, which is not among the tools"
            )
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
    if choice == "none":
        tools = []
    tool_parser = None
    if choice == "auto":
        if tool_parser_name is None:
            raise RequestError(
                400,
                "tools with tool_choice 'auto' need a server started with --tool-call-parser "
                "(or give tool_choice 'required' or a function: constrained calls need no parser)",
            )
        tool_parser = make_tool_call_parser(tool_parser_name)
    reasoning = None
    if reasoning_parser_name is not None and body.separate_reasoning:
        reasoning = make_reasoning_parser(reasoning_parser_name)
    return ChatPlan(
        tools=tools,
        tool_parser=tool_parser,
        forced_calls=choice not in ("auto", "none"),
        reasoning=reasoning,
        stream_reasoning=body.stream_reasoning,
        parallel_tool_calls=body.parallel_tool_calls and isinstance(choice, str),
    )
