"""User code found by name: the modules that register metrics and rewards (``reward.plugins`` and the
``rlt2t.plugins`` entry points of installed packages), and ``package.module:function`` paths.

    load_plugins(["mypkg.metrics"])            # imports it, and every installed rlt2t.plugins entry point
    fn = import_object("mypkg.rewards:brevity", "reward.terms[0].fn")

Every process that builds a reward or a metric calls :func:`load_plugins` first (the Ray reward workers, the
reward server, predict, eval): a ``@register_metric`` that runs only in the process that started a job is
unknown to a worker's fresh interpreter. On a cluster the modules must be importable on every node: ship them
with the job's runtime environment (``ray job submit --working-dir`` or ``py_modules``). An entry point names
a module (imported) or a function (called with no arguments):

    [project.entry-points."rlt2t.plugins"]
    mymetrics = "mypkg.metrics"
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from rlt2t.common.config import ConfigError

log = logging.getLogger("rlt2t.plugins")

ENTRY_POINT_GROUP = "rlt2t.plugins"

_entry_points_loaded = False


def _import(module: str, where: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import module {module!r}: {e} (it must be importable where the reward "
                          "is scored: on the Python path, or shipped with the job's working_dir / py_modules)") from e


def import_object(path: str, where: str) -> Any:
    """The object ``package.module:name`` names (``name`` may be dotted: ``Class.method``); ConfigError naming
    ``where`` and the path when the module does not import or has no such name."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{where}: {path!r} is not a `package.module:function` path")
    obj = _import(module, f"{where} {path!r}")
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{where}: {path!r}: module {module!r} has no attribute {name!r}") from None
    return obj


def load_plugins(modules: Sequence[str] = (), where: str = "reward.plugins") -> None:
    """Import ``modules`` (ConfigError naming ``where[i]`` when one does not import), after the installed
    ``rlt2t.plugins`` entry points (loaded once per process)."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = ep.load()
            except Exception as e:
                raise ConfigError(f"entry point {ep.name} = {ep.value!r} ({ENTRY_POINT_GROUP}, package "
                                  f"{ep.dist.name if ep.dist else '?'}): {type(e).__name__}: {e}") from e
            if callable(loaded):
                loaded()
            log.debug("plugin entry point %s = %s loaded", ep.name, ep.value)
    for i, module in enumerate(modules):
        _import(module, f"{where}[{i}]")
