"""Scanning datasets into lengths tables: one row per sample with its encoder and LLM tokens.

The modules, in the order a scan uses them (each imports only those before it):

- :mod:`~balancer_cli.scan.hf_datasets`, :mod:`~balancer_cli.scan.inputs`: what to read
  (format detection, InternVL meta files, ``datasets`` folders and builders);
- :mod:`~balancer_cli.scan.jsonlist`, :mod:`~balancer_cli.scan.blocks`: the inputs split into
  :class:`~balancer_cli.scan.blocks.RecordBlock` s, the unit of work;
- :mod:`~balancer_cli.scan.readers`: a block's records, by format;
- :mod:`~balancer_cli.scan.records`, :mod:`~balancer_cli.scan.templates`,
  :mod:`~balancer_cli.scan.text`, :mod:`~balancer_cli.scan.image_header`,
  :mod:`~balancer_cli.scan.rules`: one record as turns and media, its chat template, its text
  tokens, its image sizes and its vision tokens;
- :mod:`~balancer_cli.scan.measure`: one block measured into table rows;
- :mod:`~balancer_cli.scan.engines`: where blocks are measured (``local`` processes, ``ray``);
- :mod:`~balancer_cli.scan.pipeline`: :func:`~balancer_cli.scan.pipeline.scan`, inputs to the
  lengths table.

Example:
    >>> from balancer_cli.scan.pipeline import scan
    >>> scan.__module__
    'balancer_cli.scan.pipeline'
"""

__all__: list[str] = []
