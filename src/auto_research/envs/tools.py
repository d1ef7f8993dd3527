"""Tools: plain Python functions the model may call. A tool's type hints and docstring give the JSON schema passed
to the chat template's ``tools=`` (transformers' ``get_json_schema``); a call is parsed from the model's reply in
the format its template teaches, and answered as a ``tool`` message (an error too, which the model sees).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from auto_research.engine.packaged import with_tools
from auto_research.envs.deadline import CallTimeout, ToolTimeout, bounded
from auto_research.errors import RewardError, UserError
from auto_research.user_code import load_user_object

SENTINEL_TOOL = "auto_research_probe_tool"


def tool_schema(function: Callable, where: str = "--tools") -> dict:
    """The JSON schema of one tool, or one line saying what it lacks."""
    from transformers.utils import get_json_schema  # noqa: PLC0415

    try:
        return get_json_schema(function)
    except Exception as error:  # noqa: BLE001 - transformers' TypeHintParsingException, DocstringParsingException
        raise UserError(f"{where}: tool {getattr(function, '__name__', function)!r} cannot be described to the "
                        f"model: {error}") from None


def load_tools(spec: str | None) -> dict[str, Callable]:
    """``--tools module:fn,module:fn`` → {name: function}, each with a schema (checked now)."""
    tools: dict[str, Callable] = {}
    for item in [part.strip() for part in (spec or "").split(",") if part.strip()]:
        function = load_user_object(item, "--tools", "a tool: a function with type hints and a docstring")
        tool_schema(function)
        tools[function.__name__] = function
    return tools


def check_template_takes_tools(tokenizer, schemas: list[dict], model_name: str) -> None:
    """A chat template that ignores ``tools=`` would hide them from the model: refused in one line."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError(f"--tools: {model_name}'s tokenizer has no chat template, so the model cannot be shown tools")
    probe = {"type": "function", "function": {"name": SENTINEL_TOOL, "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe] + schemas,
                                             add_generation_prompt=True, tokenize=False)
    if SENTINEL_TOOL not in rendered:
        variant = with_tools(model_name)
        raise UserError(f"--tools: {model_name}'s chat template has no tool support (it does not show the tools "
                        "passed to it); " + (f"--model {variant} is the same weights with a template that does"
                                             if variant else "use a model whose template takes tools="))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def call_format(tokenizer) -> str:
    """hermes (``<tool_call>{json}</tool_call>``: Qwen, Hermes, SmolLM3…), mistral (``[TOOL_CALLS] [...]``), or
    json (a bare ``{"name", "arguments"|"parameters"}`` object: Llama 3), read from the template's text."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return "json"


def _as_call(value) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some formats carry the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


def parse_calls(text: str, form: str) -> tuple[list[ToolCall], int]:
    """The tool calls in a reply, and how many call-shaped blocks could not be read (each a tool error)."""
    if form == "hermes":
        blocks = _HERMES.findall(text)
    elif form == "mistral":
        _, marker, rest = text.partition("[TOOL_CALLS]")
        blocks = [rest.strip()] if marker else []
    else:
        start = text.find("{")
        blocks = [text[start: text.rfind("}") + 1]] if start >= 0 and '"name"' in text else []
    items, broken = [], 0
    for block in blocks:
        try:
            value = json.loads(block)
        except ValueError:
            broken += 1
            continue
        items += value if isinstance(value, list) else [value]
    calls = [call for call in map(_as_call, items) if call is not None]
    return calls, broken + len(items) - len(calls)


_KINDS = {  # a JSON schema type → its name in a message, and whether a JSON value is one (a bool is no number)
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "string": ("a string", lambda v: isinstance(v, str)), "boolean": ("true or false", lambda v: isinstance(v, bool)),
    "array": ("a list", lambda v: isinstance(v, list)), "object": ("an object", lambda v: isinstance(v, dict)),
    "null": ("null", lambda v: v is None),
}


def value_problem(value, schema: dict, where: str) -> str | None:
    """What is wrong with ``value`` for a parameter's schema (its type, enum, a list's items), or None."""
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if value is None and schema.get("nullable"):
        return None
    if kinds and not any(kind not in _KINDS or _KINDS[kind][1](value) for kind in kinds):
        wanted = " or ".join(_KINDS[kind][0] if kind in _KINDS else kind for kind in kinds)
        return f"{where} must be {wanted}, got {json.dumps(value)[:60]}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])[:80]}, got {json.dumps(value)[:60]}"
    if isinstance(value, list):
        positional = schema.get("prefixItems") or []
        for index, item in enumerate(value):
            item_schema = positional[index] if index < len(positional) else schema.get("items") or {}
            problem = value_problem(item, item_schema, f"{where}[{index}]")
            if problem is not None:
                return problem
    return None


def arguments_problem(arguments: dict, schema: dict) -> str | None:
    """What is wrong with a call's arguments for its tool's schema (names, required ones, types), or None."""
    parameters = schema.get("function", {}).get("parameters", {})
    properties = parameters.get("properties", {})
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument {unknown[0]!r} (arguments: {', '.join(properties) or 'none'})"
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument {missing[0]!r}"
    for name, value in arguments.items():
        problem = value_problem(value, properties[name], f"argument {name!r}")
        if problem is not None:
            return problem
    return None


def answer(call: ToolCall, tools: dict[str, Callable], schemas: dict[str, dict] | None = None,
           timeout: float = 0.0, worker=None) -> tuple[str, bool]:
    """The tool's answer as text, and whether it was an error (an unknown tool, arguments that do not fit its
    schema, so the call is not made, or a raise). One past ``timeout`` seconds raises ``ToolTimeout`` (its sample
    fails); ``worker``: the trajectory's thread, where the call runs."""
    function = tools.get(call.name)
    if function is None:
        return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})", True
    schema = (schemas or {}).get(call.name)
    problem = arguments_problem(call.arguments, schema) if schema is not None else None
    if problem is not None:
        return f"error: {call.name}: {problem}", True
    try:
        result = bounded(lambda: function(**call.arguments), timeout, ToolTimeout, f"tool {call.name}", worker)
    except (CallTimeout, RewardError):
        raise
    except Exception as error:  # noqa: BLE001 - the model sees its tool's error and may try again
        text = str(error).strip().splitlines()
        return f"error: {type(error).__name__}: {text[0] if text else ''}".rstrip(": "), True
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False
