"""Built-in byte-level language modelling task: ``gpt`` (``model.name`` alias). Uses only the
public task protocol.

    task:  {kwargs: {column: x, vocab_size: 256, block_size: 128}}
    model: {name: gpt, kwargs: {n_layer: 2, n_head: 4, n_embd: 128, dropout: 0.0}}

Each row is a window of ``T + 1`` token ids; the model reads ``x[:-1]`` and predicts
``x[1:]``. Validation reports bits per byte (``val_bpb`` = nats per token / ln 2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from elastic_ddp.tasks.protocol import Column, Task


class ByteGPT(Task):
    """Args (``task.kwargs``):
        column: the list-of-ints column holding each window (token ids < vocab_size).
        vocab_size: token ids are 0..vocab_size-1 (256 for bytes).
        block_size: context length; windows have at most block_size + 1 tokens.
    """

    def __init__(self, column: str = "x", vocab_size: int = 256, block_size: int = 128):
        self.column, self.vocab_size, self.block_size = column, int(vocab_size), int(block_size)

    def input_columns(self):
        return {self.column: Column.list_of(
            "int", max_length=self.block_size + 1, min=0, max=self.vocab_size - 1,
            hint=f"windows need at most task.kwargs.block_size+1={self.block_size + 1} tokens "
                 f"with ids below task.kwargs.vocab_size={self.vocab_size}; raise them or "
                 "re-prepare the data")}

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        x = batch[self.column]
        x = np.stack(list(x)) if x.dtype == object else x
        return {"tokens": torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))}

    def build_model(self, **kwargs: Any):
        from elastic_ddp.tasks.nets import GPT  # torch only where a model is built

        return GPT(vocab_size=self.vocab_size, block_size=self.block_size, **kwargs)

    def loss(self, model, batch):
        import torch.nn.functional as F

        tokens = batch["tokens"]
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        logits = model(inp)
        tok_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                   reduction="none").view(tgt.shape)
        # Mean nats per token of each window: the per-sample loss.
        return tok_loss.mean(1), {"acc": (logits.argmax(-1) == tgt).float().mean(1)}

    def evaluate(self, model, batch):
        loss, extra = self.loss(model, batch)
        return {"loss": loss, **extra, "bpb": loss / math.log(2)}

    def tokens(self, batch):
        b, t = batch["tokens"].shape
        return b * (t - 1)  # predicted positions
