#!/bin/sh
# One-time setup for tests/test_lambda_package_arm64.py: qemu-user plus an arm64 (aarch64) Debian sysroot
# holding CPython, so the arm64 Lambda package can be imported by an aarch64 interpreter on an x86_64 machine.
#
#   sh tests/arm64/setup.sh            # as root (installs qemu-user with apt-get if it is missing)
#
# The sysroot goes to $SHARDFOLD_ARM64_SYSROOT (default ~/.cache/shardfold/arm64-sysroot). The system's apt
# sources are not touched: Debian's arm64 packages are resolved and downloaded with a private apt
# configuration under a temporary directory, then unpacked with dpkg-deb -x (nothing is installed).
#
# Which Python: Lambda's runtime is python3.12, but Debian ships no python3.12 for arm64 any more (bookworm has
# 3.11, trixie 3.13), so the sysroot holds trixie's python3.13 and the test builds the package for 3.13.
# See README ("What the package tests prove") for what that does and does not prove.
set -eu

SUITE=${SHARDFOLD_ARM64_SUITE:-trixie}
PYVER=${SHARDFOLD_ARM64_PYTHON:-3.13}
MIRROR=${SHARDFOLD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=${SHARDFOLD_ARM64_SYSROOT:-$HOME/.cache/shardfold/arm64-sysroot}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

if ! command -v qemu-aarch64 >/dev/null 2>&1; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends qemu-user
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
chmod 755 "$WORK"
mkdir -p "$WORK/etc/apt/apt.conf.d" "$WORK/etc/apt/preferences.d" "$WORK/etc/apt/sources.list.d" \
    "$WORK/var/lib/apt/lists/partial" "$WORK/var/cache/apt/archives/partial" "$WORK/var/lib/dpkg"
: > "$WORK/var/lib/dpkg/status"
echo "deb [arch=arm64 signed-by=$KEYRING] $MIRROR $SUITE main" > "$WORK/etc/apt/sources.list"

apt_private() {
    apt-get -q -o Dir="$WORK" -o Dir::State::status="$WORK/var/lib/dpkg/status" \
        -o Dir::Etc::TrustedParts=/etc/apt/trusted.gpg.d -o APT::Architecture=arm64 \
        -o APT::Architectures=arm64 -o APT::Sandbox::User=root -o Debug::NoLocking=1 "$@"
}
apt_private update
# the interpreter, its standard library and their shared libraries (libc6 included), plus libstdc++6: the
# manylinux policy lets wheels link the system's libstdc++ (numpy's do), and Lambda's Amazon Linux 2023 has it
apt_private install -y --download-only --no-install-recommends "python$PYVER-minimal" "libpython$PYVER-stdlib" \
    libstdc++6

rm -rf "$ROOT.new"
mkdir -p "$ROOT.new"
for deb in "$WORK"/var/cache/apt/archives/*.deb; do
    dpkg-deb -x "$deb" "$ROOT.new"
done
# trixie is merged-/usr: base-files (not unpacked here) makes /lib, /bin and /sbin links into /usr, and the
# binaries' ELF interpreter is /lib/ld-linux-aarch64.so.1
for dir in bin lib sbin; do
    [ -e "$ROOT.new/$dir" ] || ln -s "usr/$dir" "$ROOT.new/$dir"
done
rm -rf "$ROOT"
mv "$ROOT.new" "$ROOT"

qemu-aarch64 -L "$ROOT" "$ROOT/usr/bin/python$PYVER" -c \
    'import platform, sys; print(sys.version.split()[0], platform.machine(), "glibc", platform.libc_ver()[1])'
echo "arm64 sysroot ready: $ROOT"
