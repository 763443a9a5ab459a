"""What runs inside Ray Train's controller actor: the run's callbacks (:mod:`.events`) and
failure classification (:mod:`.failures`).

Imports neither torch nor MLflow (an import there would sit between a failure and the
restart); the import contracts in ``pyproject.toml`` enforce it.
"""
