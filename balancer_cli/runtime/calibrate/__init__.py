"""Calibration on the user's hardware: build each module of a model from its config with random
weights, time packed groups forward + backward, fit their cost (``balancer calibrate``).

- :mod:`~balancer_cli.runtime.calibrate.families`: the model families and how each module runs a group;
- :mod:`~balancer_cli.runtime.calibrate.measure`: timing one shape (warm-up, repeats, CUDA events);
- :mod:`~balancer_cli.runtime.calibrate.run`: :func:`calibrate`, the whole calibration;
- :mod:`~balancer_cli.runtime.calibrate.replay`: :func:`replay_times`, the measured time of a
  manifest's first steps on the same model (how packings are compared in measured time).

The fit, the shape grid and the costs.json schema are pure and live in :mod:`balancer_cli.cost`.

Example:
    >>> from balancer_cli.runtime.calibrate import calibrate, replay_times  # doctest: +SKIP
"""

from balancer_cli.runtime.calibrate.families import ATTENTIONS, FAMILIES
from balancer_cli.runtime.calibrate.replay import replay_times
from balancer_cli.runtime.calibrate.run import (
    DTYPES,
    calibrate,
    calibrate_to_file,
    flops_model_files,
    load_config,
)

__all__ = ["ATTENTIONS", "DTYPES", "FAMILIES", "calibrate", "calibrate_to_file", "flops_model_files", "load_config",
           "replay_times"]
