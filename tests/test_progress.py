"""Progress bars stay readable where stderr is a log file, not a terminal."""

import io
import sys

from specforge_opd import progress


def _run(monkeypatch, **kw) -> str:
    err = io.StringIO()  # not a TTY, like a job's log file
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    bar = progress.progress_bar(4, "replay", "tok", **kw)
    for _ in range(4):
        bar.update(1)
    bar.close()
    return err.getvalue()


def test_a_log_gets_whole_lines_with_the_count(monkeypatch):
    out = _run(monkeypatch)
    assert "\r" not in out
    lines = out.splitlines()
    assert lines and all(line.startswith("replay:") for line in lines)
    assert "4/4" in lines[-1]


def test_inner_and_disabled_bars_stay_out_of_a_log(monkeypatch):
    assert _run(monkeypatch, log=False) == ""
    assert _run(monkeypatch, disable=True) == ""


def test_nested_bars_write_no_cursor_moves_into_a_log(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    outer = progress.progress_bar(2, "outer")
    inner = progress.progress_bar(2, "inner")
    inner.update(2)
    inner.close()
    outer.update(2)
    outer.close()
    assert "\x1b" not in err.getvalue() and "inner: 100%" in err.getvalue()
