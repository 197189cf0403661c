#!/usr/bin/env bash
# Issue 5: readlat on ext4 in a loop device (kernel wbt at 2000 and 0) beside wbstack on
# a file: device on the same disk (wbt 2000 and 0, read_ahead_kb 128 and the loop's 2560),
# the same workload, one run. Needs root; RL_IMG is wbstack's image (default /work/rl.img).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p wbstack-cli
B=./target/release/wbstack
eval "$(scripts/kernel-loop.sh ext4 --size 16G | grep -E '^(MOUNT|LOOP)=')"
dev=$(basename "$LOOP")
q=/sys/block/$dev/queue
echo "loop $dev: scheduler $(cat $q/scheduler) wbt_lat_usec $(cat $q/wbt_lat_usec) rotational $(cat $q/rotational) read_ahead_kb $(cat $q/read_ahead_kb) max_sectors_kb $(cat $q/max_sectors_kb) optimal_io_size $(cat $q/optimal_io_size)"
W="--size 4G --background-dd 4000M --dd-delay 300ms"
for lat in 2000 0; do
  echo "== ext4 wbt_lat_usec=$lat"
  echo $lat > $q/wbt_lat_usec
  sync; echo 3 > /proc/sys/vm/drop_caches
  $B bench readlat --dir-path "$MOUNT" $W
done
echo 2000 > $q/wbt_lat_usec
scripts/kernel-loop.sh --teardown
rm -f ${RL_IMG:-/work/rl.img}
# wbstack with the kernel's dirty thresholds here (nr_dirty_background_threshold,
# nr_dirty_threshold from /proc/vmstat)
bg=$(( $(awk '/nr_dirty_background_threshold/{print $2}' /proc/vmstat) * 4096 ))
lim=$(( $(awk '/^nr_dirty_threshold/{print $2}' /proc/vmstat) * 4096 ))
# read_ahead_kb: wbstack's default (128), then the loop device's (2560)
for ra in 128 2560; do
for lat in 2000 0; do
  echo "== wbstack file: read_ahead_kb=$ra wbt_lat_usec=$lat (dirty_background_bytes=$bg dirty_bytes=$lim)"
  $B bench readlat --device file:${RL_IMG:-/work/rl.img},create=1,size=16G \
    -o cache_size=8G,dirty_background_bytes=$bg,dirty_bytes=$lim,read_ahead_kb=$ra,wbt_lat_usec=$lat $W
  rm -f ${RL_IMG:-/work/rl.img}
done
done
