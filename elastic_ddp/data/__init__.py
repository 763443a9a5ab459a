"""The data layer: prepare real Parquet data sets and check them before training.

* :mod:`elastic_ddp.data.prepare` writes scikit-learn's digits (classification) and a
  byte-level corpus of the Python standard library (language modelling) as Parquet.
* :mod:`elastic_ddp.data.scan` checks a Parquet data set on the driver, before any
  worker starts, and returns its sorted sample ids: the ledger of what there is to
  consume. Problems raise :class:`~elastic_ddp.data.scan.DataError` naming the file,
  the column and the fix.
"""

from elastic_ddp.data.prepare import prepare_digits, prepare_pycode
from elastic_ddp.data.scan import DataError, DatasetInfo, scan_parquet

__all__ = ["DataError", "DatasetInfo", "prepare_digits", "prepare_pycode", "scan_parquet"]
