"""The mpddp logger: printed like a print by default, silenced or routed as any library's."""

import logging

import pytest

from mpddp.log import logger


@pytest.fixture
def restore_logger():
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def test_default_is_the_bare_message_on_stderr(capsys, restore_logger):
    logger.warning("mpddp: GPU 3 is busy")
    logger.info("mpddp: restarting the group (1 of 1)")
    captured = capsys.readouterr()
    assert captured.err == "mpddp: GPU 3 is busy\nmpddp: restarting the group (1 of 1)\n"
    assert captured.out == ""


def test_an_application_silences_it(capsys, restore_logger):
    logging.getLogger("mpddp").setLevel(logging.ERROR)
    logger.warning("mpddp: GPU 3 is busy")
    assert capsys.readouterr().err == ""


def test_an_application_routes_it_and_the_default_steps_aside(capsys, restore_logger):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("mpddp").addHandler(handler)
    logger.warning("mpddp: GPU 3 is busy")
    assert [r.getMessage() for r in records] == ["mpddp: GPU 3 is busy"]
    assert capsys.readouterr().err == ""


def test_propagating_to_a_configured_root_prints_once(capsys, restore_logger):
    records: list[logging.LogRecord] = []
    root_handler = logging.Handler()
    root_handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(root_handler)
    try:
        logger.propagate = True
        logger.warning("mpddp: GPU 3 is busy")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert [r.getMessage() for r in records] == ["mpddp: GPU 3 is busy"]
    assert capsys.readouterr().err == ""
