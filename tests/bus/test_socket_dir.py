"""Socket directories are owned or refused (wire.md §13; issue: a second local user could
pre-create `/tmp/flyd-<uid>/`, rename the node's socket and bind an impostor).

Two throwaway users are created for the test (`useradd`; the suite runs as root): a victim, as
whom flyd's router and client run (in forked children that `setuid`, so no interpreter needs to
be readable by them), and an attacker, who pre-creates the victim's default socket directory with
mode 0777 and listens on an impostor socket in it. The router refuses to start there and the
client refuses to connect there, each with `UnsafeDirectory` naming the directory; the impostor
accepts connections (a raw connect proves it, so the refusal is not vacuous) and never sees one
from flyd. Without the attacker's directory the router creates the default one 0700.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import secrets
import select
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bus.client import connect
from bus.limits import Limits
from bus.ownership import Trust, UnsafeDirectory, check_dir, dir_problem
from bus.policy import Policy
from bus.router import Router, RouterConfig, RouterStartError
from bus.store import StoreSettings
from flyd.config import default_socket

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


#: modules the forked children import lazily, loaded before the fork
PRELOAD = ("encodings.ascii", "encodings.utf_8", "encodings.idna", "asyncio.unix_events",
           "asyncio.selector_events")


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def _useradd() -> User:
    name = "flydt" + secrets.token_hex(4)
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    out = subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True)
    gid = subprocess.run(["id", "-g", name], check=True, capture_output=True, text=True)
    return User(name, int(out.stdout), int(gid.stdout))


@pytest.fixture
def users() -> Iterator[tuple[User, User]]:
    """(victim, attacker): two fresh uids, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating a second uid needs root")
    made: list[User] = []
    try:
        made.append(_useradd())
        made.append(_useradd())
        yield made[0], made[1]
    finally:
        for user in made:
            subprocess.run(["userdel", user.name], check=False, capture_output=True)
            shutil.rmtree(f"/tmp/flyd-{user.uid}", ignore_errors=True)


def as_user(user: User, body: Callable[[], Any]) -> Any:
    """Run `body` in a forked child as `user` (no supplementary groups, a bare environment) and
    return its JSON-able result; an exception in the child is re-raised here as its text."""
    for name in PRELOAD:  # the child cannot read this interpreter's files (under /root)
        importlib.import_module(name)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            for key in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY", "FLYD_SOCKET"):
                os.environ.pop(key, None)
            result: Any = {"ok": body()}
        except BaseException as exc:  # reported to the parent, which fails the test
            result, code = {"raised": f"{type(exc).__name__}: {exc}"}, 1
        with os.fdopen(write_fd, "w") as out:
            out.write(json.dumps(result))
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as inp:
        text = inp.read()
    os.waitpid(pid, 0)
    doc = json.loads(text)
    if "raised" in doc:
        raise AssertionError(f"as uid {user.uid}: {doc['raised']}")
    return doc["ok"]


def _router_config(path: str) -> RouterConfig:
    return RouterConfig(socket_path=path, limits=Limits(), policy=Policy.open(),
                        store=StoreSettings(enabled=False, root="/dev/shm"))


def _start_router(path: str) -> dict[str, Any]:
    """As the victim: start a router on `path`; what it refused, or the directory it made."""
    async def main() -> dict[str, Any]:
        router = Router(_router_config(path))
        try:
            await router.start()
        except RouterStartError as exc:
            cause = exc.__cause__
            return {"refused": str(exc), "type": type(cause).__name__,
                    "path": getattr(cause, "path", None)}
        st = os.lstat(os.path.dirname(path))
        await router.stop()
        return {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid}
    return asyncio.run(main())


def _connect(path: str) -> dict[str, Any]:
    """As the victim: connect a client to `path`; what it refused."""
    async def main() -> dict[str, Any]:
        try:
            client = await connect(path, client_id="victim", timeout=5)
        except UnsafeDirectory as exc:
            return {"refused": exc.message, "name": exc.name, "path": exc.path}
        await client.close()
        return {"connected": True}
    return asyncio.run(main())


