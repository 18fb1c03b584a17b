"""Media paths: containment checked on the real path, only regular files opened, no file bytes in errors."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from PIL import Image

from balancer_cli.errors import SampleError
from balancer_cli.scan.image_header import read_image_size
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.pipeline import scan


def _record(path: str) -> str:
    return json.dumps({"image": path, "conversations": [{"from": "human", "value": "<image>\nWhat?"}]})


def _errors(data: Path, config: ScanConfig | None = None) -> list:
    lengths = scan([str(data)], config or ScanConfig(), jobs=1).lengths
    return lengths.errors().tolist()


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "images").mkdir(parents=True)
    Image.new("RGB", (64, 48)).save(root / "images" / "ok.png")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    Image.new("RGB", (32, 16)).save(outside / "big.png")
    return root


def test_a_symlink_leading_out_of_the_root_is_a_path_escape_without_the_targets_bytes(tree):
    (tree / "images" / "passwd.png").symlink_to(tree.parent / "outside" / "secret.txt")
    (tree / "images" / "inside.png").symlink_to(tree / "images" / "ok.png")
    data = tree / "d.jsonl"
    data.write_text("\n".join([_record("images/passwd.png"), _record("images/inside.png")]) + "\n")
    errors = _errors(data)
    assert errors[0].startswith("path_escape: ") and "symlink" in errors[0]
    assert "root:x" not in errors[0]
    assert errors[1] is None  # a symlink that stays inside the root is followed


def test_a_symlinked_data_folder_is_allowed_only_into_the_media_roots(tree):
    (tree / "linked").symlink_to(tree.parent / "outside", target_is_directory=True)
    data = tree / "d.jsonl"
    data.write_text(_record("linked/big.png") + "\n")
    assert _errors(data)[0].startswith("path_escape: ")
    assert _errors(data, ScanConfig(media_roots=(str(tree.parent / "outside"),))) == [None]


def test_unsupported_file_bytes_never_reach_the_message(tree):
    (tree / "images" / "notes.png").write_text("root:x:0:0:root:/root:/bin/bash\n")
    data = tree / "d.jsonl"
    data.write_text(_record("images/notes.png") + "\n")
    (error,) = _errors(data)
    assert error.startswith("unsupported_image: ") and "root:x" not in error


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_image_is_a_missing_file_error_and_does_not_hang(tree):
    os.mkfifo(tree / "images" / "pipe.png")
    data = tree / "d.jsonl"
    data.write_text("\n".join([_record("images/pipe.png"), _record("images")]) + "\n")
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_errors(data)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the scan blocked on the FIFO"
    (fifo, folder), = result
    assert fifo.startswith("missing_file: ") and "not a regular file" in fifo
    assert folder.startswith("missing_file: ")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_read_image_size_refuses_special_files(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(SampleError, match="not a regular file") as info:
        read_image_size(str(tmp_path / "pipe"))
    assert info.value.kind == "missing_file"
    with pytest.raises(SampleError, match="NUL byte"):
        read_image_size("a\x00b.png")
    if os.path.exists("/dev/zero"):
        with pytest.raises(SampleError, match="not a regular file"):
            read_image_size("/dev/zero")


def test_a_nul_byte_in_a_path_is_a_malformed_record(tree):
    data = tree / "d.jsonl"
    data.write_text(_record("images/ok\u0000.png") + "\n" + _record("images/ok.png") + "\n")
    errors = _errors(data)
    assert errors[0].startswith("malformed_record: ") and "NUL" in errors[0]
    assert errors[1] is None
