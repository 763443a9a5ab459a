"""torch internals the worker uses.

- :data:`BatchNormBase`: ``torch.nn.modules.batchnorm._BatchNorm``, the common base of
  ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` (torch has no public one). It buys one
  ``isinstance`` test that finds every BatchNorm layer of a user's model, and the base
  :class:`~elastic_ddp.parallel.batchnorm.GlobalBatchNorm` extends. Present in every torch
  release this project supports (``torch>=2.4``); where it is gone, the tuple of the public
  classes serves the ``isinstance`` tests, and ``GlobalBatchNorm`` extends ``BatchNorm1d``'s
  base the same way.
"""

from __future__ import annotations

import torch

try:
    from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
except ImportError:  # pragma: no cover - a torch without the private base
    BatchNormBase = torch.nn.BatchNorm1d.__mro__[1]

__all__ = ["BatchNormBase"]
