"""Chat templates as token-count renderers: what the model's chat template adds around the text.

A template turns a sample's turns into a :class:`Rendered`: the plain-text pieces the tokenizer
must count (split at special tokens, exactly as Hugging Face tokenizers split text on added tokens),
the number of special tokens written, and the media placeholders in order. The sample's LLM length
is then ``sum(count(piece)) + num_special + sum(media.llm_tokens)``: each placeholder (Qwen2-VL's
``<|image_pad|>``, InternVL's ``<IMG_CONTEXT>`` run, LLaVA's ``<image>``) is replaced by the tokens
the vision rule says the processor expands it into (:class:`~balancer_cli.scan.rules.base.MediaCount`).

Templates (training form: every turn rendered, no generation prompt):

- ``qwen2-vl``: the released Qwen2-VL / Qwen2.5-VL template: ``<|im_start|>system\\nYou are a
  helpful assistant.<|im_end|>\\n`` unless the sample has a system turn, then
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn, images as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (videos ``<|video_pad|>``).
- ``internvl``: InternVL2.5's chatml (``internvl2_5``) with its default system prompt; images as the
  processor's ``<img><IMG_CONTEXT>...</img>`` run (all inside the rule's count).
- ``vicuna``: LLaVA-1.5 / LLaVA-NeXT ``conv_vicuna_v1``: ``<s>`` + system + `` USER: ... ASSISTANT:
  ...</s>``.
- ``llava-onevision``: chatml with ``You are a helpful assistant.``; images as ``<image>`` + ``\\n``.
- ``idefics3``: Idefics3 / SmolVLM: ``<|begin_of_text|>User:...<end_of_utterance>\\nAssistant:...``.
- ``plain``: text and media only, no role or turn tokens.

Example:
    >>> r = render("qwen2-vl", [("user", ["Hi ", MEDIA_IMAGE]), ("assistant", ["Yo"])])
    >>> r.pieces, r.num_special, r.media
    (['system\\nYou are a helpful assistant.', '\\n', 'user\\nHi ', '\\n', 'assistant\\nYo', '\\n'], 8, ['image'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from balancer_cli.errors import UsageError

__all__ = [
    "DEFAULT_TEMPLATE",
    "MEDIA_AUDIO",
    "MEDIA_IMAGE",
    "MEDIA_VIDEO",
    "TEMPLATES",
    "Marker",
    "Rendered",
    "check_template",
    "render",
]


@dataclass(frozen=True)
class Marker:
    """A bare media part (the scan's own media objects also carry a ``kind``)."""

    kind: str


MEDIA_IMAGE, MEDIA_VIDEO, MEDIA_AUDIO = Marker("image"), Marker("video"), Marker("audio")

_QWEN_SYSTEM = "You are a helpful assistant."
_INTERNVL_SYSTEM = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的"
                    "多模态大语言模型。")
_VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. The assistant "
                  "gives helpful, detailed, and polite answers to the human's questions.")

#: The model preset -> the template its released checkpoints use.
DEFAULT_TEMPLATE = {
    "qwen2-vl": "qwen2-vl", "qwen2.5-vl": "qwen2-vl", "internvl": "internvl", "llava-1.5": "vicuna",
    "llava-next": "vicuna", "llava-onevision": "llava-onevision", "idefics3": "idefics3", "smolvlm": "idefics3",
}


@dataclass
class Rendered:
    """A rendered sample: text pieces to count, special tokens written, media placeholders in order."""

    pieces: list[str] = field(default_factory=list)
    num_special: int = 0
    media: list[str] = field(default_factory=list)
    _text: list[str] = field(default_factory=list, repr=False)

    def text(self, value: str) -> None:
        self._text.append(value)

    def special(self, count: int = 1) -> None:
        """A special token ends the current text piece (tokenizers never merge across it)."""
        self._flush()
        self.num_special += count

    def placeholder(self, kind: str) -> None:
        self._flush()
        self.media.append(kind)

    def _flush(self) -> None:
        if self._text:
            piece = "".join(self._text)
            if piece:
                self.pieces.append(piece)
            self._text = []

    def finish(self) -> Rendered:
        self._flush()
        return self


# A turn is (role, parts); a part is text (str) or a media object with a ``kind``.
Turn = tuple[str, Sequence[object]]


def _kind(part: object) -> str | None:
    """Media kind of a part (any object with a ``kind`` attribute), None for text."""
    return None if isinstance(part, str) else getattr(part, "kind", None)


