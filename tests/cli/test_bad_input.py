"""Bad input everywhere: a typed error, the documented exit code, and nothing changed (cli.md §1,
§2.1, §3, §5; state.md §2.6, §4.7; wire.md §1).

Every case runs the real command in a subprocess against the test's own database and private
directory, and then proves that nothing was written: no `flyd.runs` or `flyd.checkpoints` row, no
socket, no state directory, no process left behind (the `site` fixture fails a test that leaves
one).

Cases covered elsewhere, not repeated here:
- fault grammar and every knob rule at the parser: `tests/session/test_fault_specs.py`;
  `flyd run --fault fly-z...` (unknown worker) `tests/cli/test_run.py::
  test_a_bad_spec_or_fault_exits_2_with_a_json_error`; `flyd run --fault fly-a.nope=1` (unknown
  knob) and `flyctl runs submit --fault fly-q.bogus=1`: `tests/cli/test_errors.py`;
- unknown or invalid keys for `flyd config show` and `flyd db migrate`:
  `tests/cli/test_config.py::test_unknown_or_invalid_config_keys_are_refused_by_name`; `[bus]
  bogus` for `flyd run`: `tests/cli/test_run.py::test_a_bad_config_key_exits_2_with_a_config_error`;
- a queued spec with `agents[0].threads = 0` through the submit statement:
  `tests/cli/test_serve.py::test_an_invalid_run_spec_fails_with_its_path`;
- every reader check on the decoder itself: `tests/state/test_envelope_corruption.py`; `verify`
  of one R2 file: `tests/cli/test_control.py::test_checkpoint_commands_print_json`;
- an unreachable DSN for `flyctl runs list|submit`, `flyctl status`, `flyd serve` and `flyd db
  migrate`: `tests/cli/test_errors.py::test_every_command_reports_errors_as_json_with_a_code`.

Decisions where the spec is silent:
- A stored spec that is not a JSON object (a string, an array, null), written straight into
  `flyd.runs`, is refused at path "" on its first claim, like any other invalid field; a
  `startFrom` naming a checkpoint the run has no head for is refused at `/startFrom` (it was not
  submitted by `flyctl checkpoints import`, which stores the head in the same transaction).
- A node creates its state directory before it connects to the database (it is the node's own
  directory, 0700); an unreachable DSN leaves it empty.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket as socketlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from tests.cli.test_flyctl_runs import FLYCTL, ROOT, Site, flyctl, run_row, serve, submit
from tests.cli.test_flyctl_runs import site as site
from tests.cli.test_serve import spec_json
from tests.cli.test_serve import submit as store_submit

pytestmark = pytest.mark.timeout(300)

FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint-envelope.json"
SUN_PATH_MAX = 107


def _run(site: Site, argv: list[str], env: dict[str, str] | None = None,
         timeout: float = 90) -> tuple[int, dict[str, Any] | None, str]:
    """One command; returns (exit code, the JSON object on stdout or None, stderr). Never a
    traceback."""
    out = subprocess.run(argv, cwd=ROOT, env=env or site.env(), capture_output=True,
                         timeout=timeout, check=False)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert "Traceback" not in stdout and "Traceback" not in stderr, (stdout, stderr)
    lines = stdout.splitlines()
    return out.returncode, orjson.loads(lines[-1]) if lines else None, stderr


def _flyd(*args: str) -> list[str]:
    return [sys.executable, "-m", "flyd", *args]


def _refused(site: Site, argv: list[str], code: str, *words: str,
             env: dict[str, str] | None = None, exit_code: int = 2) -> str:
    """A `--json` command refused with exactly `{"error": {code, message}}`; returns the
    message, which names every word."""
    got, doc, stderr = _run(site, argv, env)
    assert got == exit_code, (argv, doc, stderr)
    assert doc is not None and set(doc) == {"error"}, (argv, doc)
    assert set(doc["error"]) == {"code", "message"} and doc["error"]["code"] == code, doc
    message = str(doc["error"]["message"])
    for word in words:
        assert word in message, (word, message)
    return message


def _rows(site: Site) -> tuple[int, int]:
    """(runs, checkpoints) stored in the test's database."""
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        runs = conn.execute("SELECT count(*) FROM flyd.runs").fetchone()
        checkpoints = conn.execute("SELECT count(*) FROM flyd.checkpoints").fetchone()
    assert runs is not None and checkpoints is not None
    return int(runs[0]), int(checkpoints[0])


