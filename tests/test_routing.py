"""Fabric files and the static source-route table (pure Python, no root)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path as FsPath

import pytest
from click.testing import CliRunner

from mrc.fabric.cli import cli as fabric_cli
from mrc.routing import (
    FabricError,
    Table,
    build_srh,
    check_table,
    compile_table,
    diff_tables,
    host_planes,
    load_fabric,
    parse_fabric,
    parse_srh,
    paths,
)
from mrc.routing.cli import cli as route_cli

ROOT = FsPath(__file__).resolve().parent.parent
FABRICS = ROOT / "routing"
F2, F4, F8 = (
    str(FABRICS / f) for f in ("2host-2plane.toml", "4host-4plane.toml", "8host-8plane.toml")
)


@pytest.mark.parametrize(
    ("file", "hosts", "switches", "links", "paths_per_pair"),
    [(F2, 2, 6, 8, 2), (F4, 4, 16, 32, 8), (F8, 8, 48, 128, 32)],
)
def test_example_fabrics_compile_clean(
    file: str, hosts: int, switches: int, links: int, paths_per_pair: int
) -> None:
    fab = load_fabric(file)
    assert (len(fab.hosts), len(fab.switches), len(fab.links)) == (hosts, switches, links)
    table = compile_table(fab)
    assert check_table(table) == []
    for a in fab.hosts:
        for b in fab.hosts:
            if a != b:
                assert len(table.paths(a.name, b.name)) == paths_per_pair


@pytest.mark.parametrize("file", [F2, F4, F8])
def test_path_ids_are_mirrored_and_spread_evenly(file: str) -> None:
    fab = load_fabric(file)
    for a in fab.hosts:
        for b in fab.hosts:
            if a == b:
                continue
            there, back = paths(fab, a.name, b.name), paths(fab, b.name, a.name)
            assert [p.id for p in there] == list(range(len(there)))
            assert [(p.id, p.plane, p.spine) for p in there] == [
                (p.id, p.plane, p.spine) for p in back
            ]
            # Every (plane, spine) exactly once, the same number of paths on every plane.
            assert len({(p.plane, p.spine) for p in there}) == len(there)
            per_plane = Counter(p.plane for p in there)
            assert sorted(per_plane) == list(range(fab.planes))
            assert len(set(per_plane.values())) == 1
            assert there == sorted(there, key=lambda p: (p.plane, fab.switch(p.spine).index))


def test_path_fields_and_segments() -> None:
    fab = load_fabric(F4)
    p = paths(fab, "h0", "h3")[3]
    assert (p.id, p.plane, p.spine, p.state) == (3, 1, "p1s1", "up")
    assert p.src_addr == host_planes(fab, "h0")[1] == "fd00:1::1"
    assert p.dst_addr == host_planes(fab, "h3")[1] == "fd00:1:0:3::1"
    assert p.segments == [fab.switch("p1s1").sid, p.dst_addr]
    assert p.segments[0] == "fd00:1:ff:3::1"
    assert "p1l0-p1s1" in p.crosses and "p1l1-p1s1" in p.crosses
    with pytest.raises(AttributeError):
        p.id = 7  # type: ignore[misc]


@pytest.mark.parametrize(
    ("failed", "gone"),
    [
        (["p0s1"], {1}),
        (["plane2"], {4, 5}),
        (["p3l1-p3s0"], {6}),  # h3 sits on p3l1
        (["p1l0"], {2, 3}),  # h0's leaf on plane 1
        (["h0-p0l0", "p2s0"], {0, 1, 4}),
    ],
)
def test_failed_elements_remove_paths_ids_stay(failed: list[str], gone: set[int]) -> None:
    fab = load_fabric(F4)
    full = paths(fab, "h0", "h3")
    left = paths(fab, "h0", "h3", failed=failed)
    assert {p.id for p in left} == set(range(8)) - gone
    assert left == [p for p in full if p.id not in gone]  # same ids, same contents
    marked = paths(fab, "h0", "h3", failed=failed, include_failed=True)
    assert {p.id for p in marked if p.state == "failed"} == gone
    table = compile_table(fab, failed)
    assert all(not set(failed) & set(p.crosses) for p in table.rows())
    assert check_table(table) == []
    assert table.paths("h3", "h0") == paths(fab, "h3", "h0", failed=failed)


def test_unknown_failed_element() -> None:
    with pytest.raises(FabricError, match="unknown element 'p9s9'") as e:
        compile_table(load_fabric(F4), ["p9s9"])
    assert e.value.key == "failed"


def test_srh_layout() -> None:
    segs = ["fd00:0:ff:2::1", "fd00:0:0:3::1"]
    srh = build_srh(segs)
    assert len(srh) == 8 + 16 * 2
    # next header 0 (kernel fills it), hdr ext len 4, type 4, segments left 1, last entry 1
    assert srh[:8] == bytes([0, 4, 4, 1, 1, 0, 0, 0])
    assert srh[8:24] == bytes.fromhex("fd000000000000030000000000000001")  # [0] = final dst
    assert srh[24:40] == bytes.fromhex("fd00000000ff00020000000000000001")
    assert parse_srh(srh) == segs
    with pytest.raises(ValueError):
        build_srh([])


def test_table_text_and_json_are_stable() -> None:
    table = compile_table(load_fabric(F4), ["p0s1"])
    text = table.to_text()
    assert text == compile_table(load_fabric(F4), ["p0s1"]).to_text()
    lines = text.splitlines()
    assert lines[0] == "# mrc-route-table/1 fabric=4host-4plane failed=p0s1"
    assert lines[2] == "h0 h1 0 0 p0s0 fd00::1 fd00:0:ff:2::1,fd00:0:0:1::1 fd00:0:0:1::1 up"
    again = Table.from_dict(json.loads(table.to_json()))
    assert again.to_json() == table.to_json()
    assert again.paths("h2", "h1") == table.paths("h2", "h1")


# Checks on tables -----------------------------------------------------------------------------

UNBALANCED = """
[fabric]
planes = 2
[[host]]
name = "a"
[[host]]
name = "b"
[[switch]]
name = "l0"
plane = 0
tier = 0
[[switch]]
name = "l1"
plane = 1
tier = 0
[[switch]]
name = "s0"
plane = 0
tier = 1
[[switch]]
name = "s1"
plane = 0
tier = 1
[[switch]]
name = "s2"
plane = 1
tier = 1
[[link]]
a = "a"
b = "l0"
rate = "1gbit"
[[link]]
a = "b"
b = "l0"
rate = "1gbit"
[[link]]
a = "a"
b = "l1"
rate = "1gbit"
[[link]]
a = "b"
b = "l1"
rate = "1gbit"
[[link]]
a = "l0"
b = "s0"
rate = "1gbit"
[[link]]
a = "l0"
b = "s1"
rate = "1gbit"
[[link]]
a = "l1"
b = "s2"
rate = "1gbit"
"""


def test_check_finds_unbalanced_planes_and_missing_paths() -> None:
    fab = parse_fabric(UNBALANCED, "unbalanced.toml")
    kinds = {p.kind for p in check_table(compile_table(fab))}
    assert kinds == {"unbalanced"}
    kinds = {p.kind for p in check_table(compile_table(fab, ["l0", "l1"]))}
    assert "no-path" in kinds


def test_check_finds_duplicates_and_paths_through_failed_elements() -> None:
    d = compile_table(load_fabric(F2)).to_dict()
    d["hosts"]["h1"][0] = d["hosts"]["h0"][0]
    d["failed"] = ["p1s0"]  # the table claims p1s0 failed, yet lists paths through it
    problems = check_table(Table.from_dict(d))
    assert {p.kind for p in problems} == {"duplicate", "failed-path"}
    assert any("fd00::1" in p.message for p in problems if p.kind == "duplicate")


# Bad fabric files --------------------------------------------------------------------------

GOOD = """\
[fabric]
name = "tiny"
planes = 1

