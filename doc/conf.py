"""Sphinx configuration for coax_utils (built with -W --keep-going; no network access)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("_ext"))
os.environ.setdefault("MUJOCO_GL", "egl")

from coax_utils import __version__  # noqa: E402

project = "coax_utils"
author = "coax_utils developers"
copyright = "2026, coax_utils developers"
version = release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "all_documented",
]

# No intersphinx: CI has no network access, and no inventory files are shipped.
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autosummary_generate = False

# Modules whose public __all__ must be fully documented (checked by _ext/all_documented.py).
all_documented_modules = [
    "coax_utils.utils",
    "coax_utils.sources",
    "coax_utils.replay",
    "coax_utils.envs",
    "coax_utils.distributed",
]

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {"description": "RL utilities for JAX, Haiku and optax"}
# Every reference to a public coax_utils name must resolve (with -W a broken one fails the
# build); references to other projects' names cannot be checked without intersphinx, and the
# private names some Sphinx releases derive from type hints (a TypeVar, a private class) have
# no page: both are skipped. :doc: and :ref: links are always checked.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!coax_utils\.).*"), (r"py:.*", r".*\._.*")]
