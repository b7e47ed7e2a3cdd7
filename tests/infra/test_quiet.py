"""A quiet start: a deferred import runs at the first use and not before, and ``mmrl`` loads a diffusers pipeline
without the loading bars (shown with ``--verbose``) and without importing bitsandbytes."""

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.quiet import defer_import

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package ``deferme`` whose import is observable: it counts its runs in ``deferme_runs`` on ``sys``."""
    package = tmp_path / "deferme"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import sys\nsys.deferme_runs = getattr(sys, 'deferme_runs', 0) + 1\nVALUE = 42\nfrom . import sub\n"
    )
    (package / "sub.py").write_text("import deferme\nSEEN = deferme.VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "deferme_runs", 0, raising=False)
    yield "deferme"
    for name in [n for n in sys.modules if n == "deferme" or n.startswith("deferme.")]:
        del sys.modules[name]


def test_deferred_import_runs_at_first_use_only(fake_package):
    assert defer_import(fake_package)
    import deferme

    assert sys.deferme_runs == 0
    inspect.getmodule(test_deferred_import_runs_at_first_use_only)  # reads every module's __file__
    assert importlib.util.find_spec(fake_package).name == fake_package
    assert sys.deferme_runs == 0
    assert deferme.VALUE == 42 and sys.deferme_runs == 1
    assert sys.modules["deferme"] is not deferme and sys.modules["deferme"].sub.SEEN == 42
    assert deferme.sub.SEEN == 42 and sys.deferme_runs == 1  # the stand-in reads from the real module
    assert not defer_import(fake_package)  # already imported
    assert not defer_import("no_such_package_here")


def test_importing_a_submodule_runs_the_package_first(fake_package):
    defer_import(fake_package)
    import deferme.sub

    assert sys.deferme_runs == 1 and deferme.sub.SEEN == 42


def test_a_failing_import_leaves_the_stand_in_to_retry(tmp_path, monkeypatch):
    (tmp_path / "brokenpkg.py").write_text("raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        defer_import("brokenpkg")
        import brokenpkg

        for _ in range(2):
            with pytest.raises(RuntimeError, match="broken on purpose"):
                brokenpkg.anything  # noqa: B018
            assert sys.modules["brokenpkg"] is brokenpkg
    finally:
        sys.modules.pop("brokenpkg", None)


def _eval_base_model(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """``mmrl eval`` of the committed flow checkpoint on one prompt in a fresh process; it prints the class of
    what ``sys.modules['bitsandbytes']`` holds at the end."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a red circle\n")
    code = (
        "import sys\nfrom mmrl.cli import main\n"
        f"rc = main(['eval', 'configs/demo/flow_shapes.yaml', '--prompts', {str(prompts)!r}, '--out', "
        f"{str(tmp_path / 'out')!r}, *{list(flags)!r}])\n"
        "print('bitsandbytes:', type(sys.modules.get('bitsandbytes')).__name__)\nsys.exit(rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_mmrl_starts_quietly_and_shows_the_libraries_with_verbose(tmp_path):
    quiet = _eval_base_model(tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert "Loading pipeline components" not in quiet.stderr and "Loading weights" not in quiet.stderr
    assert "gemm_4bit_forward" not in quiet.stderr
    assert "bitsandbytes: _DeferredModule" in quiet.stdout  # diffusers bound it, nothing used it
    verbose = _eval_base_model(tmp_path, "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert "Loading pipeline components" in verbose.stderr
    assert "bitsandbytes: _DeferredModule" in verbose.stdout
