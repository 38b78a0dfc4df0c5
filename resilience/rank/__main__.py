"""``python -m resilience.rank RUN_DIR/config.yaml``: one rank process (started by a supervisor or torchrun)."""

import sys

from resilience.record.quick_exit import exit_code, exit_now
from resilience.rank.main import main

if __name__ == "__main__":  # the guard matters: a process-based checkpoint executor re-imports __main__
    try:
        main(sys.argv)
    except SystemExit as exc:  # the rank's own verdict (recovery requested, failure): its events are on disk
        exit_now(exit_code(exc))
    # The supervisor waits for this process to end before the run ends: skip the interpreter's teardown
    # (resilience.record.quick_exit). An exception escaping main exits the ordinary way, with its traceback.
    exit_now(0)
