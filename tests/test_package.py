"""The package as a user meets it: a cheap import, the API in dir() and help(), its metadata."""

import importlib.metadata
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest

import flashkernel
from helpers import needs_interpreter

PACKAGE_ROOT = str(Path(flashkernel.__file__).resolve().parents[1])
API = ("DecodePlan", "KVCache", "VarlenPlan", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
       "quantize_kv", "reference", "standard_attention")


def run_python(code: str, **env) -> str:
    """Run ``code`` in a fresh interpreter that imports this flashkernel; returns its stdout."""
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_public_api_is_what_the_docs_list():
    assert tuple(flashkernel.__all__) == API
    for name in API:
        assert name in flashkernel.__doc__, f"the module docstring does not list {name}"


def test_import_is_cheap_and_dir_shows_the_api_without_loading_it():
    out = run_python(
        "import sys, flashkernel\n"
        "names = dir(flashkernel)\n"
        "print(sorted(set(flashkernel.__all__) - set(names)))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or m == 'flashkernel.interface'))\n"
    )
    missing, loaded = out.splitlines()
    assert missing == "[]", f"dir(flashkernel) lacks {missing}"
    assert loaded == "[]", f"import flashkernel / dir() loaded {loaded}"


def test_help_lists_the_api():
    text = pydoc.render_doc(flashkernel, renderer=pydoc.plaintext)
    for name in API:
        assert name in text


@needs_interpreter
def test_interpreter_can_be_chosen_after_import():
    """TRITON_INTERPRET set after ``import flashkernel`` (before the first call) still works."""
    out = run_python(
        "import os, torch, flashkernel\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "q = torch.randn(1, 5, 2, 16, dtype=torch.float16)\n"
        "print(tuple(flashkernel.flash_attn_func(q, q, q).shape))\n",
        CUDA_VISIBLE_DEVICES="",
    )
    assert out.strip() == "(1, 5, 2, 16)"


def test_installed_metadata():
    """License as SPDX; numpy declared (Triton's interpreter imports it, undeclared); triton bounded."""
    # The metadata beside the imported package (site-packages, or src/ after a build), not
    # that of some other installed copy.
    found = [d for d in importlib.metadata.distributions(path=[PACKAGE_ROOT]) if d.metadata["Name"] == "flashkernel"]
    if not found:
        pytest.skip(f"no flashkernel metadata in {PACKAGE_ROOT} (run from a source tree never built)")
    meta = found[0].metadata
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("numpy") and "extra ==" not in r for r in requires), requires
    assert any(r.startswith("triton") and "<" in r and "extra ==" not in r for r in requires), requires
