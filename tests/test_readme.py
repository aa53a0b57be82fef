"""The README's CPU example runs as printed (Triton's interpreter, in a fresh process), and its
generated tables (call cost, training, end to end, quantized cache) are what
``benchmarks/tools/update_readme.py`` makes from the committed results."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("section, table", [("callcost", "call_cost_table"), ("training", "training_table"),
                                            ("e2e", "e2e_table"), ("kvquant", "kvquant_table"),
                                            ("kvquant-accuracy", "kvquant_accuracy_table")])
def test_readme_tables_are_generated_from_the_committed_results(section, table):
    spec = importlib.util.spec_from_file_location("update_readme", README.parent / "benchmarks/tools/update_readme.py")
    update_readme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update_readme)
    expected = getattr(update_readme, table)(README.parent / "benchmarks/results/h200")
    readme = README.read_text()
    found = re.search(rf"<!-- {section}:start -->\n(.*?)\n<!-- {section}:end -->", readme, flags=re.S)
    assert found, f"README.md has no {section} section"
    assert found.group(1) == expected, f"README's {section} table is stale: run benchmarks/tools/update_readme.py"
