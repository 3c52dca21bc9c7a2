"""What the tool-calling tests share: tools, a conversation, and the chat template of the tiny
model that renders tools (conftest's `tools_model`)."""

from __future__ import annotations

FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "forecast", "description": "the weather", "parameters": FORECAST},
    },
    {"type": "function", "function": {"name": "now"}},
]
# A ChatML template that renders tools and calls as Qwen2.5's does (hermes style), for the
# tiny models (their own template knows no tools).
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MESSAGES = [{"role": "user", "content": "Will it rain in Oslo this week?"}]
