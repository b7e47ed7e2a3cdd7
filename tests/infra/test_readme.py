"""The README's Python examples run as written, and its two opening commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    install_and_demo, install_and_test = commands[0], commands[1]
    ci = (ROOT / ".ci/run").read_text()
    assert install_and_test.strip() in ci
    assert install_and_demo.split("&& mmrl")[0].strip() in install_and_test
