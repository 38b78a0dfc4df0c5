"""``python -m resilience.projection``: see :mod:`resilience.projection.cli`."""

from resilience.projection.cli import main

if __name__ == "__main__":
    main()
