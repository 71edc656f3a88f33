"""Fail the docs build when a name of a public ``__all__`` is not documented.

Every module listed in ``all_documented_modules`` (conf.py) is imported; each name in its
``__all__`` must be documented by an autodoc directive somewhere in the docs, either under the
module's own path (``coax_utils.utils.argmax``) or under the private module that defines it.
Missing names are reported as Sphinx warnings, which ``-W`` turns into a failed build.
"""

import importlib

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _check(app, env):
    documented = set(env.get_domain("py").objects)
    for modname in app.config.all_documented_modules:
        module = importlib.import_module(modname)
        for name in module.__all__:
            obj = getattr(module, name)
            candidates = {f"{modname}.{name}"}
            defining = getattr(obj, "__module__", None)
            if defining:
                candidates.add(f"{defining}.{getattr(obj, '__qualname__', name)}")
            if not candidates & documented:
                logger.warning(
                    "%s.%s is in __all__ but not documented in the API pages", modname, name
                )
    return []


def setup(app):
    app.add_config_value("all_documented_modules", [], "env")
    app.connect("env-check-consistency", _check)
    return {"parallel_read_safe": True, "version": "1"}
