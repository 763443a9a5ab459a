"""A user task on variable-length text: byte tokens in Ray Data, padding and a masked
per-document loss in the trainer, a user-defined causal transformer.

    task.path: experiments/examples/stdlib_lm/task.py:StdlibLM

Tokens: the document's UTF-8 bytes are ids 0..255; BOS = 256 starts it, EOS = 257 ends
it, PAD = 258 fills a micro-batch to its longest document (vocabulary 259). A document
of n bytes is n + 2 tokens; the model reads tokens[:-1] and predicts tokens[1:]: the n
bytes and the EOS.

Data flow of one micro-batch (B documents, T = longest n + 2 in the micro-batch):

    Parquet         sample_id int64, text string
    Ray Data batch  {"sample_id": int64 [B], "text": object [B] of str}
    transform ->    {"tokens": object [B] of int16 [n_i + 2]}       (ragged: no padding yet)
    collate   ->    {"tokens": torch.int64 [B, T] (PAD after the EOS),
                     "mask":   torch.bool  [B, T] (True on the n_i + 2 real tokens)}
    loss      ->    (mean nats over each document's n_i + 1 predicted tokens, float32 [B],
                     {"acc": next-token accuracy over the same tokens, float32 [B]})

Why pad in collate and not in transform: a Ray Data block holds documents of many
micro-batches; padding per micro-batch wastes less and keeps transform row-local.
Causal attention never lets a real token see the padding that follows it, and the loss
masks the padded targets, so a document's loss does not depend on how much padding its
micro-batch has (``tests/e2e/examples/test_examples.py`` checks it).

The per-sample loss is a per-document mean, so the trainer's global-batch mean weighs
every document equally, whatever its length (the protocol's unit is the sample).
Validation also reports ``bpb``, each document's bits per byte, and ``nats`` and
``bytes`` (its summed loss and byte count): ``val_nats / (val_bytes * ln 2)`` is the
corpus-level bits per byte (every byte weighted equally).

This file is the whole task: the library ships it to the Ray workers by value.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from elastic_ddp import Column, Task, TransformContext, pad_sequences

BOS, EOS, PAD = 256, 257, 258
VOCAB = 259


def tokenize(text: str, max_bytes: int) -> np.ndarray:
    """str -> int16 [n + 2]: BOS, the first ``max_bytes`` UTF-8 bytes, EOS."""
    body = np.frombuffer(text.encode("utf-8")[:max_bytes], dtype=np.uint8)
    return np.concatenate([[BOS], body, [EOS]]).astype(np.int16)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """Token ids int64 [B, T] -> logits float32 [B, T, vocab]; learned positions up to
    ``context`` tokens, embedding and output weights tied."""

    def __init__(self, vocab: int, context: int, dim: int = 128, layers: int = 2,
                 heads: int = 4, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.kwargs.dim={dim} must be divisible by heads={heads}")
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():                    # GPT-2 init: small weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens exceed the model's context {self.context}")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class StdlibLM(Task):
    """Byte-level language model on documents of different lengths.

    ``task.kwargs``: ``max_bytes`` (documents are cut to this many bytes in transform;
    the model's context is ``max_bytes + 1``), ``column`` (the text column).
    ``model.kwargs``: dim, layers, heads, dropout (see :class:`TinyCausalLM`).
    """

    def __init__(self, max_bytes: int = 256, column: str = "text"):
        if max_bytes < 1:
            raise ValueError(f"task.kwargs.max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes, self.column = int(max_bytes), column

    def input_columns(self):
        return {self.column: Column.string(hint="run experiments/examples/stdlib_lm/prepare.py "
                                                "or set task.kwargs.column")}

    def transform(self, batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
        # No randomness: the same text always gives the same tokens.
        out = np.empty(len(batch[self.column]), dtype=object)
        for i, text in enumerate(batch[self.column]):
            out[i] = tokenize(text, self.max_bytes)
        return {"tokens": out}

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        tokens, mask = pad_sequences(list(batch["tokens"]), pad_value=PAD, dtype=np.int64)
        return {"tokens": torch.from_numpy(tokens), "mask": torch.from_numpy(mask)}

    def build_model(self, dim: int = 128, layers: int = 2, heads: int = 4,
                    dropout: float = 0.0) -> nn.Module:
        return TinyCausalLM(VOCAB, self.max_bytes + 1, dim, layers, heads, dropout)

    def _token_nll(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(nats [B, T-1], correct [B, T-1] bool, target mask [B, T-1] float)."""
        tokens, mask = batch["tokens"], batch["mask"]
        logits = model(tokens[:, :-1])
        target = tokens[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                              reduction="none").view(target.shape)
        return nll, logits.argmax(-1) == target, mask[:, 1:].float()

    def loss(self, model, batch):
        nll, correct, m = self._token_nll(model, batch)
        n = m.sum(1).clamp_min(1.0)                      # predicted tokens: bytes + EOS
        return (nll * m).sum(1) / n, {"acc": (correct.float() * m).sum(1) / n}

    def evaluate(self, model, batch) -> dict[str, Any]:
        nll, correct, m = self._token_nll(model, batch)
        n = m.sum(1).clamp_min(1.0)
        nats = (nll * m).sum(1)
        n_bytes = (n - 1.0).clamp_min(1.0)               # the EOS is no byte of the text
        return {"loss": nats / n, "acc": (correct.float() * m).sum(1) / n,
                "bpb": nats / (n_bytes * math.log(2)), "nats": nats, "bytes": n_bytes}

    def tokens(self, batch) -> Optional[int]:
        # Real predicted tokens of the micro-batch (padding excluded): the trainer sums
        # them over micro-batches and ranks for an exact tokens/s.
        return int(batch["mask"][:, 1:].sum())
