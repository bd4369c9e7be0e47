"""`mrc-route live`: a running endpoint's paths through its stats socket."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from helpers import connected_pair, pattern, wait_for

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
        assert "#0.3" in res.output  # no name given to connect(): #connection.path
        assert ("failed" in res.output) or ("suspect" in res.output)
        srv.close()
    res = CliRunner().invoke(cli, ["live", sock, "--count", "1"])
    assert res.exit_code == 2 and "no mrc stats" in res.output


def test_paths_of_an_ended_connection_are_shown_as_ended(tmp_path: Path) -> None:
    """A closed connection stops probing, so its paths' states freeze where they were
    (a path being failed stays 'suspect'): stats say the connection ended, `live` shows
    'closed' instead of a state, and the planner's plane count ignores them."""
    from mrc.collectives.bandwidth import plane_usable

    sock = str(tmp_path / "ep.sock")
    with connected_pair(4) as p:
        assert {q["conn_error"] for q in p.a.stats()["paths"]} == {None}
        p.a.inject(3, down=True)
        p.b.inject(3, down=True)
        src, dst = pattern(4 << 20, 2), np.zeros(4 << 20, np.uint8)
        md = p.b.register(dst)
        p.ca.write(p.a.register(src), md.descriptor()).wait(timeout=30)
        wait_for(lambda: p.a.stats()["paths"][3]["state"] == "failed", what="path 3 failed")
        assert plane_usable(p.a.stats()) == [True, True, True, False]
        p.cb.close()
        wait_for(
            lambda: {q["conn_error"] for q in p.a.stats()["paths"]} == {"connection closed"},
            what="the peer's CLOSE",
        )
        assert plane_usable(p.a.stats(), 4) == [True] * 4  # nothing current says broken
        srv = p.a.serve_stats(sock)
        res = CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["live", sock, "--count", "1"])
        srv.close()
        assert res.exit_code == 0, res.output
        assert "1 connection(s), 1 ended" in res.output
        assert res.output.count(" closed ") == 4, res.output  # one per path
        assert "good" not in res.output and "failed" not in res.output


def test_closing_the_stats_server_ends_its_thread(tmp_path: Path) -> None:
    """close() wakes the thread blocked in accept() (closing the socket alone does not
    on Linux: close() then waited out its 5 s join and left the thread blocked)."""
    with connected_pair(1) as p:
        srv = p.a.serve_stats(str(tmp_path / "ep.sock"))
        assert telemetry.fetch(srv.path)["stats"]["conns"] == 1
        srv.close()
        assert not srv._thread.is_alive()
        assert not Path(srv.path).exists()


def test_live_names_paths_by_peer_and_shows_names_as_text(tmp_path: Path) -> None:
    """A path is peer.path, the peer's name from its hello: text, never rich markup."""
    import threading

    from helpers import planes

    import mrc

    a, b = mrc.Endpoint(planes(1, 0)), mrc.Endpoint(planes(1, 1))
    try:
        port = b.listen()
        got: list[mrc.Connection] = []
        t = threading.Thread(target=lambda: got.append(b.accept(timeout=10)))
        t.start()
        ca = a.connect(b.planes[0][0], port, timeout=10, name="[red]h9")
        t.join()
        assert got and b.stats()["paths"][0]["peer"] == "[red]h9"
        sock = str(tmp_path / "b.sock")
        with b.serve_stats(sock):
            res = CliRunner().invoke(cli, ["live", sock, "--count", "1"])
        assert res.exit_code == 0, res.output
        assert "[red]h9.0" in res.output
        ca.close()
    finally:
        a.close()
        b.close()
