"""``python -m resilience.projection``: see :mod:`resilience.projection.cli`."""

from resilience.projection.cli import cli

if __name__ == "__main__":
    cli()
