"""Start-up cost of the package: `import asynct`, `asynct --help`, and the engine's imports
(`from asynct import LLM`), each the best wall time of fresh interpreters, next to a bare
interpreter; then the slowest imports of the engine path from `python -X importtime`.

    PYTHONPATH=. python3 benchmarks/import_time.py [--runs 5]
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "python (bare interpreter)": ["-c", "pass"],
    "import asynct": ["-c", "import asynct"],
    "asynct --help": ["-m", "asynct.entrypoints.cli", "--help"],
    "engine: from asynct import LLM": ["-c", "from asynct import LLM"],
}
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def best_wall(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *args], env=ENV, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return min(times)


def slowest_imports(args: list[str], n: int) -> list[tuple[int, str]]:
    """(cumulative microseconds, package) of the top-level packages that cost most, wherever in
    the import tree they were first imported."""
    err = subprocess.run([sys.executable, "-X", "importtime", *args], env=ENV, check=True,
                         capture_output=True, text=True).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and "." not in parts[2].strip():
            rows.append((int(parts[1]), parts[2].strip()))
    return sorted(rows, reverse=True)[:n]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh interpreters per case; the best counts")
    a = ap.parse_args(argv)
    for name, args in CASES.items():
        print(f"{name:34s} {best_wall(args, a.runs):6.2f} s")
    print("\nslowest packages on the engine path (-X importtime, cumulative):")
    for us, module in slowest_imports(CASES["engine: from asynct import LLM"], 8):
        print(f"  {us / 1e6:6.2f} s  {module}")


if __name__ == "__main__":
    main()
