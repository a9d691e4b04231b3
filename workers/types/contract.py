"""The session contract's identities and method schemas: what a worker
announces in `Worker.Hello` and what a coordinator checks it against.

Why here and not in the shell: the coordinator records and compares `contract_digest()` (a
checkpoint's manifest, a bootstrap's hello check) and validates results with the same
`method_validator` the shell validates params with; both sides read one definition.

API:

    SCHEMA_ROOT, METHOD_SCHEMAS      the `schemas/` package directory, its session methods
    CONTRACT_NAME                    `flyd-session-v1`
    build_digest(), contract_digest()          `Worker.Hello` identities
    method_validator(method, kind)   the compiled `<method>.<kind>.json` (kind params|result)
    check_params(method, params)     `INVALID_ARGUMENT`/`none` when the params do not match
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import schemas as _schemas_package
from bus.schema import Validator, compile_schema
from workers.types.canonical import digest_bytes, digest_of, parse_strict
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = [
    "CONTRACT_NAME",
    "METHOD_SCHEMAS",
    "SCHEMA_ROOT",
    "build_digest",
    "check_params",
    "contract_digest",
    "method_validator",
]

CONTRACT_NAME: Final = "flyd-session-v1"
PACKAGE: Final = "flyd"
SCHEMA_ROOT: Final = Path(_schemas_package.__file__).resolve().parent
METHOD_SCHEMAS: Final = SCHEMA_ROOT / "session" / "methods"


@functools.cache
def build_digest() -> str:
    """`digest_bytes("flyd-build-v1\\nversion=<package version>\\n")`."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "0+unknown"
    return digest_bytes(f"flyd-build-v1\nversion={version}\n".encode())


@functools.cache
def contract_digest() -> str:
    """`digest_of({"contract": "flyd-session-v1", "schemas": {path: digest_bytes(file)}})`
    over every `*.json` under `schemas/` (paths relative to it, POSIX separators)."""
    files = {
        path.relative_to(SCHEMA_ROOT).as_posix(): digest_bytes(path.read_bytes())
        for path in sorted(SCHEMA_ROOT.rglob("*.json"))
    }
    return digest_of({"contract": CONTRACT_NAME, "schemas": files})


@functools.cache
def method_validator(method: str, kind: str) -> Validator:
    """The compiled schema `schemas/session/methods/<method>.<kind>.json` (kind params|result)."""
    path = METHOD_SCHEMAS / f"{method}.{kind}.json"
    schema = parse_strict(path.read_bytes())
    if not isinstance(schema, dict):
        raise DomainError(ErrorCode.INTERNAL, f"{path.name} is not a schema object",
                          Mutation.NONE)
    return compile_schema(schema)

def check_params(method: str, params: Mapping[str, Any]) -> None:
    """Validate `params` against the method's schema: `INVALID_ARGUMENT`/`none`."""
    problem = method_validator(method, "params")(params)
    if problem is not None:
        raise DomainError.invalid(f"{method} params: {problem}")
