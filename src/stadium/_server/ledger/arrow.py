"""Arrow columns built from Python lists in a few C calls each, for ``--record``'s shards.

``pyarrow.array`` on a Python list (or a NumPy array) asks pyarrow's pandas shim whether
the value is "array-like", which imports pandas: ~1.2 s of CPU and tens of MiB in every
recording worker, the GIL held. These builders make each column's buffers themselves and
hand them to ``pyarrow.Array.from_buffers``, which imports nothing: a string column is its
items joined (``bytes.join``, which lets go of the GIL past 1 MiB) and their offsets
(``itertools.accumulate`` into an ``array('i')``); numbers an ``array('d')`` or
``array('q')``; a bitmap (booleans, validity) one byte per value packed by ``int(…, 2)``.
No Python code runs per value. A buffer is handed over as ``bytes`` (an ``array`` is copied
once: the cyclic collector tracks arrays, and these live until the shard is written).

Strings are passed as bytes-like values (``bytes``, ``msgspec.Raw``); in per-step columns
an empty item is a null (no JSON text and no error text is empty).
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from typing import Any

_BITS = bytes.maketrans(b"\x00\x01", b"01")
#: An offset past this (a string column's bytes) needs 64-bit offsets.
_MAX_I32 = (1 << 31) - 1


def bitmap(flags: bytes) -> bytes:
    """``flags`` (one byte 0 or 1 per value) packed as Arrow's bitmap: value ``i`` is bit
    ``i % 8`` of byte ``i // 8``."""
    n = len(flags)
    if not n:
        return b""
    return int(flags[::-1].translate(_BITS), 2).to_bytes((n + 7) // 8, "little")


def _validity(pa: Any, flags: bytes) -> tuple[Any, int]:
    """The validity buffer of values whose ``flags`` say present (``None`` if all are)."""
    nulls = flags.count(0)
    return (pa.py_buffer(bitmap(flags)) if nulls else None), nulls


def strings(pa: Any, lengths: Sequence[int], data: bytes, nullable: bool = True) -> Any:
    """A string column of ``len(lengths)`` items, their UTF-8 bytes ``data`` end to end;
    an item of length 0 is a null when ``nullable``."""
    flags = bytes(map(bool, lengths)) if nullable and 0 in lengths else None
    return _strings(pa, lengths, data, flags)


def texts(pa: Any, values: Sequence[str | None]) -> Any:
    """A string column of ``str`` values, ``None`` a null (an empty string is not)."""
    if len(set(values)) == 1 and values[0] is not None:  # one value (env, version): no loop
        item = values[0].encode()
        return _strings(pa, [len(item)] * len(values), item * len(values), None)
    items = [b"" if v is None else v.encode() for v in values]
    flags = bytes(v is not None for v in values)
    return _strings(pa, list(map(len, items)), b"".join(items), flags)


def _strings(pa: Any, lengths: Sequence[int], data: bytes, flags: bytes | None) -> Any:
    offsets = array.array("i", itertools.accumulate(lengths, initial=0))
    if offsets[-1] > _MAX_I32:  # not reached under the recorder's shard bound
        raise ValueError("a string column of over 2 GiB in one shard")
    validity, nulls = (None, 0) if flags is None else _validity(pa, flags)
    # (offsets could be summed by pyarrow.compute in C++, 2x faster: its import is 0.4 s of
    # CPU with the GIL held in each worker, and its scalars import pandas)
    return pa.Array.from_buffers(
        pa.string(),
        len(lengths),
        [validity, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)],
        null_count=nulls,
    )


def floats(pa: Any, values: Sequence[float | None], nullable: bool = True) -> Any:
    """A float64 column; ``None`` a null (when ``nullable``: else none is)."""
    if nullable and None in values:
        flags = bytes(v is not None for v in values)
        data = array.array("d", [0.0 if v is None else v for v in values])
        validity, nulls = _validity(pa, flags)
    else:
        data, validity, nulls = array.array("d", values), None, 0  # type: ignore[arg-type]
    return pa.Array.from_buffers(
        pa.float64(), len(values), [validity, pa.py_buffer(data.tobytes())], null_count=nulls
    )


def ints(pa: Any, values: Sequence[int | None]) -> Any:
    """An int64 column; ``None`` a null."""
    if None in values:
        flags = bytes(v is not None for v in values)
        data = array.array("q", [0 if v is None else v for v in values])
        validity, nulls = _validity(pa, flags)
    else:
        data, validity, nulls = array.array("q", values), None, 0  # type: ignore[arg-type]
    return pa.Array.from_buffers(
        pa.int64(), len(values), [validity, pa.py_buffer(data.tobytes())], null_count=nulls
    )


def bools(pa: Any, values: Sequence[bool]) -> Any:
    """A boolean column (no nulls)."""
    return pa.Array.from_buffers(
        pa.bool_(), len(values), [None, pa.py_buffer(bitmap(bytes(values)))]
    )


def lists(pa: Any, counts: Sequence[int], child: Any) -> Any:
    """A list column: row ``i`` holds the next ``counts[i]`` values of ``child``."""
    offsets = array.array("i", itertools.accumulate(counts, initial=0))
    return pa.Array.from_buffers(
        pa.list_(child.type),
        len(counts),
        [None, pa.py_buffer(offsets.tobytes())],
        children=[child],
    )


__all__ = ["bitmap", "bools", "floats", "ints", "lists", "strings", "texts"]
