# DEV SHIM (untracked)
import numpy as np
from balancer_cli.pack.types import Packing
def pack_balanced(load_NK, caps_K, *, seed=0, oversize="isolate", sample_ids=None, **tuning):
    load_NK = np.asarray(load_NK); N = len(load_NK)
    ids = np.arange(N) if sample_ids is None else np.asarray(sample_ids)
    rng = np.random.default_rng(seed); perm = rng.permutation(N)
    groups = []; cur = []; acc = np.zeros(load_NK.shape[1]); iso = []; dropped = []
    for i in perm:
        if (load_NK[i] > caps_K).any():
            if oversize == "drop": dropped.append(ids[i]); continue
            groups.append([ids[i]]); iso.append(True); continue
        if cur and ((acc + load_NK[i]) > caps_K).any():
            groups.append(cur); iso.append(False); cur = []; acc[:] = 0
        cur.append(ids[i]); acc += load_NK[i]
    if cur: groups.append(cur); iso.append(False)
    order = np.array([s for g in groups for s in g], np.int64)
    off = np.concatenate([[0], np.cumsum([len(g) for g in groups])]).astype(np.int64)
    return Packing(order, off, np.array(iso, bool), np.array(dropped, np.int64), tuple("oversize" for _ in dropped))
