import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import leftovers  # noqa: E402


@pytest.fixture
def no_leftovers():
    """Fail the test if any process it started (other than the forkserver) survives it."""
    yield
    left = leftovers()
    for proc in left:
        proc.kill()
    assert not left, f"processes left running: {[p.cmdline() for p in left]}"
