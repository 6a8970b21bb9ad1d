"""A pytest plugin (``-p tools.gpu_check.rows``) that turns the stream tests parts (d) and (e) run
into rows of the check's table: each test's outcome is appended to the file named by
``PARO_GPU_CHECK_ROWS`` as soon as it is known (``report.Emitter``), so a part that crashes or
times out keeps what already ran; at the end one row says how the session ended."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from .checks import FAIL, PASS, SKIP, check
from .report import Emitter

_emit: Optional[Emitter] = None
_part = ""


def pytest_configure(config: Any) -> None:
    global _emit, _part
    path = os.environ.get("PARO_GPU_CHECK_ROWS")
    _part = os.environ.get("PARO_GPU_CHECK_PART", "t")
    _emit = Emitter(Path(path), _part) if path else None


def _measured(report: Any) -> str:
    if report.skipped:
        return str(report.longrepr[-1]).removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) else "skipped"
    if report.failed:
        text = report.longreprtext.strip().splitlines()
        errors = [ln[1:].strip() for ln in text if ln.startswith("E ")]
        return " | ".join(errors[:3] or text[-1:])[:400]
    return str(dict(report.user_properties).get("measured", ""))


def pytest_runtest_logreport(report: Any) -> None:
    """The call's outcome, or the setup's / teardown's when it failed or skipped the test."""
    if _emit is None or not (report.when == "call" or report.failed or (report.skipped and report.when == "setup")):
        return
    status = FAIL if report.failed else SKIP if report.skipped else PASS
    name = report.nodeid.split("::", 1)[-1] + (f" ({report.when})" if report.failed and report.when != "call" else "")
    _emit(check(_part, f"{_part}.{name}", name, status, _measured(report), seconds=round(report.duration, 1)))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _emit is not None:
        ok = int(exitstatus) == 0
        _emit(
            check(
                _part,
                f"{_part}.tests",
                "pytest: the session",
                PASS if ok else FAIL,
                f"{session.testscollected} tests, {session.testsfailed} failed"
                + ("" if ok else f", exit {int(exitstatus)}"),
            )
        )
