"""Chat templates we ship for packaged models (engine/packaged.py), written here.

``SMOLLM2_TOOLS``: SmolLM2-Instruct's ChatML, with tools. Without ``tools`` it renders exactly as the model's own
template. With ``tools``, the system turn lists each tool's JSON schema and the call format envs/tools.py reads
("hermes": ``{"name", "arguments"}`` between ``<tool_call>`` tags); an assistant's ``tool_calls`` are shown in that
format, and a ``tool`` message comes back as a user turn holding a ``<tool_response>`` block. Every message renders
on its own, so a longer conversation renders as the shorter one followed by the new turns (envs/trajectory.py
extends trajectories token by token on that).
"""

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SMOLLM2_TOOLS = r"""
{%- set given_system = messages and messages[0]['role'] == 'system' -%}
{%- if given_system or tools -%}
{{- '<|im_start|>system\n' + (messages[0]['content'] if given_system else '""" + SMOLLM2_DEFAULT_SYSTEM + r"""') -}}
{%- if tools -%}
{{- '\n\nYou can call functions to help with the request. Each one is described by a JSON schema:\n<tools>' -}}
{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor -%}
{{- '\n</tools>\nTo call one, reply with a JSON object naming it and giving its arguments, between tags:\n'
    + '<tool_call>\n{"name": "<function name>", "arguments": {"<argument>": <value>}}\n</tool_call>\n'
    + 'Each result is returned to you between <tool_response> and </tool_response>.' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' and not tools -%}
{{- '<|im_start|>system\n""" + SMOLLM2_DEFAULT_SYSTEM + r"""<|im_end|>\n' -}}
{%- endif -%}
{%- if loop.first and given_system -%}
{%- elif message['role'] == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' -}}
{%- elif message['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' + (message['content'] or '') -}}
{%- for call in (message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else []) -%}
{%- set function = call['function'] if call['function'] is defined else call -%}
{%- set arguments = function['arguments'] if function['arguments'] is string else (function['arguments'] | tojson) -%}
{{- ('\n' if loop.first and message['content'] else '') + '<tool_call>\n{"name": ' + (function['name'] | tojson)
    + ', "arguments": ' + arguments + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()
