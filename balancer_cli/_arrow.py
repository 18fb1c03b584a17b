"""numpy arrays to Arrow and back without pyarrow's pandas checks.

``pa.array`` (of an ndarray or a list) and ``Array.to_numpy`` ask pyarrow's pandas shim whether
the values are pandas objects, which imports pandas the first time: 0.24-0.28 s of a command
(pandas comes with ``datasets``), a quarter of a second in the 4 s a 1.2M ``balancer pack``
may take end to end. Here a primitive column without nulls is viewed through DLPack (the same
zero-copy, read-only view), a boolean one cast to bytes first; an ndarray of numbers becomes
an Arrow array over its own buffer (the zero copy ``pa.array`` makes) and strings are laid
out as Arrow's offsets and bytes. Anything else (nulls, strings to numpy) takes pyarrow's
own conversion, as before.

Example:
    >>> import pyarrow as pa
    >>> numpy_of(pa.chunked_array([[1, 2], [3]])).tolist(), numpy_of(pa.array([True, False])).tolist()
    ([1, 2, 3], [True, False])
    >>> numpy_of(pa.array([1, None])).tolist()  # nulls: pyarrow's own conversion (floats, NaN)
    [1.0, nan]
    >>> arrow_of(np.arange(3, dtype=np.int32)).type, arrow_strings(["a", "bé"]).to_pylist()
    (DataType(int32), ['a', 'bé'])
    >>> arrow_repeat("data", 2).to_pylist()
    ['data', 'data']
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

__all__ = ["arrow_of", "arrow_repeat", "arrow_strings", "numpy_of"]


def numpy_of(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``values.to_numpy(zero_copy_only=False)``, without importing pandas where the values are
    integers, floats or booleans without nulls (several chunks are joined: a copy)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
    kind = values.type
    plain = values.null_count == 0 and hasattr(values, "__dlpack__")
    if plain and pa.types.is_boolean(kind):
        return np.from_dlpack(values.cast(pa.uint8())).view(np.bool_)
    if plain and (pa.types.is_integer(kind) or pa.types.is_floating(kind)) and not pa.types.is_float16(kind):
        return np.from_dlpack(values)
    return values.to_numpy(zero_copy_only=False)


def arrow_of(values: np.ndarray) -> pa.Array:
    """``pa.array(values)`` for a 1-d array of integers or floats (over the same buffer, a copy
    only where ``values`` is not contiguous); any other array goes to ``pa.array``."""
    array = np.ascontiguousarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iuf" or array.dtype.byteorder not in "=|":
        return pa.array(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(array.dtype), len(array), [None, pa.py_buffer(array)])


def arrow_strings(values: Sequence[str]) -> pa.StringArray:
    """``pa.array(list(values), pa.string())`` for Python strings (none missing)."""
    encoded = [str(v).encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # past one string array's offsets: pyarrow's own
        return pa.array(list(values), pa.string())
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets.astype(np.int32)),
                                                             pa.py_buffer(b"".join(encoded))])


def arrow_repeat(value: str, n: int) -> pa.DictionaryArray:
    """``pa.array([value] * n, pa.string()).dictionary_encode()``, without the list."""
    return pa.DictionaryArray.from_arrays(arrow_of(np.zeros(n, np.int32)), arrow_strings([value]))
