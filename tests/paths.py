"""Where things are, for tests in any folder under tests/."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
DATA = TESTS / "data"