def _impostor(path: str, attacker: User) -> tuple[int, int]:
    """As the attacker (forked): pre-create the directory 0777 and listen on `path`. Returns
    (pid, fd): closing the fd ends the impostor, which exits with the count of connections it
    accepted."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(stop_w)
        accepted = 0
        try:
            os.setgroups([])
            os.setgid(attacker.gid)
            os.setuid(attacker.uid)
            os.umask(0)
            os.mkdir(os.path.dirname(path), 0o777)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, 0o777)
            sock.listen(8)
            sock.setblocking(False)
            os.write(ready_w, b"r")
            while True:
                readable, _, _ = select.select([sock, stop_r], [], [])
                if stop_r in readable:
                    break
                conn, _ = sock.accept()
                accepted += 1
                conn.close()
        finally:
            os._exit(min(accepted, 100))
    os.close(ready_w)
    os.close(stop_r)
    assert os.read(ready_r, 1) == b"r", "the impostor did not start"
    os.close(ready_r)
    return pid, stop_w


def test_a_precreated_0777_socket_directory_is_refused(users: tuple[User, User]) -> None:
    victim, attacker = users
    default = as_user(victim, lambda: default_socket())
    assert default == f"/tmp/flyd-{victim.uid}/bus.sock"
    directory = os.path.dirname(default)

    # without interference the router creates the default directory 0700, its own
    made = as_user(victim, lambda: _start_router(default))
    assert made == {"mode": 0o700, "uid": victim.uid}, made
    shutil.rmtree(directory)

    pid, stop = _impostor(default, attacker)
    try:
        st = os.lstat(directory)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (attacker.uid, 0o777)
        # vacuity: something does accept on the victim's default socket
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(default)
        probe.close()

        refused = as_user(victim, lambda: _start_router(default))
        assert refused["type"] == "UnsafeDirectory" and refused["path"] == directory, refused
        assert directory in refused["refused"] and f"uid {attacker.uid}" in refused["refused"]
        assert stat.S_ISSOCK(os.lstat(default).st_mode)  # the router left the impostor alone

        client = as_user(victim, lambda: _connect(default))
        assert client["name"] == "NOT_AUTHORIZED" and client["path"] == directory, client
        assert directory in client["refused"]
    finally:
        os.close(stop)
        _, status = os.waitpid(pid, 0)
    # the impostor saw the probe's connection only: flyd never connected to it
    assert os.waitstatus_to_exitcode(status) == 1


def test_every_command_refuses_another_users_socket_directory(users: tuple[User, User],
                                                              tmp_path: Path) -> None:
    """The same refusal through the commands, as root this time: a socket directory owned by
    another uid (0777) stops `flyd router`, `flyd run` and `flyctl status` with exit 2 naming
    it, before anything starts."""
    _, attacker = users
    directory = Path("/tmp") / f"flyd-t-{secrets.token_hex(4)}"
    directory.mkdir()
    try:
        os.chown(directory, attacker.uid, attacker.gid)
        os.chmod(directory, 0o777)
        sock = str(directory / "bus.sock")
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLYD_SOCKET", "RUNTIME_DIRECTORY", "FLYD_CONFIG", "FLYD_DSN")}
        env.update(FLYD_STATE_DIR=str(tmp_path / "state"), FLYD_DSN="postgresql://nobody@/x")
        flyd = [sys.executable, "-m", "flyd"]
        flyctl = [sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; flyctl_main()"]
        out = subprocess.run([*flyd, "router", "--socket", sock], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and str(directory) in out.stderr, out
        for argv, code in (([*flyd, "run", "--steps", "3", "--json", "--socket", sock],
                            "CONFIG"),
                           ([*flyctl, "status", "--json", "--socket", sock], "NOT_AUTHORIZED")):
            out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                                 timeout=60, check=False)
            assert "Traceback" not in out.stdout + out.stderr, out
            assert out.returncode == 2, out
            doc = json.loads(out.stdout.splitlines()[-1])
            assert doc["error"]["code"] == code and str(directory) in doc["error"]["message"], doc
        assert list(directory.iterdir()) == []
        assert not (tmp_path / "state").exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_directory_rule(tmp_path: Path) -> None:
    """`dir_problem` on the modes the rule names; `check_dir` walks the ancestors."""
    me = os.geteuid()
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert dir_problem(os.lstat(d), Trust.own()) is None
    for mode, trust, words in ((0o777, Trust.own(), "others may write"),
                               (0o770, Trust.own(), "group"),
                               (0o750, Trust.own(private=True), "0700")):
        os.chmod(d, mode)
        problem = dir_problem(os.lstat(d), trust)
        assert problem is not None and words in problem, (mode, problem)
    os.chmod(d, 0o770)
    assert dir_problem(os.lstat(d), Trust.own(os.lstat(d).st_gid)) is None
    os.chmod(d, 0o700)
    link = tmp_path / "link"
    link.symlink_to(d)
    assert dir_problem(os.lstat(link), Trust.own()) == "it is a symlink"
    assert dir_problem(os.lstat(d), Trust(frozenset({me + 1}))) is not None
    inner = d / "inner"
    inner.mkdir(mode=0o700)
    os.chmod(d, 0o777)  # an ancestor others may write: `inner` could be swapped
    with pytest.raises(UnsafeDirectory) as info:
        check_dir(str(inner), Trust.own())
    assert info.value.path == str(d)
    os.chmod(d, 0o1777)  # sticky, as /tmp: nobody else may rename `inner`
    check_dir(str(inner), Trust.own())
