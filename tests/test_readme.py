"""The README's CPU example runs as printed (Triton's interpreter, in a fresh process)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import flashkernel
from helpers import needs_interpreter

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- cpu-example"


def cpu_example() -> str:
    """The first ```python block after the ``cpu-example`` marker."""
    text = README.read_text()
    assert MARKER in text, f"README.md has no {MARKER} marker before its CPU example"
    match = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], flags=re.S)
    assert match, "no ```python block after the cpu-example marker"
    return match.group(1)


@needs_interpreter
def test_readme_cpu_example_runs_and_matches_float64(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(cpu_example())
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    # The flashkernel this test imported (the source tree, or an installed package).
    package_root = str(Path(flashkernel.__file__).resolve().parents[1])
    env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    errors = [float(x) for x in re.findall(r"max error vs float64 (\S+)", done.stdout)]
    assert len(errors) == 2, done.stdout
    assert all(err < 1e-2 for err in errors), done.stdout  # fp16: about 1e-3
