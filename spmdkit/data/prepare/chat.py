"""Conversations as training documents: a `messages` list rendered with the model's own chat template, tokenized,
and a per-token mask of the tokens the loss scores (the assistant turns).

The template is the model directory's `chat_template.jinja`, else the `chat_template` of its
`tokenizer_config.json` (`--chat-template FILE` overrides both). It is rendered as transformers renders it, with
jinja2 in a sandbox (`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`, loop controls) and the names
templates use: `raise_exception(message)`, the `tojson` filter (no HTML escaping), `strftime_now(format)`, the
`{% generation %}` block, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables; keys whose
value is None are dropped from messages and a message's reasoning is passed under each of its names
(`reasoning_content`, `thinking`), as transformers does. The text is tokenized as it is (the template writes BOS
itself; special tokens in it are the special ids). A template error (`raise_exception`, e.g. a role the template
rejects) is a bad record with the template's message.

Which tokens are scored (`mask[t] = 1`: token t is a target the loss counts):

- a template with `{% generation %}` blocks: every token overlapping a block's characters (transformers'
  `return_assistant_tokens_mask`, the same rule);
- otherwise the span rule: for each assistant message whose `content` is a string, the characters the template
  rendered for that (non-empty) content, through the first special token after it (the end of the turn: `<|eot_id|>`,
  `<|im_end|>`, `<end_of_turn>`; what the template writes between the two, e.g. Qwen's `<tool_call>` text, is
  scored too), every token overlapping them. Where the content lies is found by rendering the conversation once
  more with each assistant content replaced by a private-use marker: the text between markers is the template's
  own, found again in the real rendering. An assistant message whose content the template does not render (e.g.
  Llama 3's tool-call turns), or that is empty, is not scored (counted: `unscored_turns`); a template whose own text
  depends on the content beyond where it is written (Qwen 3 splitting a `</think>` inside the content into its
  reasoning block) cannot be aligned: a bad record saying so (give the reasoning as `reasoning_content`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from spmdkit.data.tokenizer import Tokenizer
from spmdkit.data.tokenizer.tokenizer import CONFIG_FILE, config_token, first_line
from spmdkit.errors import SpmdkitError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARKER = re.compile("\ue000(\\d+)\ue001")


class ChatError(ValueError):
    """A conversation that cannot be rendered (the template's own error, or one it cannot be aligned with)."""


def load_chat_template(tokenizer_dir: str | Path | None, override: str | None = None) -> str:
    """The chat template: `override` (a file), else `tokenizer_dir`'s `chat_template.jinja`, else the
    `chat_template` of its `tokenizer_config.json` (a string, or the list of named templates: "default")."""
    if override:
        try:
            return Path(override).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise SpmdkitError(f"--chat-template {override}: cannot read it ({first_line(error)})") from None
    directory = Path(tokenizer_dir) if tokenizer_dir else None
    if directory is not None and directory.is_file():
        directory = directory.parent
    if directory is not None and (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    config = _read_config(directory / CONFIG_FILE) if directory is not None else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) or not template.strip():
        raise SpmdkitError(
            f"the tokenizer {tokenizer_dir} has no chat template (no {TEMPLATE_FILE}, no chat_template in "
            f"{CONFIG_FILE}): pass --chat-template FILE"
        )
    return template


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _environment() -> Any:
    """A sandboxed jinja2 environment with what chat templates need (see the module docstring)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the (start, end) characters of what it renders in
        `environment.generation_spans` (a list while a render tracks them)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            tracker = self.environment.generation_tracker
            if tracker is not None:
                start = sum(len(block) for block in tracker[0])
                tracker[1].append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.generation_tracker = None
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def special_token_text(config: dict[str, Any] | None) -> dict[str, str]:
    """The special tokens a template may name (`bos_token`, ...), as text, from `tokenizer_config.json`."""
    tokens = {name: config_token((config or {}).get(name)) for name in SPECIAL_NAMES}
    return {name: token for name, token in tokens.items() if isinstance(token, str)}


class ChatRenderer:
    """Renders and tokenizes conversations with one template and tokenizer (`encode`); one process, one thread."""

    def __init__(self, template: str, tokenizer: Tokenizer):
        import jinja2
        import tokenizers

        self.source, self.environment = template, _environment()
        try:
            self.template = self.environment.from_string(template)
        except jinja2.TemplateError as error:
            raise SpmdkitError(f"the chat template does not parse ({first_line(error)})") from None
        self.has_generation = bool(_GENERATION.search(template))
        self.variables = special_token_text(tokenizer.config)
        # special tokens in the rendered text are the special ids (as transformers tokenizes a chat)
        self.hf = tokenizers.Tokenizer.from_str(tokenizer.json_text)
        self.hf.no_truncation()
        self.hf.no_padding()
        self.specials = sorted(tokenizer.special_ids, key=len, reverse=True)
        self.unscored_turns = 0

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, track: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered text, the `{% generation %}` spans when `track`)."""
        import jinja2

        spans: list[tuple[int, int]] = []
        blocks: list[str] = []
        self.environment.generation_tracker = (blocks, spans) if track else None
        try:
            kwargs = dict(
                self.variables, messages=_alias_reasoning(messages), add_generation_prompt=add_generation_prompt
            )
            kwargs |= {"tools": None, "documents": None}  # as transformers passes them
            for block in self.template.generate(**kwargs):
                blocks.append(block)
        except jinja2.TemplateError as error:
            raise ChatError(f"the chat template refuses it: {first_line(error)}") from None
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as error:
            raise ChatError(f"the chat template fails on it ({type(error).__name__}: {first_line(error)})") from None
        finally:
            self.environment.generation_tracker = None
        return "".join(blocks), spans

    def encode(self, messages: list[dict[str, Any]]) -> tuple[str, np.ndarray, np.ndarray]:
        """(rendered text, token ids int64 [n], mask uint8 [n]: 1 at the tokens the loss scores)."""
        text, spans = self.render(messages, track=self.has_generation)
        if not self.has_generation:
            spans = self._content_spans(messages, text)
        encoding = self.hf.encode(text, add_special_tokens=False)
        return text, np.asarray(encoding.ids, np.int64), overlap_mask(encoding.offsets, spans)

    def _content_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """The span rule of the module docstring: [start, end) characters of each assistant turn in `text`."""
        marked = [
            dict(m, content=f"\ue000{i}\ue001") if m.get("role") == "assistant" and _text(m.get("content")) else m
            for i, m in enumerate(messages)
        ]  # fmt: skip
        parts = _MARKER.split(self.render(marked)[0])  # [text, index, text, index, ..., text]
        found = {int(i) for i in parts[1::2]}
        self.unscored_turns += sum(1 for i, m in enumerate(messages) if m.get("role") == "assistant" and i not in found)
        spans, pos = [], 0
        for k in range(0, len(parts) - 1, 2):
            own, following = parts[k], parts[k + 2]
            if not text.startswith(own, pos):
                raise ChatError(
                    "the chat template rewrites the text around an assistant message, so its content cannot be "
                    "located: use a template with {% generation %} blocks (--chat-template) or plain contents"
                )
            pos += len(own)
            end = text.find(following, pos) if following else len(text)
            if end < 0:
                raise ChatError("the chat template rewrites an assistant message's content beyond finding it again")
            spans.append((pos, end + self._end_of_turn(following)))
            pos = end
        return spans

    def end_of_turn_ids(self) -> list[int]:
        """The token ids of the special token that ends an assistant turn (`<|eot_id|>`, `<|im_end|>`,
        `<end_of_turn>`): the first one the template writes after an assistant's content; [] when there is none."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\ue000"}]
        try:
            text = self.render(probe)[0]
        except ChatError:
            return []
        following = text[text.rfind("\ue000") + 1 :]
        end = self._end_of_turn(following)
        token = next((s for s in self.specials if following[:end].endswith(s)), None) if end else None
        return self.hf.encode(token, add_special_tokens=False).ids if token else []

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of `messages` rendered with the generation prompt (what the model continues)."""
        return self.hf.encode(self.render(messages, add_generation_prompt=True)[0], add_special_tokens=False).ids

    def _end_of_turn(self, following: str) -> int:
        """Characters of `following` (the template's text after a content) through its first special token."""
        hits = [(following.find(s), s) for s in self.specials if s in following]
        if not hits:
            return 0
        at, token = min(hits, key=lambda h: (h[0], -len(h[1])))
        return at + len(token)


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning comes under


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under every name templates read (`reasoning_content`; gpt-oss: `thinking`), as
    transformers passes it."""
    out = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _text(content: Any) -> bool:
    return isinstance(content, str) and bool(content)


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [tokens]: 1 for each token whose characters `offsets` overlap one of `spans` (both in order)."""
    mask = np.zeros(len(offsets), np.uint8)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def check_messages(value: Any, key: str) -> list[dict[str, Any]] | str:
    """A row's `key` value as messages (dicts with a string `role`; keys whose value is None dropped, as
    transformers does), or why it is not."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return f"{key!r} holds text, not a list of messages"
    if not isinstance(value, list | tuple) or not value:
        return f"{key!r} holds {type(value).__name__ if value else 'nothing'}, not a list of messages"
    messages = []
    for n, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"message {n} of {key!r} is not an object with a string 'role'"
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def chat_tokens(
    renderer: ChatRenderer, conversations: Iterator[tuple[str, list[dict[str, Any]]]], max_tokens: int, overflow: str,
    counts: dict[str, int],
) -> Iterator[tuple[str, str, np.ndarray, np.ndarray] | tuple[str, ChatError]]:  # fmt: skip
    """(name, text, ids, mask) of each conversation, cut to `max_tokens` or dropped (`overflow`); `counts` gets
    `truncated`, `dropped` (too long) and `unscored` (no assistant token left: dropped). A conversation the template
    refuses is (name, ChatError)."""
    for name, messages in conversations:
        try:
            text, ids, mask = renderer.encode(messages)
        except ChatError as error:
            yield name, error
            continue
        if max_tokens and len(ids) > max_tokens:
            if overflow == "drop":
                counts["dropped"] += 1
                continue
            ids, mask = ids[:max_tokens], mask[:max_tokens]
            counts["truncated"] += 1
        if not mask[1:].any():  # the first token is no target
            counts["unscored"] += 1
            continue
        yield name, text, ids, mask
