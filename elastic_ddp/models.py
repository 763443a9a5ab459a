"""Model registry: ``mlp`` and ``cnn`` for digits, ``gpt`` (byte-level decoder-only LM).

Each model maps a batch of features to per-sample losses through ``per_sample_loss`` so
the training loop can weight rows exactly (see ``batching``): the loop never calls a
``mean`` reduction itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from elastic_ddp.config import ModelConfig


class MLP(nn.Module):
    """x: [B, prod(input_shape)] float -> logits [B, num_classes]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d_in = math.prod(cfg.input_shape)
        # BatchNorm1d normalises over the batch alone: a 1-row batch cannot be normalised
        # in training mode (the worker's _batchnorm_guard handles that).
        norm = (lambda: nn.BatchNorm1d(cfg.hidden)) if cfg.batch_norm else nn.Identity
        self.net = nn.Sequential(
            nn.Linear(d_in, cfg.hidden), norm(), nn.ReLU(), nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.hidden), norm(), nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """x: [B, C*H*W] float (reshaped to input_shape) -> logits [B, num_classes].

    Two 3x3 conv blocks then global average pooling: small enough for 8x8 digits on a
    CPU core, ~97-99% validation accuracy in a few epochs.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        c, _, _ = cfg.input_shape
        w = cfg.hidden // 2 if cfg.hidden >= 16 else 16
        self.input_shape = tuple(cfg.input_shape)

        def block(cin: int, cout: int) -> nn.Sequential:
            layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1)]
            if cfg.batch_norm:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU())
            return nn.Sequential(*layers)

        self.features = nn.Sequential(block(c, w), block(w, w), nn.MaxPool2d(2),
                                      block(w, 2 * w), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(cfg.dropout),
                                  nn.Linear(2 * w, cfg.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(x.shape[0], *self.input_shape)))


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer (nanoGPT-style, pre-LN, weight-tied head).

    tokens: [B, T] int64 with T <= block_size -> logits [B, T, vocab_size].
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
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


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate ``cfg.name``. Raises ValueError for an unknown name (the config
    validator refuses those earlier)."""
    registry = {"mlp": MLP, "cnn": CNN, "gpt": GPT}
    if cfg.name not in registry:
        raise ValueError(f"model.name={cfg.name!r} unknown; choose one of {sorted(registry)}")
    return registry[cfg.name](cfg)


def per_sample_loss(model: nn.Module, cfg: ModelConfig, x: torch.Tensor,
                    y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass and the loss of each sample.

    Classification: x [B, D] float, y [B] int64 -> (loss [B], correct [B] bool).
    Language model: x [B, T+1] int64 window -> (loss [B] mean nats per token of each
    window, correct [B] = fraction of next-byte predictions right, float).
    """
    if cfg.name == "gpt":
        inp, tgt = x[:, :-1], x[:, 1:]
        logits = model(inp)
        tok_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                   reduction="none").view(tgt.shape)
        acc = (logits.argmax(-1) == tgt).float().mean(1)
        return tok_loss.mean(1), acc
    logits = model(x)
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(-1) == y
