"""Regenerate the README's performance section from committed result files.

    PYTHONPATH=src python benchmarks/tools/update_readme.py benchmarks/results/h200

Replaces what stands between ``<!-- results:start -->`` and ``<!-- results:end -->`` with the
output of ``flashkernel report DIR --markdown``; the tables are never typed by hand.
"""

import re
import subprocess
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def main(results_dir: str) -> int:
    report = subprocess.run(
        [sys.executable, "-m", "flashkernel.cli", "report", results_dir, "--markdown"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} section")
    body = f"{START}\n{report}\n{END}"
    readme.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: body, text, flags=re.S))
    print(f"updated {readme} from {results_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h200"))
