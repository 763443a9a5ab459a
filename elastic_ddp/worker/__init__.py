"""What runs on every rank: the Ray Train entry function (:mod:`.entry`), the
:class:`~elastic_ddp.worker.trainer.Trainer` and its parts.
"""
