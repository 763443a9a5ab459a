"""Standard-library source documents in Parquet and a byte-level BPE tokenizer trained on them.

    python experiments/examples/hf_lm/prepare.py data/hf_lm [--max-bytes N] [--vocab-size 2048]

Writes under OUT only:

    OUT/train, OUT/val   the documents of ``experiments/examples/stdlib_lm/prepare.py``
                         (the same corpus, cut and split by file the same way): columns
                         ``sample_id`` int64, ``text`` string, ``source`` string
    OUT/tokenizer.json   a ``tokenizers`` byte-level BPE trained on the train split's text
                         only (no val text), ``--vocab-size`` ids in all, of which three
                         are special: ``<|bos|>`` = 0, ``<|eos|>`` = 1, ``<|pad|>`` = 2.
                         Its post-processor wraps every document as BOS ... EOS, so
                         ``Tokenizer.encode`` and ``PreTrainedTokenizerFast`` (the
                         exported model's tokenizer) give the same ids.

Byte-level: every UTF-8 byte is in the base alphabet, so no text is out of vocabulary.
Deterministic on one Python install and one ``tokenizers`` version (the BPE merges are
learned in a fixed order from the same text).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
STDLIB_PREPARE = Path(__file__).resolve().parents[1] / "stdlib_lm" / "prepare.py"


def _stdlib_prepare():
    """The stdlib_lm example's prepare module (loaded from its file: the examples are not
    a package)."""
    spec = importlib.util.spec_from_file_location("stdlib_lm_prepare", STDLIB_PREPARE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"--vocab-size {vocab_size}: need at least {256 + len(SPECIALS)} "
                         "(256 byte symbols and 3 special tokens)")


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` ids (specials first)
    learned from ``texts``; encodings are wrapped as ``<|bos|> ... <|eos|>``.

    Raises:
        ValueError: ``vocab_size`` leaves no room for the 256 byte symbols and the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    _check_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos, eos = (tok.token_to_id(s) for s in SPECIALS[:2])
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", bos), ("<|eos|>", eos)])
    return tok


def prepare(out_dir: str | Path, vocab_size: int = 2048, max_bytes: Optional[int] = None,
            doc_bytes: int = 256, val_fraction: float = 0.05, train_files: int = 8) -> dict:
    """Write the documents and ``OUT/tokenizer.json``. Returns the stdlib_lm summary per
    split plus ``{"tokenizer": {"vocab_size", "tokens_per_byte"}}`` (train split).

    Raises:
        ValueError: a vocabulary too small (checked before anything is written), or a
            split with no documents (raise ``max_bytes``).
    """
    _check_vocab(vocab_size)
    summary = _stdlib_prepare().prepare(out_dir, doc_bytes=doc_bytes, val_fraction=val_fraction,
                                        max_bytes=max_bytes, train_files=train_files)
    texts = pq.read_table(Path(out_dir) / "train", columns=["text"])["text"].to_pylist()
    tok = train_tokenizer(texts, vocab_size)
    path = Path(out_dir) / "tokenizer.json"
    tmp = path.with_suffix(".json.tmp")
    tok.save(str(tmp))
    tmp.replace(path)                      # never a half-written tokenizer at the final name
    n_tokens = sum(len(e.ids) - 2 for e in tok.encode_batch(texts))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    summary["tokenizer"] = {"vocab_size": tok.get_vocab_size(),
                            "tokens_per_byte": n_tokens / max(1, n_bytes)}
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="output directory, e.g. data/hf_lm (git-ignored)")
    p.add_argument("--max-bytes", type=int, default=None, help="cap on text bytes (quick runs)")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary, specials included")
    p.add_argument("--doc-bytes", type=int, default=256, help="longest document, UTF-8 bytes")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--train-files", type=int, default=8)
    a = p.parse_args(argv)
    try:
        s = prepare(a.out_dir, a.vocab_size, a.max_bytes, a.doc_bytes, a.val_fraction, a.train_files)
    except ValueError as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "val"):
        v = s[split]
        print(f"{split}: {v['rows']} documents, {v['bytes']} bytes (median {v['median_bytes']})")
    t = s["tokenizer"]
    print(f"tokenizer: {t['vocab_size']} ids, {t['tokens_per_byte']:.3f} tokens per byte of train text "
          f"-> {Path(a.out_dir) / 'tokenizer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
