"""``python -m resilience.result RUN_DIR``: recompute a run's ``result.json`` from its own files."""

import sys

from resilience.record.result import main

if __name__ == "__main__":
    main(sys.argv)
