"""``balancer scan``: measure every sample's encoder and LLM tokens into a lengths table.

Example:
    >>> from click.testing import CliRunner
    >>> "--model" in CliRunner().invoke(command, ["--help"]).output
    True
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._render import render_scan
from balancer_cli.errors import SampleError, UsageError
from balancer_cli.scan.inputs import FORMATS
from balancer_cli.scan.rules.hf import HF_PREFIX

__all__ = ["command"]


def _parse_param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise UsageError(f"--param {text!r} is not KEY=VALUE", fix="e.g. --param max_pixels=1003520")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--video-size {text!r} is not WIDTHxHEIGHT", fix="e.g. --video-size 640x360") from None
    if width < 1 or height < 1:
        raise UsageError(f"--video-size {text!r} must be positive", fix="e.g. --video-size 640x360")
    return width, height


@click.command("scan")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Lengths table to write (Parquet).")
@click.option("--model", required=True,
              help="Vision-token preset (qwen2-vl, qwen2.5-vl, qwen3-vl, gemma3, glm-4.1v, pixtral, mistral3, "
                   "qwen2.5-omni, qwen3-omni, internvl, llava-1.5, ...) or hf:DIR, a local model/processor folder "
                   "counted by its own transformers processor classes.")
@click.option("--tokenizer", default=None,
              help="Named vocabulary (qwen2, cl100k, deepseek), a tokenizer.json, or a HF model folder "
                   "[default: the hf:DIR folder, else qwen2].")
@click.option("--template", default=None, help="Chat template (default: the model's): qwen2-vl, internvl, vicuna, "
                                               "llava-onevision, idefics3, plain.")
@click.option("--processor-config", type=click.Path(exists=True), default=None,
              help="Read rule parameters from a local preprocessor_config.json (or model folder).")
@click.option("--min-pixels", type=int, default=None, help="Override the rule's min_pixels (Qwen2-VL family).")
@click.option("--max-pixels", type=int, default=None, help="Override the rule's max_pixels (Qwen2-VL family).")
@click.option("--min-tiles", type=int, default=None, help="Override the rule's min_tiles (tiling families).")
@click.option("--max-tiles", type=int, default=None, help="Override the rule's max_tiles (tiling families).")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE", help="Override any rule parameter.")
@click.option("--image-root", type=click.Path(file_okay=False), default=None,
              help="Folder relative image paths resolve against (default: each input's folder). "
                   "Paths may not escape it.")
@click.option("--media-root", "media_roots", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="A folder outside the image root that symlinks in the dataset may lead into (repeatable).")
@click.option("--video-size", default="640x360", show_default=True, metavar="WxH",
              help="Frame size assumed for videos whose records give no width/height.")
@click.option("--field", "fields", multiple=True, metavar="NAME=KEY",
              help="Read field NAME (image, width, height, duration, conversations, messages, text, ...) "
                   "from the record's KEY.")
@click.option("--format", "input_format", default=None,
              type=click.Choice(FORMATS),
              help="Force the input format (default: detected from content).")
@click.option("--hf-builder", default=None, metavar="BUILDER",
              help="Load each INPUT (a local file, glob or folder) with datasets.load_dataset(BUILDER, "
                   "data_files=INPUT), offline: json, csv, parquet, arrow, text, imagefolder, videofolder, "
                   "audiofolder, webdataset.")
@click.option("--split", default=None, help="Split of a DatasetDict folder or --hf-builder input (default: train).")
@click.option("--strict", is_flag=True, help="Stop at the first bad sample (exit 1); with --verify, exit 1 after "
                                             "writing the table when a sample disagrees with transformers.")
@click.option("--verify", type=click.IntRange(min=0), default=0, metavar="N",
              help="Cross-check N random measured samples against transformers' processors and report "
                   "disagreements in the summary (one more read pass over the inputs).")
@click.option("-j", "--jobs", type=int, default=0, help="Worker processes (default: all cores).")
@click.option("--block-size", type=int, default=2048, show_default=True, help="Records per unit of work.")
@click.option("--engine", default="local", show_default=True,
              help="Execution engine: local (processes) or ray (Ray Data, needs the [ray] extra); same output.")
@click.option("--ray-address", default=None, metavar="ADDR", envvar="RAY_ADDRESS", show_envvar=True,
              help="--engine ray: an existing cluster (auto, HOST:6379, ray://HOST:10001); default: start a "
                   "local one with --jobs CPUs. Shards go to OUTPUT.parts/, which every node must be able to write.")
@click.option("--keep-parts", is_flag=True, help="--engine ray: keep OUTPUT.parts/ (the per-block shards) afterwards.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@json_option
@handle_errors
def command(inputs: tuple[str, ...], output: str, model: str, tokenizer: str, template: str | None,
            processor_config: str | None, min_pixels: int | None, max_pixels: int | None, min_tiles: int | None,
            max_tiles: int | None, params: tuple[str, ...], image_root: str | None, media_roots: tuple[str, ...],
            video_size: str,
            fields: tuple[str, ...], input_format: str | None, hf_builder: str | None, split: str | None,
            strict: bool, verify: int, jobs: int, block_size: int, engine: str, ray_address: str | None,
            keep_parts: bool, quiet: bool, as_json: bool) -> None:
    """Scan datasets into a lengths table: one row per sample with its encoder and LLM tokens.

    \b
    INPUT: LLaVA JSON/JSONL, `messages` JSON/JSONL, InternVL meta JSON, Parquet, a
    datasets save_to_disk folder, WebDataset .tar shards (a shard, a folder of them,
    or a quoted pattern: 'shards/train-{000000..000099}.tar'), or with --hf-builder
    local files for datasets.load_dataset (e.g. --hf-builder imagefolder DIR);
    several inputs concatenate in order.
    Bad samples keep their row with an `error` (summary by kind); --strict stops at the first.

    \b
    Example:
      balancer scan sample_data/llava.jsonl -o out/lengths.parquet --model qwen2-vl --tokenizer qwen2
    """
    from tqdm import tqdm

    from balancer_cli.run import scan_to_file
    from balancer_cli.scan.measure import ScanConfig
    from balancer_cli.scan.records import FIELD_NAMES

    overrides = dict(_parse_param(p) for p in params)
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels), ("min_tiles", min_tiles),
                       ("max_tiles", max_tiles)):
        if value is not None:
            overrides[key] = value
    mapping = {}
    for item in fields:
        name, _, key = item.partition("=")
        if name not in FIELD_NAMES or not key:
            raise UsageError(f"--field {item!r} is not NAME=KEY with a known NAME",
                             fix=f"NAME is one of: {', '.join(FIELD_NAMES)}; e.g. --field image=file_name")
        mapping[name] = key
    hf = model.startswith(HF_PREFIX)
    if hf and processor_config:
        raise UsageError("--processor-config does not apply to --model hf:DIR (the folder is the config)",
                         fix="drop --processor-config, or use a preset with --processor-config DIR")
    if hf:
        model = HF_PREFIX + str(Path(model[len(HF_PREFIX):]).expanduser().resolve())
    config = ScanConfig(model=model if hf else model.lower(), model_params=tuple(sorted(overrides.items())),
                        processor_config=processor_config,
                        tokenizer=tokenizer or (model[len(HF_PREFIX):] if hf else "qwen2"), template=template,
                        strict=strict, video_size=_parse_size(video_size), fields=tuple(sorted(mapping.items())),
                        media_roots=tuple(media_roots))
    if engine != "ray" and ray_address and (click.get_current_context().get_parameter_source("ray_address")
                                            != click.core.ParameterSource.COMMANDLINE):
        ray_address = None  # a RAY_ADDRESS in the environment is fine for the local engine
    bar = tqdm(unit=" samples", desc="scan", disable=quiet or not sys.stderr.isatty(), file=sys.stderr)
    try:
        summary = scan_to_file(inputs, output, config, engine=engine, ray_address=ray_address, keep_parts=keep_parts,
                               jobs=jobs, progress=bar.update,
                               notify=None if quiet else lambda line: click.echo(line, err=True),
                               block_size=block_size, image_root=image_root, format=input_format, split=split,
                               hf_builder=hf_builder, verify=verify)
    finally:
        bar.close()
    emit(summary, as_json, _render)
    report = summary.get("verify")
    if strict and report and report["disagreements"]:
        first = report["examples"][0]
        raise SampleError(f"{report['disagreements']} of {report['media']} media of {report['samples']} verified "
                          f"samples disagree with transformers; first: sample {first['sample']} "
                          f"{first['kind']} {first['meta']}", kind="verify_mismatch", file=first["file"],
                          line=first["line"], fix="report it, or scan with --model hf:DIR to count with "
                                                  "transformers itself")


def _render(summary: dict[str, Any]) -> str:
    """The scan summary plus the rule that counted and the --verify result."""
    lines = [render_scan(summary)]
    rule = summary.get("rule")
    if rule:
        knobs = " ".join(f"{k}={v}" for k, v in rule["knobs"].items() if not isinstance(v, (dict, list, tuple)))
        lines.append(f"  rule {rule['name']} ({rule['rule']}, counted by {rule['counted_by']}): {knobs}")
        lines += [f"  note: {note}" for note in rule.get("notes", ())]
    report = summary.get("verify")
    if report:
        lines.append(f"  verify: {report['samples']} samples, {report['media']} media checked against "
                     f"{report['reference']}: {report['disagreements']} disagreement(s)")
        for example in report["examples"]:
            lines.append(f"    sample {example['sample']} ({example['file']}:{example['line']}) {example['kind']} "
                         f"{example['meta']}: scan {example['scan']} vs transformers {example['transformers']}")
        lines += [f"    note: {note}" for note in report.get("notes", ())]
    return "\n".join(lines)