def _content(out: Rendered, parts: Sequence[object], media: Callable[[Rendered, str], None]) -> None:
    for part in parts:
        kind = _kind(part)
        if kind is None:
            out.text(part if isinstance(part, str) else str(part))
        else:
            media(out, kind)


def _qwen_media(out: Rendered, kind: str) -> None:
    if kind == "audio":  # Qwen2-Audio's wrapper
        out.special()
        out.placeholder(kind)
        out.special()
        return
    out.special()  # <|vision_start|>
    out.placeholder(kind)  # <|image_pad|> / <|video_pad|>
    out.special()  # <|vision_end|>


def _bare_media(out: Rendered, kind: str) -> None:
    out.placeholder(kind)


def _chatml(turns: Sequence[Turn], system: str | None, media: Callable[[Rendered, str], None]) -> Rendered:
    out = Rendered()
    pieces = out.pieces
    if system is not None and (not turns or turns[0][0] != "system"):
        pieces += [f"system\n{system}", "\n"]
        out.num_special += 2
    for role, parts in turns:
        out.num_special += 2  # <|im_start|> ... <|im_end|>
        if all(isinstance(p, str) for p in parts):  # fast path: a text-only turn is one piece
            pieces += [f"{role}\n" + "".join(parts), "\n"]
            continue
        out.text(f"{role}\n")
        _content(out, parts, media)
        out.special(0)  # ends the turn's last piece
        out.text("\n")
        out.special(0)
    return out.finish()


def _onevision_media(out: Rendered, kind: str) -> None:
    out.placeholder(kind)
    out.text("\n")


def _vicuna(turns: Sequence[Turn]) -> Rendered:
    out = Rendered()
    out.special()  # <s>
    system = _VICUNA_SYSTEM
    body = [t for t in turns if t[0] != "system" or not (system := "".join(p for p in t[1] if _kind(p) is None))]
    out.text(system + " ")
    for role, parts in body:
        out.text("USER: " if role == "user" else "ASSISTANT: ")
        _content(out, parts, _bare_media)
        if role == "user":
            out.text(" ")
        else:
            out.special()  # </s>
    return out.finish()


def _idefics3(turns: Sequence[Turn]) -> Rendered:
    out = Rendered()
    out.special()  # <|begin_of_text|>
    for role, parts in turns:
        starts_with_media = bool(parts) and _kind(parts[0]) is not None
        out.text(role.capitalize() + (":" if starts_with_media else ": "))
        _content(out, parts, _bare_media)
        out.special()  # <end_of_utterance>
        out.text("\n")
    return out.finish()


def _plain(turns: Sequence[Turn]) -> Rendered:
    out = Rendered()
    for _, parts in turns:
        _content(out, parts, _bare_media)
    return out.finish()


TEMPLATES: dict[str, Callable[[Sequence[Turn]], Rendered]] = {
    "qwen2-vl": lambda turns: _chatml(turns, _QWEN_SYSTEM, _qwen_media),
    "internvl": lambda turns: _chatml(turns, _INTERNVL_SYSTEM, _bare_media),
    "vicuna": _vicuna,
    "llava-onevision": lambda turns: _chatml(turns, _QWEN_SYSTEM, _onevision_media),
    "idefics3": _idefics3,
    "plain": _plain,
}


def check_template(name: str) -> str:
    """Validate a template name (raises UsageError listing the choices); ``hf:DIR`` is a folder's own.

    Example:
        >>> check_template("vicuna")
        'vicuna'
    """
    if name.startswith("hf:"):
        return name
    if name not in TEMPLATES:
        raise UsageError(f"unknown chat template {name!r}", fix="use one of: " + ", ".join(TEMPLATES))
    return name


def render(name: str, turns: Sequence[Turn]) -> Rendered:
    """Render ``turns`` with template ``name`` into countable pieces (see the module docstring).

    Example:
        >>> render("plain", [("user", ["Hi ", MEDIA_IMAGE])]).pieces
        ['Hi ']
    """
    if name.startswith("hf:"):  # a local model folder's own chat template (jinja2, as apply_chat_template)
        from balancer_cli.scan.rules.hf_template import render_hf_template

        pieces, num_special, media = render_hf_template(name[3:], turns)
        return Rendered(pieces=pieces, num_special=num_special, media=media)
    return TEMPLATES[check_template(name)](turns)
