"""Tasks: the user's model, loss and data transform (see :mod:`elastic_ddp.tasks.protocol`),
the built-in ``mlp``/``cnn``/``gpt`` tasks, loading a task from the config (``loading``)
and its dry run on two real rows (``dry_run``)."""

from elastic_ddp.tasks.protocol import Column, Task, TransformContext, default_collate, pad_sequences

__all__ = ["Column", "Task", "TransformContext", "default_collate", "pad_sequences"]
