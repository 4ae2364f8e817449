"""Chat templating and tokenization, done once per request in the gateway.

The model's embedded Jinja template is used where the GGUF has one. The bundled Gemma 3 GGUF has none,
so the Gemma family's own turn format applies (`<start_of_turn>role\\n...<end_of_turn>\\n`, the system
prompt folded into the first user turn, `model` for the assistant) — not a generic ChatML fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import APIError
from gateway.openai_types import Message, text_of
from gateway.piece_tokens import DEFAULT_CACHE_BYTES, PieceTokenizer

GEMMA_TEMPLATE = """\
{%- set ns = namespace(prefix='') -%}
{%- for m in messages -%}
{%- if m.role in ('system', 'developer') and loop.first -%}
{%- set ns.prefix = m.content + '\n\n' -%}
{%- else -%}
{%- set role = 'model' if m.role == 'assistant' else 'user' -%}
<start_of_turn>{{ role }}
{% if role == 'user' and ns.prefix %}{{ ns.prefix }}{% set ns.prefix = '' %}{% endif -%}
{{ m.content | trim }}<end_of_turn>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}
"""

CHATML_TEMPLATE = """\
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}
"""

FAMILY_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


@dataclass
class Prompt:
    text: str | None
    ids: list[int]


class PromptBuilder:
    """Renders chat messages with the model's template and tokenizes with the model's vocabulary."""

    def __init__(self, tokenizer, *, architecture: str, bos_token_id: int | None, add_bos: bool, template: str | None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self._tok = tokenizer
        self._bos = bos_token_id if add_bos else None
        source = template or FAMILY_TEMPLATES.get(architecture, CHATML_TEMPLATE)
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False, keep_trailing_newline=True)
        self._template = env.from_string(source)
        # the template's turn markers split a prompt into pieces tokenized once each (gateway/piece_tokens.py)
        markers = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content in source]
        self.pieces = PieceTokenizer(tokenizer, markers, max_bytes=cache_bytes)
        # an embedded template that takes `tools` gets them as data; others get gateway/tools.py's instructions
        self.native_tools = template is not None and "tools" in template

    def chat(self, messages: list[Message], tools: list[dict] | None = None) -> Prompt:
        rows = [_row(m) if self.native_tools else {"role": m.role, "content": _content(m)} for m in messages]
        try:
            text = self._template.render(messages=rows, tools=tools, add_generation_prompt=True, bos_token="")
        except Exception as e:  # a template error is the request's content meeting the template's rules
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        return Prompt(text, self.encode(text))

    def completion(self, prompt: str | list) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(prompt, self.encode(prompt))
        if prompt and isinstance(prompt[0], str):
            return self.completion(prompt[0])
        if prompt and isinstance(prompt[0], list):
            return self.completion(prompt[0])
        return Prompt(None, list(prompt))

    def encode(self, text: str) -> list[int]:
        ids = self.pieces.encode(text)
        return ([self._bos] + ids) if self._bos is not None else ids

    def encode_plain(self, text: str) -> list[int]:
        return self.pieces.encode(text)


def _row(m: Message) -> dict:
    """A message as an embedded tool-aware template expects it (OpenAI field names)."""
    row = {"role": m.role, "content": text_of(m.content)}
    if m.tool_calls:
        row["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                              "arguments": c.function.arguments}} for c in m.tool_calls]
    if m.tool_call_id:
        row["tool_call_id"] = m.tool_call_id
    return row


def _content(m: Message) -> str:
    text = text_of(m.content)
    if m.role == "tool":  # the same words gateway/tools.py's instructions announce results with
        label = ", ".join(x for x in (m.name, m.tool_call_id) if x)
        return f"Tool result{f' ({label})' if label else ''}:\n{text}"
    if m.tool_calls:
        calls = "\n".join(f'{{"name": "{c.function.name}", "arguments": {c.function.arguments or "{}"}}}' for c in m.tool_calls)
        return (text + "\n" if text else "") + calls
    return text
