"""A local model folder's own chat template and special tokens, as countable text pieces.

Hugging Face tokenizers split text at every added token before running their model on the
pieces in between; :class:`SpecialSplitter` does the same with the added tokens of a folder's
``tokenizer.json``, so ``sum(count(piece)) + num_special`` equals the length of
``tokenizer(text, add_special_tokens=False)`` for the processors' expanded placeholder strings
(:mod:`~balancer_cli.scan.rules.hf`) and for a rendered chat template.
:func:`render_hf_template` renders the folder's template (``chat_template.jinja``,
``chat_template.json`` or ``tokenizer_config.json``'s ``chat_template``) with jinja2 as
``apply_chat_template`` does (sandboxed, ``trim_blocks``, ``lstrip_blocks``), in training form
(no generation prompt), from the scan's turns; media parts become ``{"type": kind}`` content.

Example:
    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [
    ...     {"id": 0, "content": "<|im_start|>", "special": True}, {"id": 1, "content": "<|im_end|>", "special": True},
    ...     {"id": 2, "content": "<|image_pad|>", "special": True}]}))
    >>> _ = (d / "chat_template.jinja").write_text(
    ...     "{% for m in messages %}<|im_start|>{{ m.role }}\\n{% for c in m.content %}"
    ...     "{% if c.type == 'image' %}<|image_pad|>{% else %}{{ c.text }}{% endif %}{% endfor %}<|im_end|>\\n{% endfor %}")
    >>> render_hf_template(str(d), [("user", ["Hi ", Part("image")])], {"<|image_pad|>": "image"})
    (['user\\nHi ', '\\n'], 2, ['image'])
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from balancer_cli.errors import InputError

__all__ = ["DEFAULT_PLACEHOLDERS", "Part", "SpecialSplitter", "load_chat_template", "render_hf_template",
           "special_splitter"]


@dataclass(frozen=True)
class Part:
    """A bare media part of a turn (any object with a ``kind`` works)."""

    kind: str


class SpecialSplitter:
    """Splits text at a tokenizer's added tokens (longest first, as the tokenizers library does)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = tuple(sorted(set(tokens), key=len, reverse=True))
        self._pattern = re.compile("(" + "|".join(re.escape(t) for t in self.tokens) + ")") if self.tokens else None

    def split(self, text: str) -> tuple[list[str], list[str]]:
        """``(text pieces, special tokens in order)`` of ``text``.

        Example:
            >>> SpecialSplitter(["<a>", "<ab>"]).split("x<ab>y<a>")
            (['x', 'y'], ['<ab>', '<a>'])
        """
        if self._pattern is None:
            return ([text] if text else []), []
        parts = self._pattern.split(text)
        return [p for p in parts[0::2] if p], parts[1::2]

    def count(self, text: str, tokenizer: object) -> int:
        """Tokens of ``text``: its pieces counted by ``tokenizer.count_batch``, plus one per added token."""
        pieces, specials = self.split(text)
        return sum(tokenizer.count_batch(pieces)) + len(specials)


def _added_tokens(folder: Path) -> list[str]:
    path = folder / "tokenizer.json" if folder.is_dir() else folder
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read the tokenizer's added tokens ({exc})",
                         fix="pass a model folder holding tokenizer.json") from None
    return [t["content"] for t in data.get("added_tokens", []) if isinstance(t, dict) and t.get("content")]


@functools.lru_cache(maxsize=8)
def special_splitter(folder: str) -> SpecialSplitter:
    """The :class:`SpecialSplitter` of a folder's ``tokenizer.json`` (cached per process)."""
    return SpecialSplitter(_added_tokens(Path(folder)))


@functools.lru_cache(maxsize=8)
def load_chat_template(folder: str) -> str:
    """The chat template of a local model folder (``chat_template.jinja`` first, as transformers 5).

    Raises:
        InputError: the folder has no chat template.
    """
    base = Path(folder)
    if (base / "chat_template.jinja").is_file():
        return (base / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        path = base / name
        if path.is_file():
            try:
                template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
            except (UnicodeDecodeError, json.JSONDecodeError):
                template = None
            if isinstance(template, list):  # named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                return template
    raise InputError(f"{folder}: no chat template (chat_template.jinja, chat_template.json or "
                     "tokenizer_config.json's chat_template)", fix="pass --template NAME, or add the model's template")


@functools.lru_cache(maxsize=8)
def _compiled(folder: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InputError(f"{folder}: chat template error: {message}",
                         fix="check the record's messages against the template, or pass --template NAME")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(load_chat_template(folder))


@functools.lru_cache(maxsize=8)
def _special_names(folder: str) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` strings of the folder's tokenizer config (templates write them)."""
    names = {"bos_token": "", "eos_token": ""}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        for key in names:
            value = data.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                names[key] = value
    return names


def _messages(turns: Sequence[tuple[str, Sequence[object]]]) -> list[dict]:
    messages = []
    for role, parts in turns:
        content = []
        for part in parts:
            if isinstance(part, str):
                if content and content[-1]["type"] == "text":
                    content[-1]["text"] += part
                else:
                    content.append({"type": "text", "text": part})
            else:
                kind = getattr(part, "kind", "image")
                content.append({"type": kind, kind: ""})
        messages.append({"role": role, "content": content})
    return messages


#: Placeholder tokens the processors of the families the scan knows replace, by media kind.
DEFAULT_PLACEHOLDERS = {
    "<|image_pad|>": "image", "<|video_pad|>": "video", "<|image|>": "image", "<|video|>": "video",
    "<start_of_image>": "image", "[IMG]": "image", "<|IMAGE|>": "image", "<|VIDEO|>": "video",
    "<|AUDIO|>": "audio", "<image>": "image", "<video>": "video", "<audio>": "audio",
}


def render_hf_template(folder: str, turns: Sequence[tuple[str, Sequence[object]]],
                       placeholders: Mapping[str, str] | None = None) -> tuple[list[str], int, list[str]]:
    """``(text pieces, special tokens, media kinds in order)`` of the folder's template over ``turns``.

    ``placeholders`` maps each processor placeholder token (``<|image_pad|>``) to its media kind
    (default :data:`DEFAULT_PLACEHOLDERS`); those tokens are reported in ``media`` rather than
    counted, since the vision rule's ``llm_tokens`` replace them.
    """
    placeholders = DEFAULT_PLACEHOLDERS if placeholders is None else placeholders
    text = _compiled(folder).render(messages=_messages(turns), add_generation_prompt=False,
                                    **_special_names(folder))
    pieces, specials = special_splitter(folder).split(text)
    media = [placeholders[s] for s in specials if s in placeholders]
    return pieces, len(specials) - len(media), media
