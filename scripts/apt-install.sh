#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages named on the command line that are not
# installed yet (apt-get update only when one is missing; sudo when not root).
# The one copy of this step: scripts/deps.sh (development and CI) and
# deploy/build.sh (the images' build stage) both call it.
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
