"""The networks of the built-in tasks: ``MLP`` and ``CNN`` for small images, ``GPT``
(byte-level decoder-only LM). Plain ``nn.Module``s with keyword-argument constructors, as
a user's own model would be.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """x: [B, prod(input_shape)] float -> logits [B, num_classes]."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 128,
                 batch_norm: bool = False, dropout: float = 0.0):
        super().__init__()
        d_in = math.prod(input_shape)
        # BatchNorm1d normalises over the batch alone: a 1-row batch cannot be normalised
        # in training mode (the trainer's BatchNorm guard handles that).
        norm = (lambda: nn.BatchNorm1d(hidden)) if batch_norm else nn.Identity
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), norm(), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), norm(), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """x: [B, C*H*W] or [B, C, H, W] float -> logits [B, num_classes].

    Two 3x3 conv blocks, a max-pool, a third block, global average pooling: small enough
    for 8x8 digits on a CPU core, ~97-99% validation accuracy in a few epochs.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 64,
                 batch_norm: bool = False, dropout: float = 0.0):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"cnn needs input_shape [C, H, W], got {list(input_shape)}")
        c = input_shape[0]
        w = hidden // 2 if hidden >= 16 else 16
        self.input_shape = tuple(input_shape)

        def block(cin: int, cout: int) -> nn.Sequential:
            layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1)]
            if batch_norm:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU())
            return nn.Sequential(*layers)

        self.features = nn.Sequential(block(c, w), block(w, w), nn.MaxPool2d(2),
                                      block(w, 2 * w), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * w, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(x.shape[0], *self.input_shape)))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer (nanoGPT-style, pre-LN, weight-tied head).

    tokens: [B, T] int64 with T <= block_size -> logits [B, T, vocab_size].

    Raises:
        ValueError: ``n_embd`` not divisible by ``n_head`` (names both and a divisor).
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 128, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            divisors = [d for d in range(1, n_embd + 1) if n_embd % d == 0]
            near = min(divisors, key=lambda d: abs(d - n_head))
            raise ValueError(f"model.kwargs.n_embd ({n_embd}) must be divisible by "
                             f"model.kwargs.n_head ({n_head}); pick e.g. n_head={near}")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
