"""MLflow, in one place: every MLflow call of the package is in this package.

- :mod:`~elastic_ddp.tracking.store`: the tracking store, the job's run (open, reopen,
  close), retries of a store that is down, metric names, plain logging calls;
- :mod:`~elastic_ddp.tracking.content`: what a run holds besides metrics (params, tags,
  description, data sets, the logged model);
- :mod:`~elastic_ddp.tracking.tracker`: the job's tracker actor (its record of the job),
  :mod:`~elastic_ddp.tracking.writer` its writer thread, :mod:`~elastic_ddp.tracking.tracker_client`
  the actor's start and the workers' client.

Everything is re-exported here (``from elastic_ddp import tracking; tracking.open_run``).
"""

from elastic_ddp.tracking.store import *  # noqa: F401,F403
from elastic_ddp.tracking.content import *  # noqa: F401,F403
from elastic_ddp.tracking.runs import open_run  # noqa: F401
from elastic_ddp.tracking.tracker import *  # noqa: F401,F403
from elastic_ddp.tracking.tracker_client import *  # noqa: F401,F403
