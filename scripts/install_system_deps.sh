#!/usr/bin/env bash
# System libraries the Python packages load at run time: libcairo2 for cairosvg (SVG rewards).
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q "libcairo.so.2"; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends libcairo2 >/dev/null
echo "system deps: libcairo2 installed"
