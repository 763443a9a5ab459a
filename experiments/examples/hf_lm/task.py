"""A Hugging Face ``transformers`` causal LM trained through the task protocol: a GPT-2
built from a config (no hub download), a BPE tokenizer trained by ``prepare.py``, the
per-document loss computed from the logits with the padding mask.

    task.path: experiments/examples/hf_lm/task.py:HFCausalLM

Tokens: ``OUT/tokenizer.json`` (``prepare.py``) wraps every document as
``<|bos|> ids... <|eos|>`` (BOS = 0, EOS = 1); ``<|pad|>`` = 2 fills a micro-batch to its
longest document. A document of n BPE tokens is n + 2 ids; the model reads ids[:-1] and
predicts ids[1:]: the n tokens and the EOS.

Data flow of one micro-batch (B documents, T = longest n + 2 in the micro-batch):

    Parquet         sample_id int64, text string
    Ray Data batch  {"sample_id": int64 [B], "text": object [B] of str}
    transform ->    {"ids": object [B] of int32 [n_i + 2], "n_bytes": int64 [B]}  (ragged)
    collate   ->    {"ids": torch.int64 [B, T] (PAD after the EOS),
                     "mask": torch.bool [B, T] (True on the n_i + 2 real ids),
                     "n_bytes": torch.int64 [B] (UTF-8 bytes of the document)}
    loss      ->    (mean nats over each document's n_i + 1 predicted ids, float32 [B],
                     {"acc": next-token accuracy over the same ids, float32 [B]})

Why a per-sample loss from the logits: ``GPT2LMHeadModel(labels=...)`` returns one mean
over every token of the micro-batch, which weighs a document by its length and cannot
be re-weighted into the exact global-batch mean at another world size. The model is
called without labels; its ``logits`` [B, T-1, V] give the token losses, the mask drops
the padded targets, and each document's loss is the mean over its own tokens. The
attention mask is the same padding mask: with right padding and causal attention no
real token sees a pad, so a document's loss does not depend on its micro-batch's padding
(``tests/e2e/examples/test_example_hf.py`` checks it).

Precision: the forward runs under bf16 autocast on a CUDA device that supports bf16
(``task.kwargs.bf16: true``, the default); on CPU autocast is off (float32). Logits are
cast to float32 before the cross-entropy either way.

The tokenizer travels inside the task object (its JSON text, ~125 kB at 2,048 ids, read
on the driver from ``task.kwargs.tokenizer``), so no Ray worker or map task reads a path
of the driver's machine; the ``tokenizers.Tokenizer`` is rebuilt lazily in each process.

This file is the whole task: the library ships it to the Ray workers by value.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from elastic_ddp import Column, Task, TransformContext, pad_sequences

BOS, EOS, PAD = 0, 1, 2


class HFCausalLM(Task):
    """A ``transformers`` GPT-2 language model on documents of different lengths.

    ``task.kwargs``: ``tokenizer`` (path of ``prepare.py``'s ``tokenizer.json``),
    ``max_tokens`` (a document is cut to this many BPE tokens; the model's context is
    ``max_tokens + 2``), ``column`` (the text column), ``bf16`` (autocast where the
    device has bf16).
    ``model.kwargs``: ``dim``, ``layers``, ``heads``, ``dropout`` (see :meth:`build_model`).

    Raises:
        ValueError: the tokenizer file is missing or is not this example's (its special
            tokens are not BOS = 0, EOS = 1, PAD = 2), or ``max_tokens < 1``.
    """

    def __init__(self, tokenizer: str = "data/hf_lm/tokenizer.json", max_tokens: int = 256,
                 column: str = "text", bf16: bool = True):
        if max_tokens < 1:
            raise ValueError(f"task.kwargs.max_tokens must be >= 1, got {max_tokens}")
        path = Path(tokenizer).expanduser()
        if not path.is_file():
            raise ValueError(f"task.kwargs.tokenizer: {path} is not a file; run "
                             "experiments/examples/hf_lm/prepare.py or set task.kwargs.tokenizer")
        self.tokenizer_json = path.read_text()
        self.max_tokens, self.column, self.bf16 = int(max_tokens), column, bool(bf16)
        self._tok = None
        tok = self.tokenizer()
        got = [tok.token_to_id(s) for s in ("<|bos|>", "<|eos|>", "<|pad|>")]
        if got != [BOS, EOS, PAD]:
            raise ValueError(f"task.kwargs.tokenizer: {path} has special ids {got}, expected "
                             f"[{BOS}, {EOS}, {PAD}]; write it with experiments/examples/hf_lm/prepare.py")
        self.vocab_size = tok.get_vocab_size()

    def __getstate__(self) -> dict:
        # The Rust tokenizer is rebuilt from its JSON in each process that unpickles us.
        return {**self.__dict__, "_tok": None}

    def tokenizer(self):
        """The ``tokenizers.Tokenizer``, truncating to ``max_tokens + 2`` ids (BOS and
        EOS kept), built once per process."""
        if self._tok is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self.tokenizer_json)
            tok.enable_truncation(self.max_tokens + 2)
            self._tok = tok
        return self._tok

    # -- data ------------------------------------------------------------------------
    def input_columns(self):
        return {self.column: Column.string(hint="run experiments/examples/hf_lm/prepare.py "
                                                "or set task.kwargs.column")}

    def transform(self, batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
        # No randomness: the same text always gives the same ids. encode_batch runs in
        # Rust over the block (its thread pool: TOKENIZERS_PARALLELISM=false pins it to one).
        texts = [str(t) for t in batch[self.column]]
        ids = np.empty(len(texts), dtype=object)
        for i, enc in enumerate(self.tokenizer().encode_batch(texts)):
            ids[i] = np.asarray(enc.ids, dtype=np.int32)
        n_bytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
        return {"ids": ids, "n_bytes": n_bytes}

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        ids, mask = pad_sequences(list(batch["ids"]), pad_value=PAD, dtype=np.int64)
        return {"ids": torch.from_numpy(ids), "mask": torch.from_numpy(mask),
                "n_bytes": torch.as_tensor(np.asarray(batch["n_bytes"], dtype=np.int64))}

    # -- model -----------------------------------------------------------------------
    def build_model(self, dim: int = 128, layers: int = 2, heads: int = 4,
                    dropout: float = 0.0):
        """``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (random init, tied
        embeddings, learned positions up to ``max_tokens + 2``)."""
        from transformers import GPT2Config, GPT2LMHeadModel

        if dim % heads:
            raise ValueError(f"model.kwargs.dim={dim} must be divisible by heads={heads}")
        config = GPT2Config(vocab_size=self.vocab_size, n_positions=self.max_tokens + 2,
                            n_embd=dim, n_layer=layers, n_head=heads, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=BOS,
                            eos_token_id=EOS, pad_token_id=PAD)
        return GPT2LMHeadModel(config)

    def autocast_enabled(self, device: torch.device) -> bool:
        """bf16 autocast for this device: on CUDA where bf16 is supported; never on CPU."""
        return self.bf16 and device.type == "cuda" and torch.cuda.is_bf16_supported()

    def _token_nll(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(nats [B, T-1], correct [B, T-1] bool, target mask [B, T-1] float)."""
        ids, mask = batch["ids"], batch["mask"]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16,
                            enabled=self.autocast_enabled(ids.device)):
            logits = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1].long()).logits
        logits = logits.float()
        target = ids[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                              reduction="none").view(target.shape)
        return nll, logits.argmax(-1) == target, mask[:, 1:].float()

    def loss(self, model, batch):
        nll, correct, m = self._token_nll(model, batch)
        n = m.sum(1).clamp_min(1.0)                      # predicted ids: tokens + EOS
        return (nll * m).sum(1) / n, {"acc": (correct.float() * m).sum(1) / n}

    def evaluate(self, model, batch) -> dict[str, Any]:
        """Per document: ``loss`` (nats per predicted id), ``acc``, ``bpb`` (its summed
        nats over its UTF-8 bytes / ln 2: comparable across tokenizers), ``nats`` and
        ``bytes`` (``val_nats / (val_bytes * ln 2)`` is the corpus bits per byte)."""
        nll, correct, m = self._token_nll(model, batch)
        n = m.sum(1).clamp_min(1.0)
        nats = (nll * m).sum(1)
        n_bytes = batch["n_bytes"].to(nats.dtype).clamp_min(1.0)
        return {"loss": nats / n, "acc": (correct.float() * m).sum(1) / n,
                "bpb": nats / (n_bytes * math.log(2)), "nats": nats, "bytes": n_bytes}

    def tokens(self, batch) -> Optional[int]:
        # Real predicted ids of the micro-batch (padding excluded), for tokens/s.
        return int(batch["mask"][:, 1:].sum())
