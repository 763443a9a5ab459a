"""The compat seam: the only place that imports or patches a private or ``_internal`` API
of Ray, Ray Train, torchft, MLflow or torch, or reads what they offer no API for (Ray's
error messages, its head node's reserved resource, a copy of MLflow's store schemes).
Each override says what it buys and carries a version guard; ``versions`` holds the Ray
releases each Ray override was tested on, and on any other the launcher runs stock Ray
Train for that part after one warning line (torch and MLflow: ``TESTED_TORCH``,
``TESTED_MLFLOW``, with each module's fallback).
"""
