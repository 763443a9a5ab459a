"""A user task module (its source text) whose data path is slower than its step: the
digits CNN whose training transform sleeps per row and whose loss sleeps per step. A
test writes it into a file and names it in ``task.path``."""

SLOW_TASK = """
    import time

    from elastic_ddp.tasks.vision import CNNClassifier


    class SlowDigits(CNNClassifier):
        '''The built-in digits CNN whose training transform sleeps: a data path slower
        than the step (a decoder too slow for the accelerator).'''

        def __init__(self, sleep_per_row: float = 0.0, sleep_per_loss: float = 0.0, **kw):
            super().__init__(**kw)
            self.sleep_per_row = float(sleep_per_row)
            self.sleep_per_loss = float(sleep_per_loss)

        def transform(self, batch, ctx):
            if ctx.split == "train":
                time.sleep(self.sleep_per_row * len(ctx.sample_ids))
            return super().transform(batch, ctx)

        def loss(self, model, batch):
            time.sleep(self.sleep_per_loss)  # a step of a few tens of ms, as on an accelerator
            return super().loss(model, batch)
"""
