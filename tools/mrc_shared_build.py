"""Lets users other than the builder import a root-built editable mrc (make build copies
this file into the venv's site-packages as _mrc_shared_build.py, with a .pth line that
imports it after meson-python's editable loader).

meson-python's loader runs ninja in the build directory on the first import, to rebuild
what changed. Any other user cannot write there: the import died with a PermissionError
on build/.../meson-logs (issue 11). For such a user the import now uses the build as it
stands, without rebuilding; the builder still gets rebuild-on-import, one process at a
time (_one_at_a_time). A normal `pip install .` has no loader and is not touched.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable


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
        if getattr(finder, "_mrc_shared", False):
            continue  # this finder is seen to already
        finder._mrc_shared = True
        if os.access(build, os.W_OK):
            finder._rebuild = _one_at_a_time(finder._rebuild, build)
            continue
        plan = os.path.join(build, "meson-info", "intro-install_plan.json")

        def tree(plan: str = plan) -> object:
            with open(plan, encoding="utf8") as f:
                return loader.collect(json.load(f))

        finder._rebuild = tree  # the instance attribute shadows the cached method


def _one_at_a_time(rebuild: Callable[[], object], build: str) -> Callable[[], object]:
    """Ranks started together after a source changed (mrc-run -n 128 -- python x.py)
    each ran ninja in the same build directory at once: concurrent ninjas corrupted its
    .ninja_deps ("premature end of file"), after which every import rebuilt everything
    again (a suite run got through 24 tests in 12 minutes). One rebuild at a time, under
    a lock on the build directory: the first builds, the others find nothing to do."""

    def locked() -> object:
        with open(os.path.join(build, ".mrc-rebuild.lock"), "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
            return rebuild()

    return locked
