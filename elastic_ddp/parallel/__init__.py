"""Data-parallel strategies (:mod:`.strategies`: ``ddp``, ``zero1``, ``fsdp``), DDP
communication hooks (:mod:`.comm_hooks`) and BatchNorm across ranks (:mod:`.batchnorm`)."""
