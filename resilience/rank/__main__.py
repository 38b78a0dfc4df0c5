"""``python -m resilience.rank RUN_DIR/config.yaml``: one rank process (started by a supervisor or torchrun)."""

import sys

from resilience.rank.main import main

if __name__ == "__main__":  # the guard matters: a process-based checkpoint executor re-imports __main__
    main(sys.argv)
