# DEV SHIM (untracked)
from balancer_cli.pack.packer import pack_balanced
def pack_isf(load_NK, caps_K, bounds_K, *, iterations=50, seed=0, oversize="isolate", sample_ids=None):
    return pack_balanced(load_NK, caps_K, seed=seed + 1, oversize=oversize, sample_ids=sample_ids)
