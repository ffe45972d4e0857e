#!/usr/bin/env bash
# Install everything ckptfs needs on a fresh Debian machine: system packages (pyfuse3 builds
# from source against libfuse3; e2fsprogs makes the power-loss tests' ext4 images) and a
# virtualenv in .venv with ckptfs and its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=0
for pkg in fuse3 libfuse3-dev pkg-config gcc e2fsprogs; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" = 1 ] || [ "${CKPTFS_APT_UPDATE:-0}" = 1 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq fuse3 libfuse3-dev pkg-config gcc e2fsprogs >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# Skipped when nothing it depends on changed since the last install (the install is editable:
# code changes need none). Its output is kept in .venv/setup.log and shown only on failure
# (setuptools warns on every editable build, which is noise to someone running the demo).
# `rm .venv/.ckptfs-setup` forces a reinstall.
extras="test${CKPTFS_EXTRAS:+,$CKPTFS_EXTRAS}"
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
if [ -x .venv/bin/ckptfs ] && [ "$(cat .venv/.ckptfs-setup 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/pip install -q -e ".[$extras]" >.venv/setup.log 2>&1; then
  cat .venv/setup.log >&2
  echo "setup: pip install -e '.[$extras]' failed (output above, also in .venv/setup.log)" >&2
  exit 1
fi
echo "$stamp" >.venv/.ckptfs-setup
