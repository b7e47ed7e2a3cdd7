"""How a rank of a multi-process launch ends: with its status and its output flushed, without the interpreter's
teardown, in which PyTorch's process-group worker threads can abort a finished run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: prints "teardown" if the interpreter's exit handlers run
TEARDOWN_PROBE = "import atexit; atexit.register(lambda: print('teardown', flush=True)); "


def python(code: str, world_size: int | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    if world_size is not None:
        env["WORLD_SIZE"] = str(world_size)
    return subprocess.run(
        [sys.executable, "-c", TEARDOWN_PROBE + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_end_launched_process_exits_with_its_status_after_flushing_and_skips_the_teardown():
    code = (
        "import logging, sys; from mmrl.distributed import end_launched_process; "
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO); logging.getLogger('x').info('logged'); "
        "print('printed', end=''); end_launched_process(3)"
    )
    done = python(code, world_size=2)
    assert done.returncode == 3
    assert done.stdout == "printed"  # buffered output is flushed, the exit handlers do not run
    assert "logged" in done.stderr


def test_the_command_line_ends_a_launched_rank_without_teardown_and_returns_otherwise():
    code = "from mmrl.cli import main; raise SystemExit(main(['memory', 'configs/demo/flow_shapes.yaml']))"
    launched = python(code, world_size=2)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert "resident" in launched.stdout and "teardown" not in launched.stdout
    alone = python(code, world_size=None)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "resident" in alone.stdout and alone.stdout.rstrip().endswith("teardown")
