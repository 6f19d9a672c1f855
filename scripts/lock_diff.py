"""Print the packages whose installed version differs from the lock: `python scripts/lock_diff.py LOCK PYTHON`.

Used by `make test-latest` (the canary venv built from pyproject.toml's newest allowed releases) so the
note after a canary run says exactly which upgrades the suite was run against.
"""
import json
import re
import subprocess
import sys


def lock_pins(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path):
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def installed(python: str) -> dict[str, str]:
    out = subprocess.run([python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                         check=True, capture_output=True, text=True).stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


def main(argv: list[str]) -> int:
    lock, python = argv
    pins, have = lock_pins(lock), installed(python)
    rows = [(n, pins[n], have.get(n, "-")) for n in sorted(pins) if have.get(n) != pins[n]]
    rows += [(n, "-", v) for n, v in sorted(have.items()) if n not in pins and n not in ("pip", "ovpipe", "lmms-engine")]
    print(f"canary vs {lock}: {len(rows)} package(s) differ")
    for name, locked, latest in rows:
        print(f"  {name:32s} {locked:>14s} -> {latest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
