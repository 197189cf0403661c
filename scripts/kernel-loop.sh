#!/usr/bin/env bash
# A kernel filesystem on a loop device, to measure beside wbstack with --dir-path:
#
#   scripts/kernel-loop.sh [ext4|xfs] [--size 16G] [--dir DIR] [--name NAME]
#   scripts/kernel-loop.sh --teardown [--dir DIR] [--name NAME]
#
# Sets up: a sparse image DIR/NAME.img on this machine's disk, attached as a buffered loop
# device (as in shared/reference/kernel-here.md), a fresh mkfs (defaults), mounted on
# DIR/NAME.mnt. Prints MOUNT=... and LOOP=... (and the queue settings); --teardown
# unmounts, detaches and removes the image. Needs root.
#
#   eval "$(scripts/kernel-loop.sh ext4 | grep -E '^(MOUNT|LOOP)=')"
#   wbstack bench fsmark --dir-path "$MOUNT" -d 0 -d 1 -D 10000 -S0 -n 20000 -s 4096 -L 8
#   scripts/kernel-loop.sh --teardown
set -euo pipefail

fs=ext4
size=16G
dir=${KERNEL_LOOP_DIR:-/work/kernel-loop}
name=wbs
teardown=0
while (($#)); do
  case "$1" in
    ext4 | xfs) fs=$1 ;;
    --size) size=${2:?--size needs a value}; shift ;;
    --dir) dir=${2:?--dir needs a value}; shift ;;
    --name) name=${2:?--name needs a value}; shift ;;
    --teardown) teardown=1 ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "kernel-loop.sh: unknown argument '$1' (ext4|xfs, --size, --dir, --name, --teardown)" >&2; exit 2 ;;
  esac
  shift
done

die() { echo "kernel-loop.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (losetup, mkfs, mount)"

img=$dir/$name.img
mnt=$dir/$name.mnt
state=$dir/$name.loop

if ((teardown)); then
  if mountpoint -q "$mnt" 2>/dev/null; then
    umount "$mnt"
  fi
  if [ -f "$state" ]; then
    loop=$(cat "$state")
    # Only detach the loop device if it is still backed by our image.
    if losetup -n -O BACK-FILE "$loop" 2>/dev/null | grep -qF "$img"; then
      losetup -d "$loop"
    fi
    rm -f "$state"
  fi
  rm -f "$img"
  rmdir "$mnt" 2>/dev/null || true
  echo "torn down $name in $dir"
  exit 0
fi

need() { command -v "$1" >/dev/null 2>&1; }
pkg_for() { case "$1" in mkfs.xfs) echo xfsprogs ;; mkfs.ext4) echo e2fsprogs ;; losetup) echo mount ;; esac; }
for t in losetup "mkfs.$fs"; do
  if ! need "$t"; then
    echo "installing $(pkg_for "$t") for $t" >&2
    apt-get update -qq >&2 && apt-get install -y -qq "$(pkg_for "$t")" >&2
  fi
done

if [ -e "$state" ] || mountpoint -q "$mnt" 2>/dev/null; then
  die "$name is already set up in $dir (run with --teardown first)"
fi
mkdir -p "$dir" "$mnt"
rm -f "$img"
truncate -s "$size" "$img"
loop=$(losetup -f --show "$img")
echo "$loop" >"$state"
case "$fs" in
  ext4) mkfs.ext4 -q -F "$loop" >&2 ;;
  xfs) mkfs.xfs -q -f "$loop" >&2 ;;
esac
mount "$loop" "$mnt"

q=/sys/block/$(basename "$loop")/queue
show() {
  [ -r "$q/$1" ] || return 0
  local v
  v=$(cat "$q/$1")
  # The scheduler file lists all of them with the active one in brackets.
  if [[ $v == *"["* ]]; then v=${v#*[}; v=${v%%]*}; fi
  echo "$1=$v"
}
echo "$fs on $loop ($size sparse at $img), mounted on $mnt"
echo "queue: $(show scheduler) $(show wbt_lat_usec) $(show max_sectors_kb) $(show nr_requests)"
echo "MOUNT=$mnt"
echo "LOOP=$loop"
