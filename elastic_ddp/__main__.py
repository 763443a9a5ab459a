"""``python -m elastic_ddp ...``: the ``elastic-ddp`` command."""

from elastic_ddp.driver.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
