"""Vision-token rules per model family, computed from media sizes alone.

:mod:`~balancer_cli.scan.rules.base` holds the shared types (:class:`~balancer_cli.scan.rules.base.MediaCount`,
the :class:`~balancer_cli.scan.rules.base.VisionRule` protocol, ``count_images``);
:mod:`~balancer_cli.scan.rules.qwen`, :mod:`~balancer_cli.scan.rules.llava` and
:mod:`~balancer_cli.scan.rules.tiles` the families; :mod:`~balancer_cli.scan.rules.registry` the
presets by name (``get_rule``).

Example:
    >>> from balancer_cli.scan.rules.registry import get_rule
    >>> get_rule("llava-1.5").count_image(640, 480).llm_tokens
    576
"""

__all__: list[str] = []
