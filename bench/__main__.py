"""Run every ``bench/bench_*.py`` in turn: ``python -m bench [--quick] [names...] [--option value ...]``.

Each benchmark prints its own table (ratios against its peers, measured in the same run)
and is also runnable alone: ``python -m bench.bench_packing --quick``. Options after the names other than
``--quick`` go to each chosen benchmark's own parser: ``python -m bench fuzz --examples 100000``.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import bench


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    first_option = next((i for i, a in enumerate(argv) if a.startswith("-") and a != "--quick"), len(argv))
    names = [a for a in argv[:first_option] if not a.startswith("-")]
    extra = [a for a in argv[first_option:] if a != "--quick"]
    mods = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    if names:
        mods = [m for m in mods if any(n in m for n in names)]
    rc = 0
    for name in mods:
        print(f"\n===== {name} {'(quick)' if quick else ''} =====", flush=True)
        t0 = time.perf_counter()
        mod = importlib.import_module(f"bench.{name}")
        try:
            r = mod.main((["--quick"] if quick else []) + extra)
            rc |= int(r or 0)
        except SystemExit as e:
            rc |= int(e.code or 0)
        print(f"----- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
