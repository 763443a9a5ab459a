"""The driver: the process that runs ``elastic-ddp`` (or ``ray job submit``'s entrypoint).

It checks every input before anything starts (:mod:`.preflight`, exit 2), opens the job's
MLflow run, builds and runs Ray Train's ``TorchTrainer`` (:mod:`.launcher`), and closes the
job (:mod:`.finish`, :mod:`.report`). Also the scaling sweep and job submission.
"""
