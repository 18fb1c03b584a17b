"""Incremental decoding of a JSON list: one element at a time, in constant memory.

Used to stream LLaVA-style JSON list files (often several GB) without loading them: the file is
read in 1 MiB chunks and each element is decoded with :meth:`json.JSONDecoder.raw_decode`, keeping
track of the line each element starts on for error messages.

Example:
    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
    >>> _ = p.write_text('[\\n  {"a": 1},\\n  2\\n]')
    >>> list(iter_json_list(str(p)))
    [(2, '{"a": 1}'), (3, '2')]
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from balancer_cli.errors import InputError
from balancer_cli.scan.inputs import open_input

__all__ = ["iter_json_list"]

_CHUNK_CHARS = 1 << 20
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


def _bracket_end(text: str, pos: int) -> int:
    """The end of the array or object starting at ``text[pos]`` (strings skipped), -1 if it runs
    past the text.

    Example:
        >>> _bracket_end('[[1, "]"], {}] tail', 0), _bracket_end("[[", 0)
        (14, -1)
    """
    depth, i, n = 0, pos, len(text)
    while i < n:
        char = text[i]
        if char == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def iter_json_list(path: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line, element_text)`` of a JSON list, decoding incrementally (constant memory).

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
        >>> _ = p.write_text('[1, {"a": 2}')
        >>> list(iter_json_list(str(p)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.InputError: ...x.json:1: not a valid JSON list (unexpected end of file); fix: ...
    """
    with open_input(path, text=True) as handle:
        buf, pos, eof, line = "", 0, False, 1

        def fill() -> bool:
            nonlocal buf, pos, eof
            chunk = handle.read(_CHUNK_CHARS)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            return bool(chunk)

        def skip() -> None:
            nonlocal pos, line
            while True:
                while pos < len(buf) and buf[pos] in _WHITESPACE + "\ufeff":
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf) or not fill():
                    return

        def fail(what: str) -> InputError:
            return InputError(f"{path}:{line}: not a valid JSON list ({what})",
                              fix="fix the JSON syntax, or convert the file to JSONL (one record per line)")

        try:
            skip()
            if buf[pos:pos + 1] != "[":
                raise fail("it does not start with '['")
            pos += 1
            expect_value = True
            while True:
                skip()
                if pos >= len(buf):
                    raise fail("unexpected end of file")
                char = buf[pos]
                if char == "]":
                    pos += 1
                    skip()
                    if pos < len(buf):  # a second list, or text: its records would be lost unseen
                        raise fail("more data after the list's closing ']'")
                    return
                if char == "," and not expect_value:
                    pos += 1
                    expect_value = True
                    continue
                while True:
                    try:
                        _, end = _DECODER.raw_decode(buf, pos)
                        if end < len(buf) or eof:
                            break
                    except json.JSONDecodeError as exc:
                        if eof:
                            raise fail(exc.msg) from None
                    except RecursionError:
                        # Nested deeper than the decoder recurses: find the element's end by its
                        # brackets; the record itself becomes a malformed_record when read.
                        end = _bracket_end(buf, pos)
                        if end > 0:
                            break
                        if eof:
                            raise fail("unexpected end of file") from None
                    if not fill() and eof:
                        continue
                element = buf[pos:end]
                yield line, element
                line += element.count("\n")
                pos = end
                expect_value = False
        except UnicodeDecodeError as exc:
            raise fail(f"not UTF-8: {exc.reason}") from None
