"""The compat seam: the only place that imports or patches a private or ``_internal`` API
of Ray, Ray Train, torchft, MLflow or torch. Each override says what it buys and carries a
version guard.
"""