def _untouched(site: Site, *keep: str) -> None:
    """No row, no socket, no state dir: the site holds only the files the test wrote."""
    assert _rows(site) == (0, 0)
    assert sorted(p.name for p in site.path.iterdir() if p.name not in keep) == []


# --------------------------------------------------------------------------------------------
# fault specs


@pytest.mark.parametrize(("faults", "named", "reason"), [
    (["fly-a.prepare_delay_ms=soon"], "fly-a.prepare_delay_ms=soon", "integer milliseconds"),
    (["fly-a.commit_delay_ms=-1"], "fly-a.commit_delay_ms=-1", "integer milliseconds"),
    (["arena.fail_capture=maybe"], "arena.fail_capture=maybe", "true or false"),
    (["fly-a.fail_commit_at_step=3@2"], "fly-a.fail_commit_at_step=3@2", "@STEP"),
    (["arena.prepare_delay_ms=5"], "arena.prepare_delay_ms=5", "not a knob of the environment"),
    (["kill:fly-b"], "kill:fly-b", "needs @STEP"),
    (["nonsense"], "nonsense", "expected WORKER.KNOB=VALUE"),
    (["lose-advance-result@99"], "lose-advance-result@99", "not a step of this run"),
    (["fly-a.prepare_delay_ms=1", "fly-a.prepare_delay_ms=2"], "fly-a.prepare_delay_ms=2",
     "given twice"),
])
def test_a_malformed_fault_spec_exits_2_naming_it(site: Site, faults: list[str], named: str,
                                                  reason: str) -> None:
    args = [a for fault in faults for a in ("--fault", fault)]
    message = _refused(site, _flyd("run", "--steps", "10", "--json", "--socket", site.socket,
                                   *args), "USAGE", reason)
    assert message.startswith(f"fault spec {named!r}: "), message
    _untouched(site)


