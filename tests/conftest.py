"""Shared fixtures: the rank pools and a report of measured numbers printed after the run."""

from __future__ import annotations

import pytest

from tests import _harness

_REPORT: list[str] = []


@pytest.fixture
def report():
    """``report(line)`` adds a measured figure (error, bytes, memory) to the end-of-run summary."""
    return _REPORT.append


def pytest_sessionfinish(session, exitstatus):
    _harness.close_pools()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _REPORT:
        terminalreporter.section("measured figures")
        for line in _REPORT:
            terminalreporter.write_line(line)
