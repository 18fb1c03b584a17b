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

import importlib
import pkgutil
from pathlib import Path

import click

from balancer_cli import __version__

__all__ = ["main"]

_PREFIX = "cmd_"


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
