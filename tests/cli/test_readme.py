"""Executable docs: the README's first command runs on sample_data/ and prints what the README shows.

The first line of the README's first ``bash`` block installs the tool and runs the main job; this
runs its ``balancer`` commands (not the install) in a scratch copy of ``sample_data/`` and compares
each command's output with the README's transcript of it (``$ balancer ...`` followed by the
output), timings ignored. The second line is what ``.ci/run`` runs.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: ``(1.9 s, 176 samples/s)``: wall-clock figures differ from run to run.
TIMING = re.compile(r"\(\d+(?:\.\d+)? s, [\d,.]+ samples/s\)")


def _blocks() -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced code block of the README, in order."""
    blocks, language, lines = [], None, []
    for line in README.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(lines)))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def _first_commands() -> list[str]:
    return next(text for language, text in _blocks() if language == "bash").strip().splitlines()


def _transcripts() -> dict[str, str]:
    """``{command: its output}`` of every ``$ balancer ...`` line in the README's plain code blocks."""
    found = {}
    for language, block in _blocks():
        if language:
            continue
        parts = re.split(r"^\$ (balancer .*)$", block, flags=re.M)
        for command, output in zip(parts[1::2], parts[2::2]):
            found[command.strip()] = output.strip("\n")
    return found


def _normalize(text: str) -> str:
    return "\n".join(TIMING.sub("(timing)", line).rstrip() for line in text.strip("\n").splitlines())


def test_readme_first_command_runs_and_prints_its_transcript(tmp_path):
    install_and_run = _first_commands()[0]
    steps = [s.strip() for s in install_and_run.split("&&")]
    assert steps[0] == "pip install -e ." and all(s.startswith("balancer ") for s in steps[1:])
    assert all("sample_data/" in s or "out/" in s for s in steps[1:])
    shutil.copytree(ROOT / "sample_data", tmp_path / "sample_data")
    transcripts = _transcripts()
    for step in steps[1:]:
        assert step in transcripts, f"the README shows no transcript of `{step}`"
        args = shlex.split(step)[1:]
        run = subprocess.run([sys.executable, "-m", "balancer_cli", *args], cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert _normalize(run.stdout) == _normalize(transcripts[step]), f"`{step}` printed:\n{run.stdout}"
    assert (tmp_path / "out" / "manifest" / "manifest.parquet").is_file()


def test_readme_test_command_is_what_ci_runs():
    test_command = _first_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in test_command and 'pip install --quiet torch==2.13.0' in ci
    assert 'pip install -e ".[test,torch,ray]"' in test_command and '-e ".[test,torch,ray]"' in ci
    assert test_command.endswith("python -m pytest -q") and ci.rstrip().endswith("python3 -m pytest -q")
