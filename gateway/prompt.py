"""Chat templating and tokenization, done once per request in the gateway.

The model's embedded Jinja template is used where the GGUF has one (rendered as Hugging Face renders it:
a sandboxed environment, trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, `add_generation_prompt`,
`tools`). The bundled Gemma 3 GGUF has none, so the Gemma family's own turn format applies
(`<start_of_turn>role\\n...<end_of_turn>\\n`, the system prompt folded into the first user turn, `model` for
the assistant) — not a generic ChatML fallback.

Message text is always text: control tokens come only from the template. Each message's text is rendered
between two Unicode noncharacters, so after rendering the prompt splits into template text (cut at the
template's own control tokens) and message text, and a run between two control tokens is tokenized with
special tokens off (`encode_special_tokens`). User text spelling `<end_of_turn>` stays those characters.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import APIError
from gateway.openai_types import Message, text_of
from gateway.piece_tokens import DEFAULT_CACHE_BYTES, PieceTokenizer, _pipeline_is_piece_local
from workers.protocol.model import release_freed_heap

# Noncharacters (never in interchanged text) that mark where message text sits in a rendered prompt.
OPEN, CLOSE = "\ufdd0", "\ufdd1"
_MARKED = re.compile(f"{OPEN}(.*?){CLOSE}", re.S)

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


def _gemma_turns(rows: list[dict]) -> str:
    """GEMMA_TEMPLATE with add_generation_prompt, in plain Python: the same text for any rows (tests/unit/
    test_chat_template.py renders both). Pulse's own formats render a request's prompt here because Jinja's fixed
    cost a render (its context, the sandbox's attribute checks) was ~25 µs of the gateway's ~0.8 ms a short request
    on the 2-core box (2026-12-07); a model's embedded template still renders in the sandbox."""
    out, prefix = [], ""
    for i, m in enumerate(rows):
        role, content = m["role"], m["content"]
        if i == 0 and role in ("system", "developer"):
            prefix = content + "\n\n"
            continue
        role = "model" if role == "assistant" else "user"
        out.append(f"<start_of_turn>{role}\n")
        if role == "user" and prefix:
            out.append(prefix)
            prefix = ""
        out.append(content.strip() + "<end_of_turn>\n")
    out.append("<start_of_turn>model\n")
    return "".join(out)


def _chatml_turns(rows: list[dict]) -> str:
    """CHATML_TEMPLATE with add_generation_prompt, in plain Python (see _gemma_turns)."""
    turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in rows]
    return "".join(turns) + "<|im_start|>assistant\n"


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
        # Pulse's own formats in Python (no tools: gateway/tools.py's instructions come as message text)
        self._turns = None if template else (_gemma_turns if source is GEMMA_TEMPLATE else _chatml_turns)
        try:
            self._template = _environment(embedded=template is not None).from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from None
        # the template's control tokens: where a rendered prompt is cut (gateway/piece_tokens.py)
        markers = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()
                          if t.special and t.content in source), key=len, reverse=True)
        self._marker_ids = {m: tokenizer.token_to_id(m) for m in markers}
        self._markers = re.compile("(" + "|".join(map(re.escape, markers)) + ")") if markers else None
        self.pieces = PieceTokenizer(tokenizer, markers, max_bytes=cache_bytes)  # raw prompts (/v1/completions)
        # message text between two control tokens: tokenized with special tokens off, cached by its text
        self.text_pieces = PieceTokenizer(_text_mode(tokenizer), [], max_bytes=cache_bytes)
        self._runs_are_local = _pipeline_is_piece_local(tokenizer)
        self._embedded = template is not None
        # an embedded template that takes `tools` gets them as data; others get gateway/tools.py's instructions
        self.native_tools = template is not None and "tools" in template

    def chat(self, messages: list[Message], tools: list[dict] | None = None) -> Prompt:
        rows = [_row(m) if self.native_tools else {"role": m.role, "content": _content(m)} for m in messages]
        if self._embedded:  # templates written before OpenAI's `developer` role know it as `system`
            rows = [{**r, "role": "system"} if r["role"] == "developer" else r for r in rows]
        for i, row in enumerate(rows):
            if OPEN in row["content"] or CLOSE in row["content"]:
                raise APIError(400, "message content holds the Unicode noncharacters U+FDD0/U+FDD1",
                               param=f"messages[{i}].content")
        marked = self._render([{**r, "content": _mark(r["content"])} for r in rows], tools)
        parts = _MARKED.split(marked)  # even: template text, odd: message text
        text = "".join(parts)
        if not self._runs_are_local or any(OPEN in p or CLOSE in p for p in parts[::2]):
            # the template reshaped message text (sliced or escaped it), or the tokenizer's pipeline depends
            # on a piece's place in the whole text: tokenize the whole prompt, refusing text that would
            # turn into control tokens
            text = self._render(rows, tools)
            self._refuse_control_text(rows, tools, text)
            return Prompt(text, self.encode(text))
        ids = [] if self._bos is None else [self._bos]
        for run in self._runs(parts):
            if isinstance(run, int):
                ids.append(run)
            elif run:
                ids.extend(self.text_pieces.piece(run))
        return Prompt(text, ids)

    def _render(self, rows: list[dict], tools: list[dict] | None) -> str:
        if self._turns is not None:
            return self._turns(rows)
        try:
            return self._template.render(messages=rows, tools=tools, add_generation_prompt=True, bos_token="",
                                         eos_token="")
        except Exception as e:  # a template error is the request's content meeting the template's rules
            raise APIError(400, f"the chat template rejected these messages: {type(e).__name__}: {e}",
                           param="messages", code="chat_template_error") from None

    def _runs(self, parts: list[str]) -> list[str | int]:
        """Control-token ids (from template text only) and the text runs between them."""
        out: list[str | int] = []
        run: list[str] = []
        for i, part in enumerate(parts):
            pieces = [part] if i % 2 or self._markers is None else self._markers.split(part)
            for j, piece in enumerate(pieces):
                if j % 2:  # re.split with one group: text, marker, text, ...
                    out.append("".join(run))
                    out.append(self._marker_ids[piece])
                    run = []
                else:
                    run.append(piece)
        out.append("".join(run))
        return out

    def _refuse_control_text(self, rows: list[dict], tools: list[dict] | None, text: str) -> None:
        """400 when `text` holds more control tokens than the template makes for the same turns with neutral text."""
        if self._markers is None:
            return
        neutral = self._render([{**r, "content": "x"} for r in rows], tools)
        extra = Counter(self._markers.findall(text)) - Counter(self._markers.findall(neutral))
        if extra:
            raise APIError(400, f"message text spells the control token {next(iter(extra))!r}, which this "
                           "model's template and tokenizer cannot keep as text", param="messages")

    def completion(self, prompt: str | list) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(prompt, self.encode(prompt))
        if prompt and isinstance(prompt[0], str):
            return self.completion(prompt[0])
        if prompt and isinstance(prompt[0], list):
            return self.completion(prompt[0])
        return Prompt(None, list(prompt))

    def encode(self, text: str) -> list[int]:
        """A raw prompt (the client wrote the whole text, control tokens included)."""
        ids = self.pieces.encode(text)
        return ([self._bos] + ids) if self._bos is not None else ids

    def encode_plain(self, text: str) -> list[int]:
        return self.pieces.encode(text)


@lru_cache(maxsize=8)
def _text_mode(tokenizer):
    """A copy of `tokenizer` that reads special-token spellings as plain text (a copy: the flag is the
    tokenizer's, and other threads tokenize raw prompts with the original). ~4 s for Gemma's 262k entries."""
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    release_freed_heap()  # the JSON text and its parse: ~300 MiB for Gemma's, freed but kept by the process
    return copy


def _environment(*, embedded: bool) -> ImmutableSandboxedEnvironment:
    """The sandbox a template renders in. Embedded templates are written for Hugging Face's renderer
    (trim_blocks, lstrip_blocks, raise_exception, tojson that keeps non-ASCII); the family formats here
    spell out every newline themselves."""
    env = ImmutableSandboxedEnvironment(trim_blocks=embedded, lstrip_blocks=embedded, keep_trailing_newline=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise TemplateError(message)


def _mark(text: str) -> str:
    """Message text between the marks, its outer whitespace outside them, so a template that trims the
    text trims the same characters it would without the marks."""
    core = text.strip()
    if not core:
        return text
    lead = text[: len(text) - len(text.lstrip())]
    return lead + OPEN + core + CLOSE + text[len(lead) + len(core):]


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
