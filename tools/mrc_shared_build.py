"""Lets users other than the builder import a root-built editable mrc (make build copies
this file into the venv's site-packages as _mrc_shared_build.py, with a .pth line that
imports it after meson-python's editable loader).

meson-python's loader runs ninja in the build directory on the first import, to rebuild
what changed. Any other user cannot write there: the import died with a PermissionError
on build/.../meson-logs (issue 11). For such a user the import now uses the build as it
stands, without rebuilding; the builder still gets rebuild-on-import. A normal
`pip install .` has no loader and is not touched.
"""

from __future__ import annotations

import json
import os
import sys


def apply() -> None:
    """Called by the .pth line each time site reads it (a venv's lib64 -> lib link makes
    site read every .pth twice, and the editable loader adds a finder each time)."""
    loader = sys.modules.get("_mrc_editable_loader")
    if loader is None:
        return
    for finder in sys.meta_path:
        if not isinstance(finder, loader.MesonpyMetaFinder):
            continue
        build = finder._build_path
        if os.access(build, os.W_OK):
            continue
        plan = os.path.join(build, "meson-info", "intro-install_plan.json")

        def tree(plan: str = plan) -> object:
            with open(plan, encoding="utf8") as f:
                return loader.collect(json.load(f))

        finder._rebuild = tree  # the instance attribute shadows the cached method
