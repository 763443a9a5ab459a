"""Built-in classification tasks on a list-of-numbers feature column: ``mlp`` and ``cnn``
(``model.name`` aliases). They use only the public task protocol.

    task:  {kwargs: {feature_column: x, label_column: y, num_classes: 10, input_shape: [1, 8, 8]}}
    model: {name: cnn, kwargs: {hidden: 64, batch_norm: false, dropout: 0.0}}
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from elastic_ddp.tasks.protocol import Column, Task

# torch is imported inside the hooks that need it: Ray Data's transform tasks unpickle
# the task object and so import this module, and a process that never trains should not
# pay torch's import (seconds) before its first batch.


class _Classifier(Task):
    """x: a fixed-length list of numbers per row (pixels), y: an integer class.

    Args (``task.kwargs``):
        feature_column: the list column (``prod(input_shape)`` values per row).
        label_column: the integer label column, 0..num_classes-1.
        num_classes: classes of the head.
        input_shape: shape of one sample, e.g. [1, 8, 8] (C, H, W).
    """

    net = "MLP"

    def __init__(self, feature_column: str = "x", label_column: str = "y",
                 num_classes: int = 10, input_shape: Sequence[int] = (1, 8, 8)):
        if num_classes < 2:
            raise ValueError(f"task.kwargs.num_classes must be >= 2, got {num_classes}")
        self.feature_column, self.label_column = feature_column, label_column
        self.num_classes, self.input_shape = int(num_classes), [int(v) for v in input_shape]

    def input_columns(self):
        n = math.prod(self.input_shape)
        return {
            self.feature_column: Column.list_of(
                "number", length=n,
                hint=f"task.kwargs.input_shape={self.input_shape} needs {n} values per row; "
                     "fix task.kwargs.input_shape"),
            self.label_column: Column.integer(
                min=0, max=self.num_classes - 1,
                hint=f"labels must be 0..{self.num_classes - 1}; raise task.kwargs.num_classes "
                     "or remap the labels"),
        }

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        x = batch[self.feature_column]
        x = np.stack(list(x)) if x.dtype == object else x
        return {"x": torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                "y": torch.from_numpy(np.array(batch[self.label_column], dtype=np.int64))}

    def build_model(self, **kwargs: Any):
        from elastic_ddp.tasks import nets

        return getattr(nets, self.net)(self.input_shape, self.num_classes, **kwargs)

    def loss(self, model, batch):
        import torch.nn.functional as F

        logits = model(batch["x"])
        return (F.cross_entropy(logits, batch["y"], reduction="none"),
                {"acc": (logits.argmax(-1) == batch["y"]).float()})


class MLPClassifier(_Classifier):
    """``model.name: mlp``: two hidden layers (``model.kwargs``: hidden, batch_norm, dropout)."""

    net = "MLP"


class CNNClassifier(_Classifier):
    """``model.name: cnn``: three conv blocks (``model.kwargs``: hidden, batch_norm, dropout)."""

    net = "CNN"
