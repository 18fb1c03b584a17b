"""The ``balancer`` command line: a thin click shell over the library.

Each subcommand lives in its own module ``balancer_cli/cli/cmd_<name>.py`` (underscores become
dashes: ``cmd_plan_partition`` is ``balancer plan-partition``) exposing a click command named
``command``. Modules are imported only when their command runs, so ``balancer --help`` stays fast
and never imports torch or other heavy dependencies.

Example:
    >>> from click.testing import CliRunner
    >>> CliRunner().invoke(main, ["--version"]).output.startswith("balancer")
    True
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click

from balancer_cli import __version__
from balancer_cli._memory import keep_freed_memory, use_small_pages
from balancer_cli.errors import BalancerError

__all__ = ["DEBUG_ENV", "main", "run"]

_PREFIX = "cmd_"
#: Set to 1 to print the full traceback of an internal error (a bug) before its one-line message.
DEBUG_ENV = "BALANCER_DEBUG"


class _LazyGroup(click.Group):
    """A click group whose subcommands are the ``cmd_*`` modules of this package, imported lazily."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        modules = pkgutil.iter_modules([str(Path(__file__).parent)])
        names = [m.name[len(_PREFIX):] for m in modules if m.name.startswith(_PREFIX)]
        return sorted(name.replace("_", "-") for name in names)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.list_commands(ctx):
            return None
        module = importlib.import_module(f"{__name__}.{_PREFIX}{cmd_name.replace('-', '_')}")
        return module.command

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; an exception outside the package's error family (a bug, never the
        user's input) ends as one ``Error:`` line and exit 1, its traceback only with
        ``BALANCER_DEBUG=1``."""
        keep_freed_memory()  # a command is one job: its freed arrays are reused, not zeroed again
        use_small_pages()  # and its large arrays cost no huge-page faults (_memory's docstring)
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort,
                SystemExit, KeyboardInterrupt):
            raise
        except BalancerError as error:  # raised outside a command body (an option callback)
            click.echo(f"Error: {error}", err=True)
            sys.exit(error.exit_code)
        except Exception as exc:  # noqa: BLE001 (the last line of defence: anything else is a bug)
            _internal_error(ctx, exc)


def _internal_error(ctx: click.Context, exc: BaseException) -> None:
    """Print the one-line internal error (the traceback first under ``BALANCER_DEBUG=1``) and exit 1."""
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    if debug:
        click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
    name = ctx.invoked_subcommand or ""
    what = ascii(str(exc))[1:-1][:200]
    hint = "" if debug else f"; run again with {DEBUG_ENV}=1 for the traceback"
    click.echo(f"Error: internal error in `balancer {name}` ({type(exc).__name__}: {what}); this is a bug, "
               f"please report it with the command line{hint}", err=True)
    sys.exit(1)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="balancer")
def main() -> None:
    """Balanced mini-batches for multimodal LLM training.

    \b
    Flow: scan -> search -> pack -> report, then replay the manifest in training:
      balancer scan data.jsonl -o lengths.parquet --model qwen2-vl --tokenizer qwen2
      balancer pack lengths.parquet --dp 8 -o out/
      balancer report out/
    Optionally balance measured time instead of tokens (needs torch + transformers):
      balancer calibrate model_config_dir/ --lengths lengths.parquet -o costs.json
      balancer pack lengths.parquet --dp 8 --cost-model measured --costs costs.json -o out/
    """


def run() -> NoReturn:
    """The ``balancer`` program (and ``python -m balancer_cli``): :func:`main`, then the process
    ends at once with its exit code.

    Once a command has finished, its output is complete: a SIGTERM or Ctrl-C that lands while the
    interpreter tears down (0.2-0.5 s after a pack: freeing its arrays, Ray's and numba's native
    state) killed the process with status 143 and no message, its output whole, or printed a
    KeyboardInterrupt traceback. So the streams are flushed (Python's and C's) and the process
    ends with ``os._exit``: no teardown to interrupt, and none to wait for; a signal during the
    flush (a reader that stopped reading) ends it at once with the same code. Every command
    stops what it started (pools, Ray, the plot worker) and commits its files before it returns.
    In-process callers (tests, notebooks) call :func:`main`.
    """
    try:
        main()  # standalone: ends in SystemExit
    except SystemExit as done:
        code = done.code
    else:  # pragma: no cover - click's standalone main always exits
        code = 0
    if not isinstance(code, int):  # sys.exit("text") prints the text and exits 1, as Python does
        if code is not None:
            with contextlib.suppress(Exception):
                print(code, file=sys.stderr)
        code = 0 if code is None else 1
    code &= 0xFF

    def end(signum: int, frame: Any) -> None:  # a signal from here on: the same end, at once
        os._exit(code)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, end)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (`| head`) has nothing left to take
            stream.flush()
    with contextlib.suppress(Exception):  # what native code printed through C's stdio buffers
        import ctypes

        ctypes.CDLL(None).fflush(None)
    os._exit(code)