def test_a_malformed_fault_spec_on_submit_and_import_changes_nothing(site: Site) -> None:
    envelope = site.path / "good.flysess"
    envelope.write_bytes(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    # the import keeps the file's composition: its one agent is fly-a
    for command, agent in ((["runs", "submit", "--steps", "10"], "fly-b"),
                           (["checkpoints", "import", str(envelope), "--steps", "10"], "fly-a")):
        message = _refused(site, [*FLYCTL, *command, "--fault", f"{agent}.prepare_delay_ms=x",
                                  "--json"], "USAGE", "integer milliseconds")
        assert message.startswith(f"fault spec '{agent}.prepare_delay_ms=x': "), message
    _untouched(site, "good.flysess")


def test_agent_ids_that_cannot_name_a_bus_service_exit_2_naming_their_path(site: Site) -> None:
    """`a..b` and `c.` are Ids, but `<tag>.agent.a..b` is no service name: they were accepted
    and every launch was refused (three attempts). One rule now refuses them up front."""
    for argv in (_flyd("run", "--steps", "10", "--agents", "a..b,c.", "--json", "--socket",
                       site.socket),
                 [*FLYCTL, "runs", "submit", "--steps", "10", "--agents", "a..b,c.", "--json"]):
        _refused(site, argv, "USAGE", "/agents/0/agentId", "a..b", "empty dot-separated segment")
    _refused(site, _flyd("run", "--steps", "10", "--agents", "ok,c.", "--json", "--socket",
                         site.socket), "USAGE", "/agents/1/agentId", "c.")
    _untouched(site)


# --------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize(("toml", "named"), [
    ("[checkpoints]\nbogus = 1\n", "unknown key [checkpoints] bogus"),
    ("[bus.limits]\nmax_bogus = 1\n", "[bus.limits] max_bogus"),
    ("[bus.policy]\nmode = 'closed'\n[[bus.policy.client]]\nid = 'x'\nbogus = 1\n",
     "[[bus.policy.client]] #1: unknown key 'bogus'"),
])
def test_an_unknown_config_key_stops_every_command_before_it_starts(site: Site, toml: str,
                                                                   named: str) -> None:
    config = site.path / "flyd.toml"
    config.write_text(toml)
    envelope = site.path / "good.flysess"
    envelope.write_bytes(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    sock = ["--socket", site.socket]
    for argv in (_flyd("serve", "--config", str(config), "--json", *sock),
                 _flyd("run", "--steps", "10", "--config", str(config), "--json", *sock),
                 [*FLYCTL, "runs", "submit", "--config", str(config), "--json"],
                 [*FLYCTL, "checkpoints", "import", str(envelope), "--steps", "10", "--config",
                  str(config), "--json"]):
        _refused(site, argv, "CONFIG", named, str(config))
    # the router alone prints no JSON: the same message on stderr, exit 2, nothing bound
    code, doc, stderr = _run(site, _flyd("router", "--config", str(config), *sock), timeout=30)
    assert (code, doc) == (2, None), stderr
    assert named in stderr and str(config) in stderr
    _untouched(site, "flyd.toml", "good.flysess")


# --------------------------------------------------------------------------------------------
# invalid run specs in the queue


def _insert_raw(site: Site, doc: Any) -> int:
    """A spec written straight into the table, bypassing every client-side check."""
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        row = conn.execute("INSERT INTO flyd.runs (spec) VALUES (%s::jsonb) RETURNING run_id",
                           (json.dumps(doc),)).fetchone()
    assert row is not None
    return int(row[0])


def _events(site: Site, log: str, event: str) -> list[dict[str, Any]]:
    out = []
    for line in (site.path / log).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def test_invalid_queued_specs_fail_with_their_reason_and_the_node_keeps_serving(
        site: Site) -> None:
    ghost = {"checkpointId": "ck-e1-5", "envelopeDigest": "0" * 64}
    cases = [  # (run id, path, words of the reason)
        (_insert_raw(site, "hello"), "", "must be an object"),
        (_insert_raw(site, []), "", "must be an object"),
        (_insert_raw(site, None), "", "must be an object"),
        (_insert_raw(site, {"steps": -1}), "/steps", "U64 string"),
        (_insert_raw(site, {**spec_json(10), "startFrom": ghost}), "/startFrom",
         "checkpoint ck-e1-5 is not stored"),
        (_insert_raw(site, {**spec_json(10), "agents": [
            {"agentId": "a..b", "portId": "p1", "seed": None}]}), "/agents/0/agentId",
         "empty dot-separated segment"),
        (store_submit(site.dsn, {**spec_json(10), "stepz": "10"}), "/stepz", "unknown key"),
        (store_submit(site.dsn, {**spec_json(10), "world": {"impl": "nomodule.x:World"}}),
         "/world/impl", "cannot be found"),
        (_insert_raw(site, {**spec_json(10), "world": {"config": {"blob": "x" * (1 << 20)}}}),
         "", "at most 1048576 bytes"),
    ]
    node = serve(site, "n1")
    deadline = time.monotonic() + 90
    for run, path, words in cases:
        row = run_row(site, run)
        while row["state"] in ("pending", "running"):
            assert time.monotonic() < deadline, f"run {run} stayed {row['state']}"
            assert node.poll() is None, "the node exited"
            time.sleep(0.2)
            row = run_row(site, run)
        assert (row["state"], row["attempt"]) == ("failed", 1), (path, row)
        outcome = row["outcome"]
        assert set(outcome) == {"error", "path", "reason"}, outcome
        assert (outcome["error"], outcome["path"]) == ("invalid run spec", path), outcome
        assert words in outcome["reason"], outcome
        with psycopg.connect(site.dsn, autocommit=True) as conn:
            keys = conn.execute("SELECT effect_key FROM flyd.effects WHERE run_id = %s",
                                (run,)).fetchall()
        assert keys == [("finish",)]
    assert not _events(site, "serve-n1.log", "launcher.launched"), "an invalid run launched"
    assert not _events(site, "serve-n1.log", "scope_error")
    refused = {e["run"] for e in _events(site, "serve-n1.log", "run.invalid_spec")}
    assert refused == {run for run, _, _ in cases}

    good = submit(site, "--steps", "10", "--mode", "in-process")
    deadline = time.monotonic() + 90
    row = run_row(site, good)
    while row["state"] != "succeeded":
        assert row["state"] in ("pending", "running"), row
        assert time.monotonic() < deadline, "the valid run did not finish"
        time.sleep(0.2)
        row = run_row(site, good)
    node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=60) == 0


# --------------------------------------------------------------------------------------------
# corrupt checkpoint files


