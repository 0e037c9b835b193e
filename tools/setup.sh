#!/usr/bin/env bash
# Installs everything Tessera needs from Debian's packages. Idempotent: safe to run twice;
# apt-get update runs once, and only when something is missing.
set -euo pipefail

packages=(
  bazel-bootstrap bazel-rules-java
  g++ libeigen3-dev libfmt-dev nlohmann-json3-dev doctest-dev zlib1g-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist fortunes
  python3-torch libopenblas0-pthread python3-matplotlib
  clang libclang-rt-14-dev libomp-14-dev
  iproute2 util-linux
  fio
)

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup: done"
