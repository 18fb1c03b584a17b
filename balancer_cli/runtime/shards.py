"""``ShardDataset``: a map-style dataset over WebDataset tar shards, read by the scan's offsets.

``balancer scan`` over ``.tar`` shards writes each sample's shard, key and members (extension,
data offset, size) into the lengths table; :class:`ShardDataset` reads sample ``i`` with one
``os.pread`` per member, so a manifest's groups (:class:`~balancer_cli.runtime.sampler.ManifestBatchSampler`)
index the shards directly: no extraction, no sequential tar stream, any order. A sample is a
dict like WebDataset's raw samples: ``{"__key__": key, "__shard__": shard, ext: bytes, ...}``.

Each read checks the member is still where the table says: the shard holds its bytes, and the
tar header just before them is that member's (name and size, see
:func:`~balancer_cli.scan.tar_window.member_header_problem`); a shard rewritten since the scan
raises :class:`~balancer_cli.errors.InputError` naming shard, key and the fix. Shards open
lazily, once per process (at most ``max_open`` at a time), so the dataset pickles into
DataLoader workers.

Example:
    >>> from balancer_cli.runtime import ManifestBatchSampler, ShardDataset  # doctest: +SKIP
    >>> dataset = ShardDataset("lengths.parquet")  # doctest: +SKIP
    >>> sampler = ManifestBatchSampler("OUT", lengths="lengths.parquet", dataset=dataset)  # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=list, num_workers=2)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from torch.utils.data import Dataset

from balancer_cli.errors import InputError
from balancer_cli.lengths import LengthsTable, read_lengths
from balancer_cli.scan.tar_window import member_header_problem

__all__ = ["ShardDataset"]

_HEADER = 512
_RESCAN = "the shard changed since it was scanned: scan the shards again (balancer scan) and pack again"


class ShardDataset(Dataset):
    """Sample ``i`` of a lengths table scanned from tar shards, read from its shard by offset.

    Args:
        lengths: the lengths table (a path, or a :class:`~balancer_cli.lengths.LengthsTable` or
            ``pyarrow.Table``) with the ``shard``, ``key`` and ``member_*`` columns of a scan of
            tar shards.
        decode: called with each raw sample dict; its result is what ``ds[i]`` returns.
        root: the folder relative shard paths resolve against (default: the working directory,
            as they were given to the scan).
        max_open: shards kept open per process (least recently used ones are closed).

    Raises:
        InputError: a table without the member columns; on read, a sample that is not from a
            tar shard, or a member not where the table says.
    """

    def __init__(self, lengths: str | os.PathLike | LengthsTable | pa.Table, *,
                 decode: Callable[[dict[str, Any]], Any] | None = None, root: str | os.PathLike | None = None,
                 max_open: int = 64) -> None:
        table = lengths if isinstance(lengths, pa.Table) else \
            (lengths if isinstance(lengths, LengthsTable) else read_lengths(lengths, members=True)).table
        missing = [c for c in ("shard", "key", "member_names", "member_offsets", "member_sizes")
                   if c not in table.column_names]
        if missing:
            raise InputError(f"the lengths table has no {', '.join(missing)} column(s): it was not scanned from tar shards",
                             fix="scan WebDataset .tar shards with `balancer scan` to replay them by offset")
        shard = table.column("shard").combine_chunks()
        if not pa.types.is_dictionary(shard.type):
            shard = shard.dictionary_encode()
        self._shards: list[str] = [str(s) for s in shard.dictionary.to_pylist()]
        self._shard_N = np.asarray(shard.indices.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
        self._keys = table.column("key").combine_chunks()
        self._names = table.column("member_names").combine_chunks()
        self._offsets = table.column("member_offsets").combine_chunks()
        self._sizes = table.column("member_sizes").combine_chunks()
        self.decode = decode
        self.root = None if root is None else os.fspath(root)
        self.max_open = max(1, int(max_open))
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._shard_N)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fds"] = collections.OrderedDict()  # descriptors stay in their process
        return state

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close this process's open shards (reopened on the next read)."""
        if getattr(self, "_pid", None) == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = collections.OrderedDict()

    def shard_of(self, index: int) -> str | None:
        """The shard path of sample ``index`` (None for a sample not from a tar shard)."""
        position = int(self._shard_N[index])
        return None if position < 0 else self._shards[position]

    def _path(self, shard: str) -> str:
        return shard if self.root is None or os.path.isabs(shard) else os.path.join(self.root, shard)

    def _fd(self, position: int, shard: str, key: str) -> int:
        if self._pid != os.getpid():  # forked with the parent's descriptors: open our own
            self._fds, self._pid = collections.OrderedDict(), os.getpid()
        fd = self._fds.get(position)
        if fd is not None:
            self._fds.move_to_end(position)
            return fd
        try:
            fd = os.open(self._path(shard), os.O_RDONLY)
        except OSError as exc:
            raise InputError(f"{shard}:{key}: cannot open the shard ({exc.strerror or exc})",
                             fix="check the path (relative shard paths resolve against root=, else the "
                                 "working directory)") from None
        self._fds[position] = fd
        while len(self._fds) > self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def raw(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as ``{"__key__", "__shard__", ext: bytes, ...}`` (``decode`` not applied)."""
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range (0..{len(self) - 1})")
        index = index % len(self)
        position = int(self._shard_N[index])
        if position < 0:
            raise InputError(f"sample {index} is not from a tar shard (its input was another format)",
                             fix="replay tar shards only, or give those samples a dataset of their own")
        shard, key = self._shards[position], self._keys[index].as_py()
        fd = self._fd(position, shard, key)
        sample: dict[str, Any] = {"__key__": key, "__shard__": shard}
        names = self._names[index].values.to_pylist()
        offsets = self._offsets[index].values.to_pylist()
        sizes = self._sizes[index].values.to_pylist()
        for ext, offset, size in zip(names, offsets, sizes):
            start = offset - _HEADER
            data = os.pread(fd, size + _HEADER, start) if start >= 0 else b""
            problem = "its offset is inside the first header" if start < 0 else \
                member_header_problem(data[:_HEADER], f"{key}.{ext}", size)
            if problem is None and len(data) != size + _HEADER:
                problem = f"the shard ends before its last byte ({offset + size:,})"
            if problem is not None:
                raise InputError(f"{shard}:{key}: member {ext!r} ({size:,} bytes at byte {offset:,}) is not "
                                 f"where the lengths table says: {problem}", fix=_RESCAN)
            sample[ext] = data[_HEADER:]
        return sample

    def __getitem__(self, index: int) -> Any:
        sample = self.raw(index)
        return sample if self.decode is None else self.decode(sample)