def _corruptions() -> list[tuple[str, bytes]]:
    """The fixture's first corruption of each reader check, applied (and resealed where the
    fixture says so, so checks after R2 are reachable)."""
    from tests.state.test_envelope_corruption import reseal

    doc = json.loads(FIXTURE.read_text())
    data = base64.b64decode(doc["envelope"])
    out: dict[str, bytes] = {}
    for case in doc["corruptions"]:
        if case["check"] in out:
            continue
        edited = bytearray(data)
        for edit in case["edits"]:
            new = bytes.fromhex(edit["hex"])
            edited[edit["at"]:edit["at"] + len(new)] = new
        if case["truncateTo"] is not None:
            edited = edited[:case["truncateTo"]]
        out[case["check"]] = reseal(edited) if case["reseal"] else bytes(edited)
    return sorted(out.items())


def test_a_corrupt_checkpoint_file_is_refused_on_import_naming_its_check(site: Site) -> None:
    cases = _corruptions()
    assert [check for check, _ in cases] == [f"R{i}" for i in range(1, 9)]
    for check, data in cases:
        path = site.path / f"{check}.flysess"
        path.write_bytes(data)
        message = _refused(site, [*FLYCTL, "checkpoints", "import", str(path), "--steps", "10",
                                  "--json"], "INCOMPATIBLE_STATE", exit_code=1)
        assert message.startswith(f"envelope {check}: "), message
        assert len(message) > len(f"envelope {check}: "), "the reason is empty"
        verified = flyctl(site, "checkpoints", "verify", str(path), socket=False)
        assert verified.code == 1
        assert verified.json == {"ok": False, "check": check,
                                 "reason": message.removeprefix(f"envelope {check}: ")}
        assert _rows(site) == (0, 0), f"{check}: the import changed the database"
    # the intact file imports: the refusals above were the checks, not the database
    good = site.path / "good.flysess"
    good.write_bytes(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    imported = flyctl(site, "checkpoints", "import", str(good), "--steps", "10", socket=False)
    assert imported.code == 0, imported
    assert _rows(site) == (1, 1)


# --------------------------------------------------------------------------------------------
# unreachable database, socket path too long


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socketlib.socket(socketlib.AF_INET, socketlib.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_dsn_is_a_config_error_that_changes_nothing(site: Site) -> None:
    port = _closed_port()
    dsn = f"postgresql://flyd:s3cret@127.0.0.1:{port}/flyd?connect_timeout=2"
    good = site.path / "good.flysess"
    good.write_bytes(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    state = site.path / "state"
    for argv in (_flyd("run", "--steps", "10", "--dsn", dsn, "--socket", site.socket,
                       "--state-dir", str(state), "--json"),
                 [*FLYCTL, "checkpoints", "import", str(good), "--steps", "10", "--dsn", dsn,
                  "--json"],
                 [*FLYCTL, "checkpoints", "list", "1", "--dsn", dsn, "--json"],
                 [*FLYCTL, "runs", "cancel", "1", "--dsn", dsn, "--json"],
                 [*FLYCTL, "runs", "requeue", "1", "--dsn", dsn, "--json"]):
        message = _refused(site, argv, "CONFIG", str(port))
        assert "s3cret" not in message
    assert not os.path.exists(site.socket)
    assert not state.exists() or list(state.iterdir()) == []
    _untouched(site, "good.flysess", "state")


def test_an_absurd_duration_is_refused_before_anything_starts(site: Site) -> None:
    """`--lease-ttl 1e308` was accepted; every claim then failed with "timestamp out of range"
    and `flyd run` hung with its run pending. A duration beyond 2^31−1 ms (flag, environment or
    file) is refused at parse time naming the key, and nothing starts."""
    config = site.path / "flyd.toml"
    config.write_text("[checkpoints]\ndurable_timeout_s = 1e300\n")
    run = ["--steps", "10", "--mode", "in-process", "--json", "--socket", site.socket]
    for argv, env, named in (
            (_flyd("run", "--lease-ttl", "1e308", *run), None, "flag --lease-ttl"),
            (_flyd("serve", "--lease-ttl", "1e308", "--json", "--socket", site.socket), None,
             "flag --lease-ttl"),
            (_flyd("run", *run), site.env(FLYD_LEASE_TTL="1e308"), "environment FLYD_LEASE_TTL"),
            (_flyd("run", "--lease-ttl", "-inf", *run), None, "flag --lease-ttl")):
        message = _refused(site, argv, "CONFIG", named, env=env)
        assert message.startswith(f"{named}: [leases] ttl_s "), message
    message = _refused(site, _flyd("run", "--config", str(config), *run), "CONFIG",
                       "[checkpoints] durable_timeout_s", "2147483.647")
    assert message.startswith(str(config)), message
    _untouched(site, "flyd.toml")


def _fingerprint(path: Path) -> tuple[object, ...]:
    """What must not change: the entry itself (type, inode, mode, size, mtime) and, for a file,
    a directory or a symbolic link, its bytes, listing or target."""
    st = path.lstat()
    if path.is_symlink():
        content: object = os.readlink(path)
    elif path.is_dir():
        content = sorted((p.name, p.read_bytes()) for p in path.iterdir())
    elif path.is_file():
        content = path.read_bytes()
    else:
        content = None
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, content)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_socket_path_that_is_not_the_nodes_is_never_touched(site: Site, command: str) -> None:
    """`--socket` naming a regular file, a directory, a symbolic link or another live router's
    socket: refused before anything starts (exit 2, `CONFIG`, naming the path and what is
    there), the path byte-identical afterwards (before, the node's cleanup unlinked a file,
    a directory gave a traceback and left the node's temp dir); a path in a missing directory
    is refused and no directory is created."""
    notes = site.path / "notes.txt"
    notes.write_bytes(b"data\n")
    folder = site.path / "folder"
    folder.mkdir()
    (folder / "inside.txt").write_bytes(b"keep me\n")
    link = site.path / "link"
    link.symlink_to(notes)
    live = site.path / "live.sock"
    router = subprocess.Popen(_flyd("router", "--socket", str(live), "--open", "-q"), cwd=ROOT,
                              env=site.env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    site.procs.append(router)
    deadline = time.monotonic() + 30
    while not live.exists():
        assert router.poll() is None and time.monotonic() < deadline, "no router came up"
        time.sleep(0.05)
    missing = site.path / "missing" / "deeper"
    tmp = site.path / "tmp"
    tmp.mkdir()
    env = site.env(TMPDIR=str(tmp))
    cases = [(notes, "is a regular file"), (folder, "is a directory"),
             (link, "is a symbolic link"), (live, "a router already answers there"),
             (missing / "bus.sock", f"the directory {missing} does not exist")]
    for path, words in cases:
        before = _fingerprint(path) if path.parent.exists() else None
        argv = _flyd(command, "--socket", str(path), "--json")
        if command == "run":
            argv += ["--steps", "10", "--mode", "in-process"]
        message = _refused(site, argv, "CONFIG", str(path), words, env=env)
        assert message.startswith("flag --socket: [bus] socket "), message
        if before is not None:
            assert _fingerprint(path) == before, path
    assert notes.read_bytes() == b"data\n" and os.readlink(link) == str(notes)
    assert (folder / "inside.txt").read_bytes() == b"keep me\n"
    assert not (site.path / "missing").exists()
    assert router.poll() is None and _accepts(str(live)), "the live router was disturbed"
    assert list(tmp.iterdir()) == [], "a node's temporary directory was left behind"
    _untouched(site, "notes.txt", "folder", "link", "live.sock", "tmp")


def _accepts(path: str) -> bool:
    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def test_a_socket_path_over_sun_path_is_refused_before_anything_starts(site: Site) -> None:
    base = str(site.path / "d") + "/"
    long = base + "s" * (SUN_PATH_MAX + 1 - len(base) - len("/bus.sock")) + "/bus.sock"
    fits = long[:-len("x/bus.sock")] + "/bus.sock"
    assert (len(os.fsencode(long)), len(os.fsencode(fits))) == (SUN_PATH_MAX + 1, SUN_PATH_MAX)
    config = site.path / "flyd.toml"
    config.write_text(f"[bus]\nsocket = {json.dumps(long)}\n")
    limit = f"at most {SUN_PATH_MAX} bytes"
    for argv, env, source in (
            (_flyd("run", "--steps", "10", "--socket", long, "--json"), None, "flag --socket"),
            (_flyd("run", "--steps", "10", "--json"), site.env(FLYD_SOCKET=long),
             "environment FLYD_SOCKET"),
            (_flyd("serve", "--socket", long, "--json"), None, "flag --socket"),
            (_flyd("serve", "--config", str(config), "--json"), None, str(config)),
            ([*FLYCTL, "status", "--socket", long, "--json"], None, "flag --socket")):
        message = _refused(site, argv, "CONFIG", limit, env=env)
        assert message.startswith(f"{source}: [bus] socket"), message
    code, doc, stderr = _run(site, _flyd("router", "--socket", long), timeout=30)
    assert (code, doc) == (2, None) and f"flag --socket: [bus] socket must be a path of {limit}" \
        in stderr, stderr
    _untouched(site, "flyd.toml")
    # one byte less is a valid socket path
    code, doc, _ = _run(site, _flyd("config", "show", "--socket", fits, "--json"))
    assert code == 0 and doc is not None
    assert doc["settings"]["bus.socket"] == {"value": fits, "source": "flag"}


# --------------------------------------------------------------------------------------------
# text PostgreSQL cannot hold, unreadable files, oversize specs (docs/configuration.md, "Limits
# on input")


def test_nul_and_non_utf8_strings_exit_2_naming_their_key(site: Site) -> None:
    """A NUL (U+0000) or a lone surrogate in a config value or any spec string passed every
    check and failed inside PostgreSQL (`flyd run` died with a traceback): refused before
    anything starts, naming the key or JSON Pointer."""
    config = site.path / "flyd.toml"
    config.write_text('[node]\nstate_dir = "/tmp/a\\u0000b"\n')
    sock = ["--socket", site.socket]
    for argv in (_flyd("run", "--steps", "10", "--config", str(config), "--json", *sock),
                 _flyd("serve", "--config", str(config), "--json", *sock),
                 [*FLYCTL, "runs", "submit", "--config", str(config), "--json"]):
        message = _refused(site, argv, "CONFIG", str(config), "[node] state_dir", "NUL")
        assert "\x00" not in message
    spec = site.path / "spec.json"
    spec.write_text(json.dumps({"world": {"config": {"note": "a\x00b"}}}))
    for argv in (_flyd("run", "--spec", str(spec), "--steps", "10", "--json", *sock),
                 [*FLYCTL, "runs", "submit", "--spec", str(spec), "--json"]):
        _refused(site, argv, "USAGE", "/world/config/note", "NUL")
    # undecodable bytes in argv and the environment arrive as lone surrogates
    envelope = site.path / "good.flysess"
    envelope.write_bytes(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    for argv in ([*FLYCTL, "runs", "submit", "--key", "k\udcff", "--json"],
                 [*FLYCTL, "checkpoints", "import", str(envelope), "--steps", "10", "--key",
                  "k\udcff", "--json"]):
        _refused(site, argv, "USAGE", "--key", "not UTF-8")
    _refused(site, [*FLYCTL, "checkpoints", "verify", "--run", "1", "--id", "ck\udcff",
                    "--json"], "USAGE", "--id", "not UTF-8")
    for argv in (_flyd("run", "--steps", "10", "--json", *sock),
                 [*FLYCTL, "runs", "submit", "--json"]):
        _refused(site, argv, "CONFIG", "environment FLYD_STATE_DIR", "not UTF-8",
                 env=site.env(FLYD_STATE_DIR=str(site.path / "st\udcffate")))
    _untouched(site, "flyd.toml", "spec.json", "good.flysess")


def test_a_config_file_that_is_not_utf8_or_unreadable_exits_2_naming_it(site: Site) -> None:
    """A Latin-1 config file crashed every command with a `UnicodeDecodeError` traceback."""
    latin = site.path / "latin.toml"
    latin.write_bytes(b"[node]\nname = \"caf\xe9\"\n")
    folder = site.path / "folder.toml"
    folder.mkdir()
    sock = ["--socket", site.socket]
    for config, words in ((latin, ("not UTF-8", "0xe9", "offset 18")),
                          (folder, ("cannot read", "Is a directory"))):
        for argv in (_flyd("run", "--steps", "10", "--config", str(config), "--json", *sock),
                     _flyd("serve", "--config", str(config), "--json", *sock),
                     [*FLYCTL, "status", "--config", str(config), "--json"],
                     [*FLYCTL, "runs", "submit", "--json"]):
            env = site.env(FLYD_CONFIG=str(config)) if "--config" not in argv else None
            _refused(site, argv, "CONFIG", str(config), *words, env=env)
        code, doc, stderr = _run(site, _flyd("router", "--config", str(config), *sock),
                                 timeout=30)
        assert (code, doc) == (2, None) and str(config) in stderr and words[0] in stderr, stderr
    _untouched(site, "latin.toml", "folder.toml")


def test_an_oversize_spec_exits_2_naming_its_limit(site: Site) -> None:
    """A 50 MB spec was accepted at submit and failed at launch after 3 grants; one of 2.5 M
    keys timed out. A spec is at most 1 MiB of JSON and 65536 object keys (docs), refused at
    submit naming the limit; a stored one that exceeds it fails on its first claim (the queued
    specs test covers the claim)."""
    big = site.path / "big.json"
    big.write_text(json.dumps({"world": {"config": {"blob": "x" * (3 << 19)}}}))
    keys = site.path / "keys.json"
    keys.write_text(json.dumps({"world": {"config": {f"k{i}": 0 for i in range(70_000)}}}))
    assert keys.stat().st_size < 1 << 20
    sock = ["--socket", site.socket]
    for spec, words in ((big, "at most 1048576 bytes"), (keys, "at most 65536 object keys")):
        for argv in (_flyd("run", "--spec", str(spec), "--steps", "10", "--json", *sock),
                     [*FLYCTL, "runs", "submit", "--spec", str(spec), "--json"]):
            _refused(site, argv, "USAGE", words)
    _untouched(site, "big.json", "keys.json")


def test_an_embedded_server_that_cannot_start_names_its_cause(site: Site) -> None:
    """A state dir on a full file system: the embedded PostgreSQL's start failure said
    `did not start (None)`; it names the disk now (exit 2, `CONFIG`)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = site.path / "small"
    mount.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
                   check=True)
    try:
        env = {k: v for k, v in site.env(FLYD_STATE_DIR=str(mount / "state")).items()
               if k != "FLYD_DSN"}
        message = _refused(site, _flyd("run", "--steps", "10", "--json", "--socket",
                                       site.socket), "CONFIG", str(mount / "state" / "pg"),
                           "No space left on device", "free space", env=env)
        assert "(None)" not in message
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    mount.rmdir()


def _pickled_envelope(path: Path) -> Path:
    """The fixture's checkpoint with its world state replaced by a pickle: what an adapter
    that pickles (pettingzoo, gymnasium) writes, from somewhere else."""
    import hashlib
    import pickle

    from flyd.state.envelope import decode, encode
    from workers.state import plugin_blob

    envelope = decode(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    payloads = []
    for name, body in envelope.payloads:
        if name == "world":
            doc = orjson.loads(body)
            doc["world"] = plugin_blob(pickle.dumps({"env": "anything"}))
            body = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
        payloads.append((name, body))
    manifest = dict(envelope.manifest)
    manifest["payloads"] = [{"name": name, "byteLength": str(len(body)),
                             "digest": hashlib.sha256(body).hexdigest()}
                            for name, body in payloads]
    path.write_bytes(encode(manifest, payloads))
    return path


def test_import_of_a_foreign_pickled_envelope_needs_trust(site: Site) -> None:
    """`flyctl checkpoints import` unpickled whatever a file held (at restore): a file with
    pickled payloads that this database did not write is refused, saying why, unless
    `--trust`; a file without pickles imports as before."""
    foreign = _pickled_envelope(site.path / "foreign.flysess")
    verify = _run(site, [*FLYCTL, "checkpoints", "verify", str(foreign), "--json"])
    assert verify[0] == 0 and verify[1] == {"ok": True, "check": None, "reason": None}, verify
    message = _refused(site, [*FLYCTL, "checkpoints", "import", str(foreign), "--steps", "10",
                              "--json"], "USAGE", str(foreign), "world/world", "unpickle",
                       "--trust")
    assert "not written by this database" in message
    assert _rows(site) == (0, 0)
    code, doc, stderr = _run(site, [*FLYCTL, "checkpoints", "import", str(foreign), "--steps",
                                    "10", "--trust", "--json"])
    assert code == 0 and doc is not None and doc["boundary"] == 2, (doc, stderr)
    assert _rows(site) == (1, 1)
    plain = site.path / "plain.flysess"
    plain.write_bytes(base64.b64decode(json.loads(FIXTURE.read_text())["envelope"]))
    code, doc, stderr = _run(site, [*FLYCTL, "checkpoints", "import", str(plain), "--steps",
                                    "10", "--json"])
    assert code == 0 and doc is not None, (doc, stderr)
