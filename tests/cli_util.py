"""Running the CLI in process and reading a refusal, for the tests of every command's input checks."""

from __future__ import annotations

from click.testing import CliRunner

from balancer_cli.cli import DEBUG_ENV, main


def invoke(args):
    """``balancer ARGS`` in process (exceptions not caught by the runner: a traceback fails the test)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, env={DEBUG_ENV: ""})


def one_error(result, code):
    """The single ``Error: ...; fix: ...`` line of a refused command (exit ``code``), no internal error."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "; fix: " in lines[0], result.output
    assert "internal error" not in lines[0] and "Traceback" not in result.output
    return lines[0]