[[host]]
name = "h0"

[[host]]
name = "h1"

[[switch]]
name = "l0"
plane = 0
tier = "leaf"

[[link]]
a = "h0"
b = "l0"
rate = "100mbit"

[[link]]
a = "h1"
b = "l0"
rate = "100mbit"
"""

BAD = {
    "unknown-host": (
        GOOD.replace('a = "h1"', 'a = "h9"'),
        "link[1].a",
        None,
        "unknown element 'h9'",
    ),
    "duplicate-address": (
        GOOD.replace('name = "h0"', 'name = "h0"\naddrs = ["fd00::5"]').replace(
            'name = "h1"', 'name = "h1"\naddrs = ["fd00::5"]'
        ),
        "host[1].addrs[0]",
        None,
        "duplicate address fd00::5",
    ),
    "plane-count": (
        GOOD.replace('name = "h0"', 'name = "h0"\naddrs = ["fd00::5", "fd01::5"]'),
        "host[0].addrs",
        None,
        "plane count mismatch",
    ),
    "missing-plane-link": (
        GOOD.replace("planes = 1", "planes = 2"),
        "host[0]",
        None,
        "no link into plane 1",
    ),
    "toml-syntax": (
        GOOD.replace('rate = "100mbit"\n\n[[link]]', 'rate = "100mbit\n\n[[link]]'),
        None,
        19,
        "TOML syntax error",
    ),
}


def test_good_tiny_fabric() -> None:
    fab = parse_fabric(GOOD, "tiny.toml")
    assert [p.spine for p in paths(fab, "h0", "h1")] == ["l0"]  # no spines: through the leaf


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fabric_raises_one_clear_error(case: str, tmp_path: FsPath) -> None:
    text, key, line, message = BAD[case]
    file = tmp_path / f"{case}.toml"
    file.write_text(text)
    with pytest.raises(FabricError) as e:
        load_fabric(file)
    err = e.value
    assert (err.file, err.key, err.line) == (str(file), key, line)
    assert message in str(err)
    assert str(err).startswith(f"{file}:{line}: " if line else f"{file}: {key}: ")
    runner = CliRunner()
    for cli, args in (
        (route_cli, ["show", str(file)]),
        (route_cli, ["check", str(file)]),
        (route_cli, ["show", "--json", str(file)]),
        (fabric_cli, ["up", str(file), "--name", "badfile"]),
    ):
        res = runner.invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        assert str(file) in res.output and message in res.output
    res = runner.invoke(route_cli, ["check", "--json", str(file)])
    assert json.loads(res.stdout.splitlines()[0])["key"] == key


def test_clos_and_explicit_plane_counts_must_agree() -> None:
    text = FsPath(F4).read_text().replace('name = "4host-4plane"', 'name = "x"\nplanes = 3')
    with pytest.raises(FabricError, match="plane count mismatch") as e:
        parse_fabric(text, "x.toml")
    assert e.value.key == "clos.planes"


def test_explicit_link_overrides_generated_rate() -> None:
    fab = load_fabric(F4)
    assert fab.link("p3l1-p3s1").rate_bps == 100_000_000
    assert fab.link("p3l0-p3s1").rate_bps == 400_000_000


# CLI ------------------------------------------------------------------------------------------


def test_route_cli_show_check_diff(tmp_path: FsPath) -> None:
    runner = CliRunner()
    res = runner.invoke(route_cli, ["show", F4, "--from", "h0", "--to", "h3", "--failed", "p0s1"])
    assert res.exit_code == 0, res.output
    assert "p0s0" in res.output and "p0s1" not in res.output.split("failed: p0s1")[1]
    res = runner.invoke(route_cli, ["show", F4, "--from", "h0", "--to", "h3", "--json"])
    rows = json.loads(res.stdout)["paths"]
    assert [(r["id"], r["plane"], r["spine"]) for r in rows][:3] == [
        (0, 0, "p0s0"),
        (1, 0, "p0s1"),
        (2, 1, "p1s0"),
    ]
    res = runner.invoke(route_cli, ["check", F4])
    assert res.exit_code == 0 and res.output.startswith("ok:")
    res = runner.invoke(route_cli, ["check", F2, "-f", "plane0", "-f", "plane1", "--json"])
    assert res.exit_code == 1
    assert {p["kind"] for p in json.loads(res.stdout)["problems"]} == {"no-path"}

    saved = tmp_path / "t.json"
    saved.write_text(runner.invoke(route_cli, ["show", F4, "--json", "-f", "p2s0"]).stdout)
    res = runner.invoke(route_cli, ["diff", F4, str(saved), "--json"])
    assert res.exit_code == 1
    changes = json.loads(res.stdout)
    assert {c["change"] for c in changes} == {"-"}
    assert {c["spine"] for c in changes} == {"p2s0"}
    assert len(changes) == 12 * 1  # 12 ordered host pairs, one path each through p2s0
    assert runner.invoke(route_cli, ["diff", F4, F4]).exit_code == 0
    assert diff_tables(compile_table(load_fabric(F4)), compile_table(load_fabric(F4))) == []


def test_route_cli_unknown_host_is_bad_input() -> None:
    res = CliRunner().invoke(route_cli, ["show", F4, "--from", "h9"])
    assert res.exit_code == 2 and "h9" in res.output


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (ROOT / ".venv/bin/ruff").exists(), reason="no ruff"
)
def test_lint_clean() -> None:
    ruff = shutil.which("ruff") or str(ROOT / ".venv/bin/ruff")
    files = ["mrc/routing", "mrc/fabric", "tests/test_routing.py", "tests/test_fabric.py"]
    for args in (["check"], ["format", "--check"]):
        res = subprocess.run([ruff, *args, *files], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
