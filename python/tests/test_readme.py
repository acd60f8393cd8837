"""The Python examples of README.md and docs/python.md's opening run as written."""

import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def python_blocks(path):
    with open(os.path.join(ROOT, path)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.parametrize("path", ["README.md", "docs/python.md"])
def test_the_first_python_example_runs(path, capsys):
    code = python_blocks(path)[0]
    exec(compile(code, path, "exec"), {"__name__": "example"})
    printed = capsys.readouterr().out
    assert "[" in printed  # it printed the ranks' results
