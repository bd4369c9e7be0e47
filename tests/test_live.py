"""`mrc-route live`: a running endpoint's paths through its stats socket."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from helpers import connected_pair, pattern

from mrc import telemetry
from mrc.routing.cli import cli


def test_live_shows_paths_of_a_running_endpoint(tmp_path: Path) -> None:
    sock = str(tmp_path / "ep.sock")
    with connected_pair(4) as p:
        p.a.inject(3, down=True)
        p.b.inject(3, down=True)
        srv = p.a.serve_stats(sock)
        src, dst = pattern(16 << 20, 1), np.zeros(16 << 20, np.uint8)
        md = p.b.register(dst)
        p.ca.write(p.a.register(src), md.descriptor()).wait(timeout=30)
        doc = telemetry.fetch(sock)
        assert doc["stats"]["paths"][3]["state"] in ("failed", "suspect")

        res = CliRunner().invoke(
            cli, ["live", sock, "--json", "--count", "2", "--interval", "0.05"]
        )
        assert res.exit_code == 0, res.output
        snaps = [json.loads(line) for line in res.output.splitlines()]
        assert len(snaps) == 2
        assert [q["path"] for q in snaps[0]["stats"]["paths"]] == [0, 1, 2, 3]

        wide = CliRunner(env={"COLUMNS": "200"})
        res = wide.invoke(cli, ["live", sock, "--count", "2", "--interval", "0.05"])
        assert res.exit_code == 0, res.output
        assert "127.0.1.4" in res.output and "good" in res.output
        assert ("failed" in res.output) or ("suspect" in res.output)
        srv.close()
    res = CliRunner().invoke(cli, ["live", sock, "--count", "1"])
    assert res.exit_code == 2 and "no mrc stats" in res.output
