"""Plugin loading: the class an import path names, and building it, a failure carrying its
`PluginFault`.

Why a module of its own: the node checks a run's task and executor classes at grant time, the
coordinator and an imported checkpoint load them, and the agent and environment endpoints load
their model and world; each must fail the same way (`INVALID_ARGUMENT` or `BACKEND_FAILURE`,
mutation `none`, the `PluginFault` as data), so there is one loader.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from workers.types.domain import DomainError, ErrorCode, Mutation, PluginFault, PluginStage

__all__ = ["construct_plugin", "load_plugin"]

T = TypeVar("T")


def load_plugin(path: str, what: str) -> type[Any]:
    """The class named by an import path `package.module:Class`; else `INVALID_ARGUMENT`/`none`
    with the `PluginFault` as data: an import that raises (anything, not only `ImportError`),
    a missing attribute or a non-class fail the same way on every attempt."""
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        fault = PluginFault.of(exc, path, PluginStage.IMPORT)
        raise DomainError(ErrorCode.INVALID_ARGUMENT,
                          f"{what} {path}: cannot import {module_name}: {fault.summary()}",
                          Mutation.NONE, fault) from None
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise DomainError(ErrorCode.INVALID_ARGUMENT,
                              f"{what} {path}: {module_name} has no {attribute}", Mutation.NONE,
                              PluginFault.of(exc, path, PluginStage.ATTRIBUTE)) from None
    if not isinstance(obj, type):
        message = f"{what} {path} is not a class"
        raise DomainError(ErrorCode.INVALID_ARGUMENT, message, Mutation.NONE, PluginFault(
            path, PluginStage.ATTRIBUTE, "TypeError", message, (), True))
    return obj


def construct_plugin(cls: type[T], path: str, what: str, **kwargs: Any) -> T:
    """`cls(**kwargs)`; an exception from the constructor is `BACKEND_FAILURE`/`none` carrying
    its `PluginFault` (stage `construct`): the same spec builds the same object, so it fails the
    same way on every attempt."""
    try:
        return cls(**kwargs)
    except Exception as exc:
        fault = PluginFault.of(exc, path, PluginStage.CONSTRUCT)
        raise DomainError(ErrorCode.BACKEND_FAILURE,
                          f"{what} {path}: building the {what} failed: {fault.summary()}",
                          Mutation.NONE, fault) from None

