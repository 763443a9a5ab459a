"""Naming the tensor behind a dtype error of the dry run (``tasks.dry_run.preflight``).

The trainer casts floating inputs to the model's parameter dtype and the default collate
turns integers of any width into int64 (``tasks.protocol``); what is left is a tensor of
the wrong kind: integer features where the weights are float, or float class labels or
token ids. PyTorch's message names neither the batch key nor the Parquet column.
"""

from __future__ import annotations

import re

import numpy as np


def passed_through(raw: dict, rows: dict) -> dict[str, str]:
    """Transform output key -> the Parquet column it passes through unchanged (a label
    renamed ``y`` -> ``label``), for error messages; computed keys are left out."""
    out = {}
    for k, v in rows.items():
        for c, col in sorted(raw.items(), key=lambda item: item[0] != k):  # same name first
            try:
                if np.asarray(v).shape == np.asarray(col).shape and np.array_equal(v, col):
                    out[k] = c
                    break
            except (TypeError, ValueError):
                continue
    return out


# PyTorch's words for "an index tensor (class label, token id) arrived as floats" and for
# "an input arrived as integers (or another float width) where the weights are float".
_WANTS_INDEX = re.compile(r"target dtype to be Long|scalar types: Long, Int|expected scalar type Long")
_WANTS_FLOAT = re.compile(r"must have the same dtype|Input type \(.*\) and (weight|bias) type|"
                          r"expected scalar type (Float|Double|Half|BFloat16)|"
                          r"found (Long|Int|Short|Byte|Char)\b")


def dtype_hint(e: BaseException, tensors: dict, dtype, sources: dict) -> str:
    """For a loss that failed on a dtype: which tensor (its key, dtype and shape, and the
    Parquet column it came from, ``sources``) and the fix; "" for any other error."""
    import torch

    text = str(e)
    wants_index = bool(_WANTS_INDEX.search(text))
    if not wants_index and not _WANTS_FLOAT.search(text):
        return ""
    ts = {k: v for k, v in tensors.items() if torch.is_tensor(v)}
    if wants_index:
        floats = [k for k, v in ts.items() if v.is_floating_point()]
        suspects = [k for k in floats if ts[k].dim() == 1] or floats
        fix = "class labels and token ids must be integers: cast it in Task.transform (.astype(np.int64))"
    else:
        ints = [k for k, v in ts.items() if not v.is_floating_point()]
        suspects = [k for k in ints if ts[k].dim() >= 2] or ints
        fix = (f"the model's parameters are {str(dtype).replace('torch.', '') if dtype else 'floating'}"
               " and floating inputs are cast to that dtype, integer ones are not: make it float in "
               "Task.transform (.astype(np.float32)) or Task.collate")
    if not suspects:
        return ""
    def where(k: str) -> str:
        v = ts[k]
        src = f"from Parquet column {sources[k]!r}" if k in sources else "computed by Task.transform"
        return f"tensor {k!r} ({str(v.dtype).replace('torch.', '')} {list(v.shape)}, {src})"

    return f"; {', '.join(where(k) for k in suspects)}: {fix}"
