"""A role built from its resolved config node (``_target_`` and its settings), as Hydra's ``instantiate`` builds
it, without importing Hydra where it need not: a rank builds its roles at every start, a replacement's cold one
included, and Hydra's import (its config store, grammar, ``hydra.conf``) is on that start's critical path.

The direct way takes our own classes (``resilience.``, ``injectors.``) whose settings are plain values, the node
as the supervisor wrote it; anything else (a nested ``_target_``, a list, ``_args_``, ``_recursive_``,
``_convert_``, another package's target) goes to Hydra, whose rules it then follows."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from omegaconf import DictConfig

OWN = ("resilience.", "injectors.")
PLAIN = (str, int, float, bool, type(None))
HYDRA_KEYS = ("_args_", "_recursive_", "_convert_")


def instantiate(node: DictConfig, **settings: Any) -> Any:
    """``hydra.utils.instantiate(node, **settings)``: the role, or with ``_partial_=True`` its constructor."""
    target = node.get("_target_")
    partial = bool(settings.pop("_partial_", node.get("_partial_", False)))
    kwargs = {k: v for k, v in node.items() if k not in ("_target_", "_partial_")}
    kwargs.update(settings)
    if not _direct(target, kwargs):
        from hydra.utils import instantiate as hydra_instantiate

        return hydra_instantiate(node, _partial_=partial, **settings) if partial else \
            hydra_instantiate(node, **settings)
    module, _, name = target.rpartition(".")
    built = getattr(importlib.import_module(module), name)
    return functools.partial(built, **kwargs) if partial else built(**kwargs)


def _direct(target: Any, kwargs: dict[str, Any]) -> bool:
    return (isinstance(target, str) and target.startswith(OWN) and not any(k in kwargs for k in HYDRA_KEYS)
            and all(isinstance(v, PLAIN) for v in kwargs.values()))
