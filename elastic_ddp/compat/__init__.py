"""The compat seam: the only place that imports or patches a private or ``_internal`` API
of Ray, Ray Train, torchft, MLflow or torch. Each override says what it buys and carries a
version guard; ``versions`` holds the Ray releases each Ray override was tested on, and on
any other the launcher runs stock Ray Train for that part after one warning line.
"""
