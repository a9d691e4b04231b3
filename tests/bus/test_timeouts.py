"""Every wire test runs under pytest-timeout's 10 s (wire.md §20). This module names no
timeout of its own, like test_codec.py and test_sdk_reply.py: the conftest's hook gives it."""

from __future__ import annotations

import pytest


def test_a_wire_test_without_a_timeout_of_its_own_gets_10_s(request: pytest.FixtureRequest
                                                            ) -> None:
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (10,), marker


@pytest.mark.timeout(30)
def test_a_wire_test_keeps_the_timeout_it_names(request: pytest.FixtureRequest) -> None:
    assert [m.args for m in request.node.iter_markers("timeout")] == [(30,)]
