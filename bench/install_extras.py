"""How long `pip install 'diloco[aws]'` / `'diloco[sagemaker]'` take in a fresh virtual environment, as users
install: torch already there, no constraints file. The target: under 90 s each on a 2-core machine.

    python bench/install_extras.py [--torch torch==2.13.0] [--extras aws sagemaker]

Each extra gets its own fresh venv (torch installed first, not timed); prints seconds per extra and pip's verdict.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed_install(extra: str, torch: str) -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory(prefix=f"diloco-extra-{extra}-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, torch], check=True)
        start = time.perf_counter()
        out = subprocess.run([*pip, f"{ROOT}[{extra}]"], capture_output=True, text=True)
        return time.perf_counter() - start, out.returncode, (out.stderr.strip().splitlines() or [""])[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="torch==2.13.0", help="the torch requirement installed first")
    parser.add_argument("--extras", nargs="+", default=["aws", "sagemaker"])
    args = parser.parse_args()
    print(f"{'extra':<12} {'seconds':>8}  result")
    for extra in args.extras:
        seconds, code, last = timed_install(extra, args.torch)
        print(f"{extra:<12} {seconds:>8.1f}  {'ok' if code == 0 else 'FAILED: ' + last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
