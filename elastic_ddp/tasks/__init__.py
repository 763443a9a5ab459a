"""Tasks: the user's model, loss and data transform (see :mod:`elastic_ddp.tasks.protocol`),
the built-in ``mlp``/``cnn``/``gpt`` tasks, and loading a task from the config."""

from elastic_ddp.tasks.protocol import Column, Task, TransformContext, default_collate, pad_sequences

__all__ = ["Column", "Task", "TransformContext", "default_collate", "pad_sequences"]
