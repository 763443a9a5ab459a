"""The task protocol: what a user writes to train their own model on their own Parquet data.

    import elastic_ddp
    from elastic_ddp import Column, Task

    class Digits(Task):
        columns = {"png": Column.binary(), "label": Column.integer(min=0, max=9)}

        def build_model(self, width: int = 32):                 # model.kwargs
            return MyNet(width)

        def transform(self, batch, ctx):                         # Ray Data, CPU, per block
            return {"image": decode_and_augment(batch["png"], ctx.rngs()),
                    "label": batch["label"]}

        def loss(self, model, batch):                            # per-sample loss [B]
            return F.cross_entropy(model(batch["image"]), batch["label"], reduction="none")

    elastic_ddp.train(cfg, task=Digits())     # or task.path: "digits_task.py:Digits" in YAML

The trainer owns everything else: sharding, the exact global-batch weighting, no_sync,
checkpoints, restarts. It never branches on which task it runs; the built-in ``mlp``,
``cnn`` and ``gpt`` (``elastic_ddp.tasks.vision`` / ``.lm``) use nothing a user cannot use.

Data flow of one sample, with shapes (B = rows in a batch):

1. Parquet row -> Ray Data numpy batch: ``{column: np.ndarray [B, ...]}`` for the columns
   in :attr:`Task.columns` plus ``data.id_column`` (int64 [B]). List columns arrive as a
   2-D array when every row has the same length, else as an object array of 1-D arrays;
   binary columns as an object array of ``bytes``.
2. :meth:`Task.transform` (in Ray Data's map tasks, on CPU, one block at a time): decode,
   tokenize, augment. It must return one output row per input row, in the same order
   (the trainer accounts for every sample by position); its randomness must come from
   ``ctx`` so that a restart or a resize reproduces it exactly.
3. :meth:`Task.collate` (in the training process, per micro-batch): numpy -> tensors;
   the default turns integer arrays of any width into int64. The trainer then casts
   every floating tensor to the model's parameter dtype (float64 from NumPy meets
   float32 weights: :func:`model_inputs`), whichever collate made it.
4. :meth:`Task.loss` returns the per-sample loss ``[B]``: the trainer weights it so that
   the optimizer step sees the exact mean over the global batch at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

Kind = Literal["int", "float", "number", "binary", "string", "list", "any"]


@dataclass(frozen=True)
class Column:
    """What a task expects of one Parquet column; the driver-side scan checks every file
    against it before any worker starts and names the file, column and fix on a mismatch.

    Attributes:
        kind: ``int`` / ``float`` / ``number`` (either) scalars, ``binary`` (e.g. encoded
            image bytes), ``string``, ``list`` (a list or fixed-size list per row, e.g.
            pixels or token ids), or ``any`` (only presence is checked).
        inner: for ``list``: the kind of the values (``int``, ``float`` or ``number``).
        length: for ``list``: every row has exactly this many values (None: any length).
        max_length: for ``list``: rows have at most this many values.
        min, max: inclusive bounds of the values (ints and floats; for lists, of their
            values), checked from Parquet footer statistics where the writer stored them.
        nullable: whether nulls (also nulls inside lists) are allowed.
        hint: the fix to suggest when the column does not match (e.g. "set
            task.kwargs.num_classes").
    """

    kind: Kind = "any"
    inner: Optional[Kind] = None
    length: Optional[int] = None
    max_length: Optional[int] = None
    min: Optional[float] = None
    max: Optional[float] = None
    nullable: bool = False
    hint: str = ""

    @classmethod
    def integer(cls, min: Optional[int] = None, max: Optional[int] = None, **kw) -> "Column":
        return cls("int", min=min, max=max, **kw)

    @classmethod
    def floating(cls, **kw) -> "Column":
        return cls("float", **kw)

    @classmethod
    def binary(cls, **kw) -> "Column":
        return cls("binary", **kw)

    @classmethod
    def string(cls, **kw) -> "Column":
        return cls("string", **kw)

    @classmethod
    def list_of(cls, inner: Kind = "number", length: Optional[int] = None,
                max_length: Optional[int] = None, **kw) -> "Column":
        return cls("list", inner=inner, length=length, max_length=max_length, **kw)


@dataclass(frozen=True)
class TransformContext:
    """Where a batch is in the run, for :meth:`Task.transform`.

    Attributes:
        seed: the job's ``seed``.
        epoch: the epoch this block is read for (0-based; validation: the epoch just done).
        split: ``"train"`` or ``"val"`` (augment only on train).
        sample_ids: int64 [B], the rows' ids, in the batch's order.
    """

    seed: int
    epoch: int
    split: str
    sample_ids: np.ndarray

    def rngs(self) -> list[np.random.Generator]:
        """One generator per row, seeded by (seed, epoch, sample_id) alone: the same
        sample in the same epoch gets the same random numbers after any restart or
        resize, whatever block, rank or Ray Data task it lands in. ~10 us per row."""
        return [np.random.default_rng([self.seed, self.epoch, int(i), 0xA06]) for i in self.sample_ids]

    def uniform(self, *shape: int) -> np.ndarray:
        """float64 [B, *shape] uniform in [0, 1), row i from ``rngs()[i]``."""
        return np.stack([g.random(shape) for g in self.rngs()]) if len(self.sample_ids) \
            else np.zeros((0, *shape))


class Task:
    """Base class of a task. Override :meth:`loss` and :meth:`build_model` (or set
    ``model.factory``); the other hooks have working defaults.

    ``task.kwargs`` from the config are passed to the constructor; ``model.kwargs`` to
    :meth:`build_model`. A task object is pickled to the workers and to Ray Data's map
    tasks, so keep large state (weights, vocabularies) out of it or load it lazily.
    """

    #: Parquet columns the task reads (besides ``data.id_column``): name -> Column.
    columns: ClassVar[Mapping[str, Column]] = {}

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{type(self).__name__}() takes no task.kwargs; got {sorted(kwargs)}")

    # -- data ------------------------------------------------------------------------
    def input_columns(self) -> Mapping[str, Column]:
        """The columns to read and check; defaults to :attr:`columns`. Override when they
        depend on ``task.kwargs`` (e.g. a column name or a number of classes)."""
        return self.columns

    def transform(self, batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
        """CPU-side preprocessing in Ray Data (``map_batches``): dict of column arrays
        ``[B, ...]`` in, dict of arrays ``[B, ...]`` out, one output row per input row in
        the same order. Draw random numbers only from ``ctx`` (``ctx.rngs()``). Default:
        identity."""
        return batch

    def collate(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One micro-batch of transformed rows -> tensors (CPU; the trainer moves tensors
        to the device and casts floating ones to the model's parameter dtype,
        :func:`model_inputs`). Default: :func:`default_collate` (integers -> int64)."""
        return default_collate(batch)

    # -- model -----------------------------------------------------------------------
    def build_model(self, **kwargs: Any):
        """The ``torch.nn.Module`` to train, from ``model.kwargs``. Called on every rank
        after ``torch.manual_seed(seed)``, so every rank builds the same weights."""
        raise NotImplementedError(
            f"{type(self).__name__} has no build_model(); define it or set model.factory")

    def loss(self, model, batch: dict[str, Any]):
        """Forward pass and the per-sample loss, float tensor ``[B]`` (no mean: the
        trainer weights rows to get the exact global-batch mean). May return
        ``(loss [B], {name: per-sample metric [B]})``; the metrics are averaged over the
        rows and logged as ``train_<name>``."""
        raise NotImplementedError(f"{type(self).__name__} has no loss()")

    def evaluate(self, model, batch: dict[str, Any]) -> dict[str, Any]:
        """Per-sample validation metrics ``{name: [B]}``; the trainer logs the mean over
        the whole validation split as ``val_<name>``. Default: the loss and the metrics
        :meth:`loss` returns."""
        out = self.loss(model, batch)
        if isinstance(out, tuple):
            loss, extra = out
            return {"loss": loss, **extra}
        return {"loss": out}

    def tokens(self, batch: dict[str, Any]) -> Optional[int]:
        """Tokens in the collated micro-batch ``batch`` (real tokens, padding excluded),
        for a tokens/s figure; None: not a sequence task."""
        return None


def default_collate(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Numeric arrays -> tensors (``torch.from_numpy``, zero-copy where writable).
    Object arrays of equal-shape arrays are stacked first. Integer arrays of any width
    (int8..int32, uint16..uint64: what a Parquet writer chose for labels or token ids)
    become int64, the type PyTorch's losses and embeddings take for class indices, except
    ``uint8`` arrays of 3 or more dimensions (images), kept as they are. Floating arrays
    keep their dtype here; the trainer casts them to the model's parameter dtype
    (:func:`model_inputs`).

    Raises:
        TypeError: a column holds variable-length values or non-numeric data (bytes,
            strings): decode it in ``transform`` or pad it (``pad_sequences``) there or
            in ``collate``.
    """
    import torch

    out: dict[str, Any] = {}
    for name, arr in batch.items():
        arr = np.asarray(arr)
        if arr.dtype == object:
            try:  # equal-shape rows (Ray Data's lists arrive as object arrays of arrays)
                arr = np.array(arr.tolist()) if len(arr) else np.zeros((0,), np.float32)
            except ValueError:
                arr = np.empty(0, dtype=object)
            if arr.dtype == object:
                raise TypeError(
                    f"column {name!r} has variable-length or non-numeric values; decode/pad "
                    "it in Task.transform or Task.collate (elastic_ddp.tasks.pad_sequences)")
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise TypeError(f"column {name!r} has dtype {arr.dtype}; convert it to numbers in "
                            "Task.transform or override Task.collate")
        if np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.int64 \
                and not (arr.dtype == np.uint8 and arr.ndim >= 3):
            arr = arr.astype(np.int64)
        out[name] = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return out


def parameter_dtype(model) -> Any:
    """The one floating dtype of ``model``'s parameters (``torch.float32`` for most
    models), or None when it has none or several (then inputs are not cast)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def model_inputs(tensors: dict[str, Any], device, dtype=None) -> dict[str, Any]:
    """What :meth:`Task.loss` receives: the collated tensors on ``device``, floating ones
    cast to ``dtype`` (the model's parameter dtype, :func:`parameter_dtype`), so a
    transform's float64 output (NumPy's default) meets float32 weights. Integer and
    bool tensors keep their dtype; anything else passes through."""
    import torch

    out = {}
    for k, v in tensors.items():
        if torch.is_tensor(v):
            cast = dtype if dtype is not None and v.is_floating_point() and v.dtype != dtype else None
            if cast is not None or v.device != torch.device(device):
                v = v.to(device=device, dtype=cast, non_blocking=True)
        out[k] = v
    return out


def pad_sequences(seqs: Sequence[np.ndarray], pad_value: int | float = 0,
                  max_len: Optional[int] = None, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad 1-D sequences to one length.

    Args:
        seqs: B arrays of shape [T_i].
        pad_value: value of the padding.
        max_len: pad (and truncate) to this length; default max T_i (at least 1).
        dtype: output dtype (default: the first sequence's, else int64).

    Returns:
        (padded [B, T], mask [B, T] bool, True on real tokens).
    """
    b = len(seqs)
    t = max_len if max_len is not None else max([len(s) for s in seqs] + [1])
    dt = dtype or (np.asarray(seqs[0]).dtype if b else np.int64)
    out = np.full((b, t), pad_value, dtype=dt)
    mask = np.zeros((b, t), dtype=bool)
    for i, s in enumerate(seqs):
        n = min(len(s), t)
        out[i, :n] = np.asarray(s)[:n]
        mask[i, :n] = True
    return out, mask


def split_loss(out, n: int) -> tuple[torch.Tensor, dict]:
    """``Task.loss``'s return as (loss [B], {name: [B]}).

    Raises:
        ValueError: the loss is not a per-sample vector of ``n`` values.
    """
    import torch

    loss, extra = out if isinstance(out, tuple) else (out, {})
    if not torch.is_tensor(loss) or loss.dim() != 1 or loss.shape[0] != n:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"Task.loss must return the per-sample loss, shape [{n}], got {shape} "
                         "(use reduction='none' and average over tokens within a sample)")
    return loss, extra
