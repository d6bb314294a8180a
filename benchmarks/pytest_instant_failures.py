"""A pytest plugin (``-p pytest_instant_failures``) that prints why a test failed as soon as it fails, as the
``file:line: message`` line of ``--tb=line`` and the traceback below it: a test run stopped at its time limit (the
device check's test step) still says why each failed test failed, where pytest would print that only at the end."""

from __future__ import annotations

_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if not report.failed or terminal is None:  # the terminal reporter registers itself after this plugin
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = crash.message.replace("\n", " ")[:400]
        terminal.write_line(f"{crash.path}:{crash.lineno}: {message}")
    terminal.write_line(f"--- {report.nodeid} ({report.when}):\n{report.longreprtext[-3000:]}\n---")
