"""The README's op example runs as written (documentation that cannot rot)."""

from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_op_example_runs():
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    example = [b for b in blocks if "mamba_split_conv1d_scan_ref(zxbcdt" in b]
    assert len(example) == 1
    namespace: dict = {}
    exec(compile(example[0], "README.md", "exec"), namespace)  # the block asserts its own result
    assert namespace["out"].shape == (2, 256, 32) and namespace["final"].shape == (2, 4, 8, 16)
