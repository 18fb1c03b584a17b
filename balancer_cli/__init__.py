"""balancer_cli: balanced mini-batches for multimodal LLM training.

The flow, and the folder of each step::

    dataset files --scan/--> lengths.parquet --pack/--> OUT/manifest.parquet --replay/--> training job
                             (lengths.py)               (manifest.py)            (runtime/: torch adapters)
                                                 report/ measures it; planners/ balance the model side

Layers, each importing only the ones above it: ``errors``, ``_jit``, ``_fsutil`` -> ``lengths``,
``manifest`` (the two data contracts) -> ``scan/`` -> ``cost/`` -> ``replay/`` (torch-free) ->
``pack/`` -> ``report/`` -> ``planners/`` -> ``run`` (one library call per command) ->
``runtime/`` (the only torch importer) -> ``cli/``.

Glossary (the words code, docs and the CLI use):

- **sample**: one training example, by its 0-based index in the dataset the job's ``Dataset`` sees.
- **module**: a part of the model with its own work: an encoder (``vision``, ``audio``, ``video``)
  or ``llm``; encoders first, ``llm`` last in every per-module axis.
- **group**: what the packer forms: one packed sequence, one micro-batch on one rank.
- **step**: one optimizer step; each of R ranks runs M groups (:class:`~balancer_cli.manifest.StepShape`).
- **slot**: one (step, rank, micro) place; a manifest holds one group per slot.
- **load**: the quantity a cap bounds (encoder *items*, LLM *tokens*).
- **cost**: the work that is balanced (tokens by default, FLOPs under a cost preset).
- **weight**: cost normalized per module (divided by its mean), so modules weigh alike.
- **cap** Q and **bound** Q': the per-group limit on load, and ISF's acceptance bound.

Shape legend: an array's name ends in the letters of its axes, e.g. ``cost_NK`` is (N, K).

====  ===========================================================================
N     samples of the lengths table
n     samples of one step, rank or window (a local subset)
K     modules (encoders first, ``llm`` last)
G     groups
S     steps
R     ranks
M     micro-batches (groups) per rank per step
P     placed rows: manifest rows, or entries of a packing's sample order
D     dropped samples
O     sources (input files or datasets a sample comes from)
C     candidates (search grid points, refinement partners)
X     member slots of a group (the padded width of a group's member table)
U     units of elastic replay (a step, or a run of short steps); L its batches
B     blocks of the assigner: R groups that share one micro-batch slot of a step
====  ===========================================================================

Example:
    >>> import balancer_cli
    >>> balancer_cli.__version__
    '0.1.0'
"""

from balancer_cli.errors import BalancerError, InputError, UsageError

__version__ = "0.1.0"

__all__ = ["BalancerError", "InputError", "UsageError", "__version__"]
