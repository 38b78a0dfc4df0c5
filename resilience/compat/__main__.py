"""``python -m resilience.compat > docs/compatibility.md``."""

from resilience.compat.render import render

print(render())
