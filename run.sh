#!/usr/bin/env bash
# Set up flashkernel on this machine (once) and run one job:
#   ./run.sh check [--quick]      correctness of every kernel against the float64 reference
#   ./run.sh test [pytest args]   the test suite
#   ./run.sh info                 versions, the device, its measured ceilings
#   ./run.sh bench ...            benchmarks (GPU; see README); likewise profile, plot, report, merge
#   ./run.sh python [args]        the Python it uses, with flashkernel importable
#   ./run.sh gpu-test [parts]     GPU reliability suite: tests, fuzzer, sanitizers (benchmarks/tools/gpu_test.py)
# With a CUDA build of torch already present (the GPU machines), it uses that Python as is.
# Otherwise it makes .venv with the CPU build of torch and Triton's interpreter, and installs
# flashkernel there (editable, with the [test] extra) once: again only when pyproject.toml
# changes. Then .venv/bin/flashkernel is the same program as `./run.sh <command>`.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    VENV=${FLASHKERNEL_VENV:-.venv}
    STAMP="$VENV/.flashkernel-installed"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    fi
    wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]; then
        "$VENV/bin/python" -m pip install -q -e ".[test]"
        echo "$wanted" > "$STAMP"
    fi
    PY="$VENV/bin/python"
fi

job=${1:-check}
shift || true
case "$job" in
    test)   exec "$PY" -m pytest -q -n 2 -p no:cacheprovider "$@" ;;
    python) exec "$PY" "$@" ;;
    gpu-test) exec "$PY" benchmarks/tools/gpu_test.py "$@" ;;
    info|check|bench|profile|plot|report|merge) exec "$PY" -m flashkernel.cli "$job" "$@" ;;
    *) echo "usage: ./run.sh check | test [pytest args] | info | bench | profile | plot | report | merge [args] | python [args] | gpu-test [tests|fuzz|sanitize|summary]" >&2
       exit 2 ;;
esac
