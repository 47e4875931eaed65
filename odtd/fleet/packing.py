"""A model's weights as one flat array per dtype for Flower's messages, and back.

Flower 1.4x moves each array of an ``ArrayRecord`` as an object of its own, one request per
object per hop (ServerApp -> SuperLink -> SuperNode -> ClientApp, and back). DenseNet40 has 197
weight arrays: sent as they are, a round is thousands of small requests. Packed, every message
carries one array per dtype (one for a float32 model), and the ``layout`` (each array's dtype and
shape, in the model's order) travels in the round's config. FedAvg's weighted mean is taken
element by element, so averaging the packed arrays is averaging the arrays.

Standard library and numpy only: the ClientApp and the ServerApp use it; so do tests without
Flower.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from odtd.errors import OdtdError


def pack(arrays: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], List[str]]:
    """The arrays as one flat array per dtype (in order of first use) and their layout."""
    layout = [f"{a.dtype.str}:{','.join(str(n) for n in a.shape)}" for a in arrays]
    dtypes = list(dict.fromkeys(a.dtype.str for a in arrays))
    flat = [np.concatenate([np.ravel(a) for a in arrays if a.dtype.str == dtype] or
                           [np.zeros(0, dtype)]) for dtype in dtypes]
    return flat, layout


def _entry(entry: str) -> Tuple[np.dtype, Tuple[int, ...]]:
    try:
        dtype, _, shape = str(entry).partition(":")
        return np.dtype(dtype), tuple(int(n) for n in shape.split(",") if n != "")
    except (TypeError, ValueError):
        raise OdtdError(f"the round's layout entry {entry!r} is not dtype:shape") from None


def unpack(flat: Sequence[np.ndarray], layout: Sequence[str]) -> List[np.ndarray]:
    """The model's arrays from ``pack``'s flat arrays and layout.

    Raises:
        OdtdError: The flat arrays do not hold what the layout says (one line: which and how).
    """
    entries = [_entry(entry) for entry in layout]
    dtypes = list(dict.fromkeys(dtype.str for dtype, _ in entries))
    if len(flat) != len(dtypes):
        raise OdtdError(f"the round's weights hold {len(flat)} packed arrays, its layout "
                        f"{len(dtypes)} dtypes: refused")
    by_dtype = {}
    for dtype, array in zip(dtypes, flat):
        array = np.asarray(array)
        want = sum(int(np.prod(shape)) for d, shape in entries if d.str == dtype)
        if array.dtype.str != dtype or array.ndim != 1 or array.size != want:
            raise OdtdError(f"the round's packed {np.dtype(dtype).name} weights are "
                            f"{array.dtype.name} of shape {array.shape}, the layout says ({want},): "
                            "refused")
        by_dtype[dtype] = (array, [0])
    out = []
    for dtype, shape in entries:
        array, offset = by_dtype[dtype.str]
        size = int(np.prod(shape))
        out.append(array[offset[0]:offset[0] + size].reshape(shape))
        offset[0] += size
    return out


def packed_mask(layout: Sequence[str], chosen: Sequence[bool]) -> List[np.ndarray]:
    """Per packed array (``pack``'s order), True at the elements of the arrays ``chosen`` names.

    ``chosen``: one flag per array of ``layout``, in the model's order.
    """
    entries = [_entry(entry) for entry in layout]
    if len(chosen) != len(entries):
        raise OdtdError(f"{len(chosen)} flags for a layout of {len(entries)} arrays")
    flat, _ = pack([np.full(shape, bool(flag), dtype) for (dtype, shape), flag in zip(entries, chosen)])
    return [array.astype(bool) for array in flat]
