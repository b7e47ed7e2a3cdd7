"""The tree is lint-clean and formatted: `ruff check .` and `ruff format --check .` (pyproject's settings)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed ruff (the dev extra pins it) from the repository root."""
    executable = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if executable is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]' installs it")
    return subprocess.run([executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_is_clean():
    result = ruff("check", ".")
    assert result.returncode == 0, f"ruff check . found problems:\n{result.stdout}{result.stderr}"


def test_ruff_format_is_applied():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`; these files are not formatted:\n{result.stdout}"
