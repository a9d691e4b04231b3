"""Router configuration from TOML (cli.md §2, wire.md §12–§14).

Strict by design: an unknown key, a wrong type or an out-of-range value is a `ConfigError`
naming the key and the file, never silently ignored. Only the `[bus]` section is interpreted
here; the other sections of cli.md §2.3 are accepted by name and owned by their modules.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from bus.limits import LimitError, Limits
from bus.policy import Policy, PolicyError
from bus.router import SUN_PATH_MAX, RouterConfig

KNOWN_SECTIONS: Final = ("node", "bus", "database", "leases", "session", "checkpoints")
BUS_KEYS: Final = ("socket", "socket_group", "allowed_uids", "limits", "policy")


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the file."""


def default_socket(node_name: str | None = None) -> str:
    """cli.md §2.2: systemd's runtime dir, XDG runtime dir, /run for root, else /tmp."""
    sub = (node_name,) if node_name else ()
    if os.environ.get("RUNTIME_DIRECTORY"):
        return os.path.join(os.environ["RUNTIME_DIRECTORY"], "bus.sock")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "flyd", *sub, "bus.sock")
    if os.geteuid() == 0:
        return os.path.join("/run/flyd", *sub, "bus.sock")
    return os.path.join(f"/tmp/flyd-{os.geteuid()}", *sub, "bus.sock")


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for section in data:
        if section not in KNOWN_SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]")
    return data


def router_config(config_file: Path | None, socket_path: str | None,
                  open_policy: bool = False, node_pid: int | None = None) -> RouterConfig:
    """Build the router's configuration: defaults < file < flags."""
    bus: Mapping[str, Any] = {}
    where = str(config_file) if config_file else "defaults"
    if config_file is not None:
        bus = load_toml(config_file).get("bus", {})
        if not isinstance(bus, Mapping):
            raise ConfigError(f"{where}: [bus] must be a table")
        for key in bus:
            if key not in BUS_KEYS:
                raise ConfigError(f"{where}: unknown key [bus] {key}")
    socket = socket_path or os.environ.get("FLYD_SOCKET") or bus.get("socket") or default_socket()
    if not isinstance(socket, str) or len(os.fsencode(socket)) > SUN_PATH_MAX:
        raise ConfigError(f"{where}: [bus] socket must be a path of at most {SUN_PATH_MAX} bytes")
    group = bus.get("socket_group")
    if group is not None and not isinstance(group, str):
        raise ConfigError(f"{where}: [bus] socket_group must be a string")
    uids = bus.get("allowed_uids")
    if uids is not None and (not isinstance(uids, list)
                             or not all(isinstance(u, int) and u >= 0 for u in uids)):
        raise ConfigError(f"{where}: [bus] allowed_uids must be a list of uids")
    try:
        limits = Limits.from_config(dict(bus.get("limits", {})))
    except LimitError as exc:
        raise ConfigError(f"{where}: [bus.limits] {exc}") from exc
    try:
        if open_policy:
            policy = Policy.open()
        elif "policy" in bus:
            policy = Policy.from_config(bus["policy"])
        else:
            policy = Policy.default(node_pid)
    except PolicyError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if group is not None:
        import grp

        try:
            grp.getgrnam(group)
        except KeyError:
            raise ConfigError(f"{where}: [bus] socket_group {group!r} is not a group") from None
    return RouterConfig(socket_path=socket, limits=limits, policy=policy, socket_group=group,
                        allowed_uids=tuple(uids) if uids is not None else None)
