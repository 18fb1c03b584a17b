"""Hugging Face ``datasets`` inputs of ``balancer scan``: ``save_to_disk`` folders, ``.arrow`` files, and
``datasets.load_dataset(builder, data_files=...)`` over local files, always offline.

A ``--hf-builder`` input is a local file, glob or folder; :func:`check_builder_input` rejects Hub
names, URLs and builders that would need the network before ``datasets`` is ever asked, and
:func:`open_dataset` loads with ``datasets.config.HF_HUB_OFFLINE`` set (as ``HF_DATASETS_OFFLINE=1``
would), so a scan fails fast with a clear error instead of waiting on the network. The loaded
dataset (Arrow cache files, memory-mapped) is cached per process, so blocks reopen it cheaply.

Example:
    >>> import json, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.jsonl").write_text(json.dumps({"text": "hi"}))
    >>> check_builder_input(str(d / "*.jsonl"), "json")  # fine: a local glob that matches
    >>> check_builder_input("user/some-dataset", "user/some-dataset")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    balancer_cli.errors.UsageError: --hf-builder 'user/some-dataset' is not a local-file builder ...
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from balancer_cli.errors import InputError, UsageError

__all__ = ["HF_BUILDERS", "builder_files", "check_builder_input", "open_dataset"]

# `datasets` packaged builders that read local files; anything else (a Hub name, a script) needs
# the network, which a scan never uses.
HF_BUILDERS = ("json", "csv", "parquet", "arrow", "text", "imagefolder", "videofolder", "audiofolder", "webdataset")


def builder_files(pattern: str) -> list[Path]:
    """The local files behind a ``--hf-builder`` input (a file, a glob, or every file of a folder), sorted.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.json").write_text("{}")
        >>> [p.name for p in builder_files(str(d / "*.json"))]
        ['a.json']
    """
    target = Path(pattern)
    if target.is_dir():
        return sorted(p for p in target.rglob("*") if p.is_file())
    if target.is_file():
        return [target]
    return sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))


def check_builder_input(path: str, builder: str) -> None:
    """Raise a clear error unless ``builder`` reads local files and ``path`` names some (never asks the network)."""
    if builder not in HF_BUILDERS:
        raise UsageError(f"--hf-builder {builder!r} is not a local-file builder (a Hub dataset or a loading script "
                         "needs the network, which balancer scan never uses)",
                         fix=f"use one of {', '.join(HF_BUILDERS)} over local files; for a Hub dataset download "
                             "it first (e.g. `huggingface-cli download --repo-type dataset NAME --local-dir DIR`) "
                             "and pass DIR's files, or pass a Dataset.save_to_disk folder without --hf-builder")
    if "://" in path:
        raise InputError(f"{path}: a URL (balancer scan reads local files only)",
                         fix="download the files and pass their local paths")
    if not builder_files(path):
        raise InputError(f"{path}: no local file matches (a Hub dataset name needs the network, which balancer "
                         "scan never uses)",
                         fix="pass local files, a glob or a folder; download Hub datasets first "
                             "(`huggingface-cli download --repo-type dataset NAME --local-dir DIR`)")


@contextlib.contextmanager
def _offline_datasets() -> Iterator[None]:
    """``datasets`` offline (as with ``HF_DATASETS_OFFLINE=1``) and without its progress bars, for a while."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()  # our own bar reports progress; theirs would garble it
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved
        if bars_were_on:
            datasets.enable_progress_bars()


def _load_with_builder(path: str, split: str | None, builder: str) -> Any:
    import datasets

    where = {"data_dir": path} if os.path.isdir(path) else {"data_files": path}
    try:
        with _offline_datasets():
            return datasets.load_dataset(builder, split=split or "train", **where)
    except Exception as exc:  # datasets raises many types; all mean "not loadable"
        raise InputError(f"{path}: datasets.load_dataset({builder!r}) failed ({type(exc).__name__}: "
                         f"{str(exc)[:160]})",
                         fix=f"check that the files are valid {builder} data (one schema for all records) "
                             "and that --split names a split (default: train)") from None


@functools.lru_cache(maxsize=8)
def open_dataset(path: str, split: str | None, builder: str | None = None) -> Any:
    """The ``datasets.Dataset`` of one input: a ``save_to_disk`` folder (``split`` of a DatasetDict,
    default ``train``), a cache ``.arrow`` file, or with ``builder`` ``load_dataset`` over local files."""
    import datasets

    if builder is not None:
        return _load_with_builder(path, split, builder)
    try:
        if path.endswith(".arrow") and os.path.isfile(path):
            return datasets.Dataset.from_file(path)
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises many types; all mean "not loadable"
        raise InputError(f"{path}: cannot load the datasets folder ({str(exc)[:120]})",
                         fix="pass a folder written by Dataset.save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise UsageError(f"{path}: DatasetDict has no split {name!r} (splits: {', '.join(loaded)})",
                             fix="choose one with --split")
        return loaded[name]
    return loaded
