"""Planners: balanced pipeline partition (BMP) and adaptive activation recomputation.

Pure functions over the layer chain of :mod:`balancer_cli.planners.chain`; the CLI commands
``plan-partition`` and ``plan-recompute`` are thin shells around them.
"""
