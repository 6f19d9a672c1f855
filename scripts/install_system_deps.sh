#!/usr/bin/env bash
# System packages the Python packages load at run time: libcairo2 for cairosvg (SVG rewards), and
# Debian's chromium, which playwright drives for the `ovpipe view` browser test (playwright's own
# browser download needs a network the CI machine does not have).
set -euo pipefail
need=()
ldconfig -p 2>/dev/null | grep -q "libcairo.so.2" || need+=(libcairo2)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "system deps: ${need[*]} installed"
