#!/usr/bin/env bash
# Debian's own fs_mark on the wbstack FUSE mount and on a kernel filesystem on a loop
# device, on this machine's disk, one after the other; prints files/s including the
# final syncfs, and the device's writes and flushes (from the mount's
# .wbstack/diskstats and the loop device's /sys/block/loopN/stat).
#
#   scripts/fsmark-mount.sh [--fs ext4|xfs] [--size 16G] [--] FS_MARK_ARGS...
#   e.g. scripts/fsmark-mount.sh -- -D 100 -n 80000 -s 4096 -L 1 -S 0      (2 dirs)
#        scripts/fsmark-mount.sh -- -D 100 -n 2000 -s 4096 -L 1 -S 1 -t 8
#
# The two directories -d DIR/0 -d DIR/1 are added. WBSTACK_OPTS adds -o options to the
# mount. Needs root, fuse3 and fsmark (both installed when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
fs=ext4
size=16G
while (($#)); do
  case "$1" in
    --fs) fs=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
need() { command -v "$1" >/dev/null 2>&1; }
need fs_mark || { apt-get update -qq && apt-get install -y -qq fsmark; }
need fusermount3 || { apt-get update -qq && apt-get install -y -qq fuse3; }
cargo build --release -q -p wbstack-cli
W=$PWD/target/release/wbstack
work=${FSMARK_DIR:-/work/fsmark-mount}
mkdir -p "$work/wbs.mnt"

# fields 4/8 of the kernel's stat lines after major/minor/name: writes, sectors written;
# field 16 flushes. $1: a diskstats line (20 fields) or a sysfs stat line (17).
writes() { awk -v n="$(echo "$1" | wc -w)" '{o = (n == 20) ? 3 : 0; print $(o+5), $(o+7), $(o+16)}' <<<"$1"; }

run_arm() { # name dir statfile-reader [fs_mark args...]
  local name=$1 dir=$2 reader=$3
  shift 3
  mkdir -p "$dir/0" "$dir/1"
  local before after t0 t1 t2
  before=$($reader)
  t0=$(date +%s.%N)
  fs_mark -d "$dir/0" -d "$dir/1" "$@" >"$work/$name.fsmark.log" 2>&1 || { cat "$work/$name.fsmark.log"; exit 1; }
  t1=$(date +%s.%N)
  # syncfs(2) of this filesystem alone (coreutils' sync -f); Python's os module has no
  # syncfs, and its os.sync() flushed every filesystem on the machine. syncfs does not
  # reach a FUSE daemon: on the wbstack mount, the mount's own syncfs follows.
  sync -f "$dir"
  if [ "$name" = wbstack ]; then "$W" sync "$dir"; fi
  t2=$(date +%s.%N)
  after=$($reader)
  read -r w0 s0 f0 <<<"$(writes "$before")"
  read -r w1 s1 f1 <<<"$(writes "$after")"
  local files
  # fs_mark's Count column is cumulative (the files made so far, every thread's), so
  # the last loop's row is the total; summing the rows counted -L 2 as 1.5 times.
  files=$(awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+/ {n = $2} END {print n}' "$work/$name.fsmark.log")
  python3 - "$name" "$files" "$t0" "$t1" "$t2" "$((w1 - w0))" "$((s1 - s0))" "$((f1 - f0))" <<'PY'
import sys
name, files, t0, t1, t2, w, s, f = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6]), *map(int, sys.argv[6:9])
print(f"{name:10} files {files:8d}  fs_mark {t1-t0:7.2f}s  +sync {t2-t1:6.2f}s  files/s {files/(t2-t0):9.0f}  "
      f"(w/o sync {files/(t1-t0):9.0f})  dev writes {w:8d} avg {s*512/1024/max(w,1):7.1f} KiB  flushes {f:7d}  flushes/file {f/max(files,1):.3f}")
PY
}
shift_args=("$@")

# wbstack through FUSE, on an image on this disk.
"$W" umount "$work/wbs.mnt" 2>/dev/null || true
rm -f "$work/wbs.img"
"$W" mkfs "$work/wbs.img" --size "$size" >/dev/null
opts=()
[ -n "${WBSTACK_OPTS:-}" ] && opts=(-o "$WBSTACK_OPTS")
"$W" mount "$work/wbs.img" "$work/wbs.mnt" "${opts[@]}" >/dev/null
wbs_stat() { cat "$work/wbs.mnt/.wbstack/diskstats"; }
run_arm wbstack "$work/wbs.mnt" wbs_stat "${shift_args[@]}"
grep -E '^(journal_commits|journal_flushes|fuse_(lookup|create|write|flush|release|getattr|fsync|mkdir|getxattr|open)) ' "$work/wbs.mnt/.wbstack/stat" | tr '\n' ' '; echo
"$W" umount "$work/wbs.mnt"
"$W" fsck "$work/wbs.img" >/dev/null && echo "wbstack: fsck clean after umount"

# The kernel filesystem on a loop device on the same disk.
eval "$(KERNEL_LOOP_DIR=$work scripts/kernel-loop.sh "$fs" --size "$size" --dir "$work" --name k | grep -E '^(MOUNT|LOOP)=')"
k_stat() { cat "/sys/block/$(basename "$LOOP")/stat"; }
run_arm "$fs" "$MOUNT" k_stat "${shift_args[@]}"
scripts/kernel-loop.sh --teardown --dir "$work" --name k >/dev/null
