"""The mpddp logger: printed like a print by default, silenced or routed as any library's.

What a person sees is read from a real process's stderr; what pytest's own logging plugin does
(pytest 9 attaches its capture handlers to every non-propagating logger) must change nothing.
"""

import logging
import subprocess
import sys

import pytest

import mpddp.log
from mpddp.log import logger


@pytest.fixture
def restore_logger():
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    root_handlers = list(logging.getLogger().handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate
    logging.getLogger().handlers[:] = root_handlers


def stderr_of(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", "from mpddp.log import logger\n" + code],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    return out.stderr


def test_default_is_the_bare_message_on_stderr():
    said = stderr_of("logger.warning('mpddp: GPU 3 is busy')\nlogger.info('mpddp: restarting the group (1 of 1)')")
    assert said == "mpddp: GPU 3 is busy\nmpddp: restarting the group (1 of 1)\n"


def test_an_application_that_configures_logging_prints_each_notice_once_in_its_own_format():
    said = stderr_of("import logging\nlogging.basicConfig(format='app: %(levelname)s %(message)s')\n"
                     "logger.info('mpddp: restarting the group (1 of 1)')")
    assert said == "app: INFO mpddp: restarting the group (1 of 1)\n"


def test_a_handler_that_writes_elsewhere_does_not_silence_the_console(tmp_path):
    log = tmp_path / "job.log"
    said = stderr_of(f"import logging\nlogging.getLogger().addHandler(logging.FileHandler({str(log)!r}))\n"
                     "logger.info('mpddp: restarting the group (1 of 1)')")
    assert said == "mpddp: restarting the group (1 of 1)\n"
    assert log.read_text() == "mpddp: restarting the group (1 of 1)\n"


def test_printed_under_pytest_whatever_its_logging_plugin_attached(capsys, restore_logger):
    logger.warning("mpddp: GPU 3 is busy")
    logger.info("mpddp: restarting the group (1 of 1)")
    captured = capsys.readouterr()
    assert captured.err == "mpddp: GPU 3 is busy\nmpddp: restarting the group (1 of 1)\n"
    assert captured.out == ""


def test_a_capture_handler_on_the_logger_itself_gets_the_record_and_the_console_still_prints(capsys, restore_logger):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.warning("mpddp: GPU 3 is busy")
    assert [r.getMessage() for r in records] == ["mpddp: GPU 3 is busy"]
    assert capsys.readouterr().err == "mpddp: GPU 3 is busy\n"


def test_caplog_sees_the_records(caplog):
    with caplog.at_level(logging.INFO, logger="mpddp"):
        logger.info("mpddp: restarting the group (1 of 1)")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("mpddp", logging.INFO, "mpddp: restarting the group (1 of 1)")]


def test_an_application_silences_it(capsys, restore_logger):
    logging.getLogger("mpddp").setLevel(logging.ERROR)
    logger.warning("mpddp: GPU 3 is busy")
    assert capsys.readouterr().err == ""


def test_an_application_takes_over_the_output(capsys, restore_logger):
    logger.removeHandler(mpddp.log.console)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mine: %(message)s"))
    logger.addHandler(handler)
    logger.warning("mpddp: GPU 3 is busy")
    assert capsys.readouterr().err == "mine: mpddp: GPU 3 is busy\n"


def test_a_console_handler_that_does_not_propagate_is_not_doubled(capsys, restore_logger):
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate = False
    logger.warning("mpddp: GPU 3 is busy")
    assert capsys.readouterr().err == "mpddp: GPU 3 is busy\n"


def test_importing_twice_keeps_one_console():
    said = stderr_of("import importlib, mpddp.log\nimportlib.reload(mpddp.log)\nlogger.info('once')")
    assert said == "once\n"
