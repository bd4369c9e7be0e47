"""The persistent state of a running namespace fabric: /run/mrc-fabric/<prefix>.json.

It records which fabric file a prefix was built from, the failed elements and the injected
loss, so `mrc-fabric fail` also feeds the route table (`mrc-route show --state PREFIX`).
Pure Python, no root needed to read it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mrc.errors import MrcError, UsageError

STATE_DIR_ENV = "MRC_FABRIC_STATE_DIR"
DEFAULT_STATE_DIR = "/run/mrc-fabric"
DEFAULT_PREFIX = "mrc"
_PREFIX = re.compile(r"^[A-Za-z0-9_]{1,12}$")  # no "-": "<prefix>-" must be unambiguous


class FabricNetError(MrcError):
    """A namespace fabric operation failed (not up, already up, a command failed...)."""


class FabricNameError(FabricNetError, UsageError):
    """A fabric name (--name) that cannot name namespaces: bad input."""


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


def check_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise FabricNameError(
            f"bad fabric name {prefix!r}: 1-12 letters, digits or _ (no '-', so that "
            "'<name>-' never matches another fabric's namespaces)"
        )
    return prefix


def state_path(prefix: str) -> Path:
    return state_dir() / f"{check_prefix(prefix)}.json"


@dataclass
class State:
    prefix: str
    fabric: str  # absolute path of the fabric file
    failed: list[str] = field(default_factory=list)
    loss: dict[str, float] = field(default_factory=dict)  # link -> percent

    def save(self) -> None:
        path = state_path(self.prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        data = {
            "prefix": self.prefix,
            "fabric": self.fabric,
            "failed": sorted(set(self.failed)),
            "loss": dict(sorted(self.loss.items())),
        }
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)


def load_state(prefix: str) -> State:
    path = state_path(prefix)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FabricNetError(
            f"fabric {prefix!r} is not up (no {path}); run `mrc-fabric up FABRIC --name {prefix}`"
        ) from None
    except (OSError, ValueError) as e:
        raise FabricNetError(f"cannot read {path}: {e}") from None
    try:
        return State(
            prefix=str(data["prefix"]),
            fabric=str(data["fabric"]),
            failed=[str(x) for x in data.get("failed", [])],
            loss={str(k): float(v) for k, v in data.get("loss", {}).items()},
        )
    except KeyError as e:
        raise FabricNetError(
            f"{path}: not a fabric state (no {e.args[0]!r}); `mrc-fabric down --name {prefix}` "
            "cleans up"
        ) from None
    except (TypeError, ValueError, AttributeError) as e:
        raise FabricNetError(
            f"{path}: not a fabric state ({e}); `mrc-fabric down --name {prefix}` cleans up"
        ) from None


def remove_state(prefix: str) -> None:
    state_path(prefix).unlink(missing_ok=True)
