"""Run every ``bench/bench_*.py`` in turn: ``python -m bench [--quick] [names...]``.

Each benchmark prints its own table (ratios against its peers, measured in the same run)
and is also runnable alone: ``python -m bench.bench_packing --quick``.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import bench


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    names = [a for a in argv if not a.startswith("-")]
    mods = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    if names:
        mods = [m for m in mods if any(n in m for n in names)]
    rc = 0
    for name in mods:
        print(f"\n===== {name} {'(quick)' if quick else ''} =====", flush=True)
        t0 = time.perf_counter()
        mod = importlib.import_module(f"bench.{name}")
        try:
            r = mod.main(["--quick"] if quick else [])
            rc |= int(r or 0)
        except SystemExit as e:
            rc |= int(e.code or 0)
        print(f"----- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
