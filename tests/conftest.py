"""Shared fixtures. Tests that need root/namespaces skip with a reason, except in CI
(MRC_REQUIRE_ROOT=1), where such a skip is turned into a failure."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ROOT = os.environ.get("MRC_REQUIRE_ROOT") == "1"


def _root_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (run `make sysdeps`)"
    return None


def require_root() -> None:
    """Skip the calling test when root/namespaces are unavailable, or fail under CI."""
    problem = _root_problem()
    if problem is None:
        return
    if REQUIRE_ROOT:
        pytest.fail(f"MRC_REQUIRE_ROOT=1 but this test {problem}")
    pytest.skip(problem)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        require_root()
