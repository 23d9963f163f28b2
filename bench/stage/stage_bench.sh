#!/usr/bin/env bash
# stage_bench: stage-weights against rsync -a over ssh and tar | nc on the same path, with
# the three limits (source disk read, the link, target disk write) measured in the same run,
# fan-out to 3 targets vs 1, and sparkctl evict vs vmtouch -e.
#
# Network: one namespace per host (sender + up to 3 targets) joined by veth pairs to a
# bridge in its own namespace (the sender has ONE link, as behind a switch). Disk: the
# model lives under /var/tmp (a real filesystem). Targets are staged twice: onto a disk of
# their own (ext4 on a zram block device this script adds and removes; RAM-backed, so the
# copy does not read and write one device at once, as it never does between two nodes)
# and onto the source's own disk. All hosts share this machine's CPUs.
#
# Usage: bench/stage/stage_bench.sh BUILD_DIR [--size-gib N] [--targets N] [--json FILE]
# Needs root (namespaces, drop_caches). Prints a table (non-data lines start with '#') and
# then one JSON object; exits non-zero when a copy is not byte-identical.
set -euo pipefail
BUILD=${1:?usage: stage_bench.sh BUILD_DIR [--size-gib N] [--targets N] [--json FILE]}
shift
SIZE_GIB=4 TARGETS=3 JSON_OUT=""
while (($#)); do
  case $1 in
    --size-gib) SIZE_GIB=$2; shift 2 ;;
    --targets) TARGETS=$2; shift 2 ;;
    --json) JSON_OUT=$2; shift 2 ;;
    *) echo "stage_bench: unknown option $1" >&2; exit 2 ;;
  esac
done
SPARKCTL=$(readlink -f "${SPARKCTL:-$BUILD/cli/sparkctl}")  # SPARKCTL= overrides (GPU machine)
[[ -x $SPARKCTL ]] || { echo "stage_bench: $SPARKCTL not built" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "stage_bench: needs root (namespaces, drop_caches)" >&2; exit 2; }
for t in ip python3 openssl dd; do
  command -v "$t" >/dev/null || { echo "stage_bench: $t missing" >&2; exit 2; }
done
# The peers and the link limit are measured where their tools exist; a machine without them
# (the offline GPU machine) skips those rows and says so.
HAVE_RSYNC=1 HAVE_NC=1 HAVE_IPERF=1 HAVE_VMTOUCH=1
for t in rsync ssh /usr/sbin/sshd ssh-keygen; do
  command -v "$t" >/dev/null || { HAVE_RSYNC=0; echo "# rsync over ssh: skipped ($t missing)"; break; }
done
command -v nc >/dev/null || { HAVE_NC=0; echo "# tar | nc: skipped (nc missing)"; }
command -v iperf3 >/dev/null || { HAVE_IPERF=0; echo "# link limit: skipped (iperf3 missing)"; }
command -v vmtouch >/dev/null || { HAVE_VMTOUCH=0; echo "# vmtouch -e: skipped (vmtouch missing)"; }

P=sb$$
WORK=$(mktemp -d /var/tmp/sparkbench-XXXXXX)
SRC=$WORK/src
NET=10.$((200 + $$ % 50)).$(($$ % 250))
ns() { echo "$P-$1"; }   # host namespaces: s (sender), t1..t3; bridge: br
ip_of() { case $1 in s) echo "$NET.1" ;; t*) echo "$NET.$((1 + ${1#t}))" ;; esac; }
PIDS=()

cleanup() {
  set +e
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for n in s t1 t2 t3 br; do
    if ip netns list | grep -q "^$(ns $n)\b"; then
      ip netns pids "$(ns $n)" | xargs -r kill -9 2>/dev/null
      ip netns del "$(ns $n)"
    fi
  done
  if [[ -n ${ZDEV:-} ]]; then
    umount "$WORK/zt" 2>/dev/null
    echo "$ZDEV" >/sys/class/zram-control/hot_remove
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

note() { echo "# $*"; }
now() { date +%s.%N; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
mbps() { python3 -c "import sys; b,s=float(sys.argv[1]),float(sys.argv[2]); print(f'{b/s/1e6:.0f}')" "$1" "$2"; }

# --- network -------------------------------------------------------------------------------
ip netns add "$(ns br)"
ip -n "$(ns br)" link add br0 type bridge
ip -n "$(ns br)" link set br0 up
HOSTS=(s)
for i in $(seq 1 "$TARGETS"); do HOSTS+=("t$i"); done
for h in "${HOSTS[@]}"; do
  ip netns add "$(ns "$h")"
  ip link add "$P$h" type veth peer name "${P}b$h"
  ip link set "$P$h" netns "$(ns "$h")"
  ip link set "${P}b$h" netns "$(ns br)"
  ip -n "$(ns br)" link set "${P}b$h" master br0 up
  ip -n "$(ns "$h")" link set "$P$h" name fab0
  ip -n "$(ns "$h")" addr add "$(ip_of "$h")/24" dev fab0
  ip -n "$(ns "$h")" link set fab0 up
  ip -n "$(ns "$h")" link set lo up
done
if command -v ping >/dev/null; then ip netns exec "$(ns s)" ping -c1 -W2 "$(ip_of t1)" >/dev/null; fi

# --- model ---------------------------------------------------------------------------------
# SIZE_GIB: 1/4 in 1 GiB shards, the rest in 256 MiB shards, plus small files.
mkdir -p "$SRC/tokenizer"
n1g=$((SIZE_GIB / 4 > 0 ? SIZE_GIB / 4 : 1))
n256=$(((SIZE_GIB * 1024 - n1g * 1024) / 256 - 1))
((n256 >= 1)) || n256=1
# Incompressible bytes fast (AES-CTR keystream); openssl dies of SIGPIPE when head is done.
gen() { (set +o pipefail; openssl enc -aes-128-ctr -nosalt -pass "pass:$2" -in /dev/zero 2>/dev/null | head -c "$3" >"$1"); }
for i in $(seq 1 "$n1g"); do gen "$SRC/model-1g-$i.safetensors" "a$i" $((1 << 30)); done
for i in $(seq 1 "$n256"); do gen "$SRC/model-256m-$i.safetensors" "b$i" $((256 << 20)); done
for i in $(seq 1 40); do gen "$SRC/tokenizer/part-$i.json" "c$i" $((64 * 1024 * i)); done
echo '{"model_type":"bench"}' >"$SRC/config.json"
TOTAL=$(du -sb --exclude=.sparkctl-manifest.json "$SRC" | cut -f1)
note "model: $n1g x 1 GiB, $n256 x 256 MiB, 41 small files: $TOTAL bytes; $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"

t0=$(now)
"$SPARKCTL" manifest "$SRC" >/dev/null
MANIFEST_S=$(python3 -c "print($(now)-$t0)")

# --- limits --------------------------------------------------------------------------------
drop_caches
t0=$(now)
for f in "$SRC"/*.safetensors; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none; done
READ_MBS=$(mbps "$(du -cb "$SRC"/*.safetensors | tail -1 | cut -f1)" "$(python3 -c "print($(now)-$t0)")")

LINK_MBS=0
if ((HAVE_IPERF)); then
  ip netns exec "$(ns t1)" iperf3 -s -1 -B "$(ip_of t1)" -p 5201 >/dev/null 2>&1 &
  PIDS+=($!)
  sleep 0.5
  LINK_MBS=$(ip netns exec "$(ns s)" iperf3 -c "$(ip_of t1)" -p 5201 -P 4 -t 5 -J |
    python3 -c "import json,sys; print(int(json.load(sys.stdin)['end']['sum_received']['bits_per_second']/8e6))")
fi

# Target write limit of a directory: O_DIRECT writes of incompressible bytes (the 256 MiB
# shards, read into the page cache first so that only the write is timed), 2 GiB.
big=$(ls -S "$SRC"/*.safetensors | head -1)
small=("$SRC"/model-256m-*.safetensors)
write_limit() {  # $1 = directory on the target filesystem; prints MB/s
  local i n=0 t0
  cat "${small[@]:0:8}" >/dev/null
  t0=$(now)
  for i in "${small[@]:0:8}"; do
    dd if="$i" of="$1/ddw-$n" bs=64M oflag=direct status=none
    n=$((n + 1))
  done
  mbps $((n << 28)) "$(python3 -c "print($(now)-$t0)")"
  rm -f "$1"/ddw-*
}
# Read and write at once on one disk: the direct read of the largest shard (page cache
# dropped) runs while the same number of bytes is written O_DIRECT to $1; prints the copy
# rate a pipelined copy on this disk cannot exceed (bytes / the later finish).
copy_limit() {  # $1 = directory on the same disk as the source
  local t0 rd wr
  drop_caches
  cat "${small[@]:0:4}" >/dev/null
  t0=$(now)
  dd if="$big" of=/dev/null bs=64M iflag=direct status=none &
  rd=$!
  for i in "${small[@]:0:4}"; do dd if="$i" of="$1/ddc-$(basename "$i")" bs=64M oflag=direct status=none; done
  wait $rd
  mbps "$(stat -c %s "$big")" "$(python3 -c "print($(now)-$t0)")"
  rm -f "$1"/ddc-*
}

# Target filesystems. "separate": ext4 on a RAM-backed block device of its own (a zram
# device added for this run, mounted with discard), so that the source and the targets do
# not share one disk, as they never do on a ring; "same": the source's own disk, where a
# copy reads and writes one device at once. Both layouts run the same methods.
ZDEV="" ZDIR="$WORK/zt"
zram_bytes=$(((TARGETS * SIZE_GIB + 2) << 30))
avail=$(($(awk '/MemAvailable/{print $2}' /proc/meminfo) * 1024))
if [[ -w /sys/class/zram-control/hot_add ]] && command -v mkfs.ext4 >/dev/null &&
  ((avail > zram_bytes + (2 << 30))); then
  ZDEV=$(cat /sys/class/zram-control/hot_add)
  echo lz4 >"/sys/block/zram$ZDEV/comp_algorithm" 2>/dev/null || true
  echo "$zram_bytes" >"/sys/block/zram$ZDEV/disksize"
  mkfs.ext4 -q -F "/dev/zram$ZDEV"
  mkdir -p "$ZDIR"
  mount -o discard "/dev/zram$ZDEV" "$ZDIR"
  LAYOUTS=(separate same)
else
  note "no separate target disk: zram-control missing or MemAvailable $((avail >> 30)) GiB < $(((zram_bytes >> 30) + 2)) GiB; running the same-disk layout only"
  LAYOUTS=(same)
fi
WRITE_SEP=0
[[ -n $ZDEV ]] && WRITE_SEP=$(write_limit "$ZDIR")
WRITE_MBS=$(write_limit "$WORK")
COPY_MBS=$(copy_limit "$WORK")

# --- sshd in t1 for rsync --------------------------------------------------------------------
SSH=""
if ((HAVE_RSYNC)); then
  mkdir -p "$WORK/ssh"
  ssh-keygen -q -t ed25519 -N '' -f "$WORK/ssh/host" <<<y >/dev/null
  ssh-keygen -q -t ed25519 -N '' -f "$WORK/ssh/user" <<<y >/dev/null
  cp "$WORK/ssh/user.pub" "$WORK/ssh/authorized_keys"
  cat >"$WORK/ssh/sshd_config" <<EOF
ListenAddress $(ip_of t1)
Port 22
HostKey $WORK/ssh/host
AuthorizedKeysFile $WORK/ssh/authorized_keys
PermitRootLogin prohibit-password
StrictModes no
PasswordAuthentication no
UsePAM no
PidFile $WORK/ssh/sshd.pid
EOF
  ip netns exec "$(ns t1)" /usr/sbin/sshd -D -e -f "$WORK/ssh/sshd_config" 2>"$WORK/ssh/log" &
  PIDS+=($!)
  SSH="ssh -i $WORK/ssh/user -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
  for _ in $(seq 50); do ip netns exec "$(ns s)" $SSH "root@$(ip_of t1)" true 2>/dev/null && break; sleep 0.2; done
fi

# --- runs ----------------------------------------------------------------------------------
identical() { diff -r -x .sparkctl-manifest.json "$SRC" "$1" >/dev/null; }
WRONG=0

# stage N targets with stage-recv / stage-send (the halves stage-weights runs over SSH).
stage_run() {  # $1 = target base dir, $2 = number of targets, $3 = extra option; prints seconds
  local base=$1 n=$2 extra=${3:-} args=() tokens="" i
  for i in $(seq 1 "$n"); do
    rm -rf "$base/t$i"
    local tok
    tok=$(openssl rand -hex 32)
    local line
    line=$(echo "$tok" | ip netns exec "$(ns "t$i")" "$SPARKCTL" stage-recv --dir "$base/t$i" \
      --bind "$(ip_of "t$i")" --node "t$i" --log "$WORK/recv-t$i.log")
    args+=(--target "t$i=$(ip_of "t$i"):$(sed 's/.*ports=\([0-9]*\).*/\1/' <<<"$line")")
    tokens+="t$i $tok"$'\n'
  done
  drop_caches
  local t0
  t0=$(now)
  ip netns exec "$(ns s)" "$SPARKCTL" --json stage-send --dir "$SRC" "${args[@]}" $extra \
    <<<"$tokens" >"$WORK/stage-$n$extra.json" 2>/dev/null
  python3 -c "print($(now)-$t0)"
  for i in $(seq 1 "$n"); do identical "$base/t$i" || { echo "# WRONG: t$i differs" >&2; WRONG=1; }; done
  for i in $(seq 1 "$n"); do rm -rf "$base/t$i"; done
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

# One layout: stage-weights to 1 target (median of 3 runs), rsync -a over ssh and tar | nc
# to the same directory, then N targets in parallel and as a chain. Writes LAYOUT.env.
run_layout() {  # $1 = layout name, $2 = target base dir
  local name=$1 base=$2 s1=() r rs tn sn=0 sc=0 t0
  for r in 1 2 3; do s1+=("$(stage_run "$base" 1)"); done
  rs=0 tn=0
  if ((HAVE_RSYNC)); then
    rm -rf "$base/t1"; mkdir -p "$base/t1"
    drop_caches
    t0=$(now)
    ip netns exec "$(ns s)" rsync -a -e "$SSH" "$SRC/" "root@$(ip_of t1):$base/t1/"
    rs=$(python3 -c "print($(now)-$t0)")
    identical "$base/t1" || { echo "# WRONG: rsync copy differs" >&2; WRONG=1; }
  fi
  if ((HAVE_NC)); then
    rm -rf "$base/t1"; mkdir -p "$base/t1"
    drop_caches
    ip netns exec "$(ns t1)" sh -c "nc -l -s $(ip_of t1) -p 9100 | tar -x -C $base/t1" &
    local ncpid=$!
    sleep 0.5
    t0=$(now)
    ip netns exec "$(ns s)" sh -c "tar -c -C $SRC . | nc -N $(ip_of t1) 9100"
    wait $ncpid
    tn=$(python3 -c "print($(now)-$t0)")
    identical "$base/t1" || { echo "# WRONG: tar|nc copy differs" >&2; WRONG=1; }
  fi
  rm -rf "$base/t1"
  if ((TARGETS > 1)); then
    sn=$(stage_run "$base" "$TARGETS")
    sc=$(stage_run "$base" "$TARGETS" --chain)
  fi
  printf '%s\n' "s1=$(median "${s1[@]}")" "s1_all=${s1[*]}" "rsync=$rs" "tarnc=$tn" "sn=$sn" \
    "sc=$sc" >"$WORK/layout-$name.env"
  cp "$WORK/stage-1.json" "$WORK/stage-1-$name.json"
}
for l in "${LAYOUTS[@]}"; do
  case $l in
    separate) run_layout separate "$ZDIR" ;;
    same) run_layout same "$WORK" ;;
  esac
done

# --- evict vs vmtouch -e --------------------------------------------------------------------
resident() { "$SPARKCTL" --json cache-stat "$SRC" | python3 -c "import json,sys; print(json.load(sys.stdin)['resident_bytes'])"; }
# Median of 3 rounds each; both binaries warmed first (drop_caches evicted them too).
"$SPARKCTL" --version >/dev/null; vmtouch -h >/dev/null 2>&1 || true
warm() { cat "$SRC"/*.safetensors "$SRC"/tokenizer/* >/dev/null; }
ev=() vm=()
for _ in 1 2 3; do
  warm
  EV_BEFORE=$(resident)
  t0=$(now)
  "$SPARKCTL" evict --local "$SRC" >/dev/null
  ev+=("$(python3 -c "print($(now)-$t0)")")
  EV_AFTER=$(resident)
  VM_BEFORE=0 VM_AFTER=0
  ((HAVE_VMTOUCH)) || { vm+=(0); continue; }
  warm
  VM_BEFORE=$(resident)
  t0=$(now)
  vmtouch -q -e "$SRC"
  vm+=("$(python3 -c "print($(now)-$t0)")")
  VM_AFTER=$(resident)
done
EV_S=$(median "${ev[@]}")
VM_S=$(median "${vm[@]}")

# --- report --------------------------------------------------------------------------------
export TOTAL TARGETS READ_MBS LINK_MBS WRITE_MBS WRITE_SEP COPY_MBS MANIFEST_S EV_S EV_BEFORE \
  EV_AFTER VM_S VM_BEFORE VM_AFTER WRONG WORK JSON_OUT
LAYOUT_LIST="${LAYOUTS[*]}" python3 - <<'EOF'
import json, os
e = os.environ
total, nt = int(e["TOTAL"]), int(e["TARGETS"])
rd, lk, wr, ws, cp = (int(e[k]) for k in ("READ_MBS", "LINK_MBS", "WRITE_MBS", "WRITE_SEP", "COPY_MBS"))
rate = lambda s: total / s / 1e6 if s > 0 else 0
out = {"total_bytes": total, "targets": nt, "cpus": os.cpu_count(),
       "limit_source_read_MBps": rd, "limit_link_MBps": lk, "manifest_s": float(e["MANIFEST_S"]),
       "layouts": {}}
print(f"# limits MB/s: source read (O_DIRECT dd) {rd}, link (iperf3 -P 4) {lk}")
for name in e["LAYOUT_LIST"].split():
    v = dict(l.split("=", 1) for l in open(f"{e['WORK']}/layout-{name}.env").read().split("\n") if "=" in l)
    s1, rs, tn, sn, sc = (float(v[k]) for k in ("s1", "rsync", "tarnc", "sn", "sc"))
    if name == "separate":
        title = "target on its own disk (ext4 on a RAM-backed zram block device)"
        limits = {"source_read": rd, "link": lk, "target_write": ws}
        if not lk:
            del limits["link"]  # iperf3 missing: not measured
    else:
        title = "target on the source's disk (read and write share one device)"
        limits = {"source_read": rd, "link": lk, "target_write": wr, "same_disk_read_write_at_once": cp}
        if not lk:
            del limits["link"]
    slow_name = min(limits, key=limits.get)
    slow = limits[slow_name]
    print(f"# layout {name}: {title}")
    print(f"# {'method':<28} {'seconds':>8} {'MB/s':>8}")
    rows = [("stage-weights 1 target", s1, rate(s1)), ("rsync -a over ssh", rs, rate(rs)),
            ("tar | nc", tn, rate(tn))]
    if nt > 1:
        rows += [(f"stage-weights {nt} targets", sn, rate(sn) * nt),
                 (f"stage-weights {nt} chain", sc, rate(sc) * nt)]
    for n, s, r in rows:
        if s > 0:
            print(f"{n:<30} {s:8.2f} {r:8.0f}")
    frac = rate(s1) / slow
    print(f"# {name}: limits {', '.join(f'{k} {x}' for k, x in limits.items())} MB/s; slowest "
          f"{slow_name} {slow}")
    xr = f"{rs/s1:.1f}x rsync" if rs else "rsync not run"
    xt = f"{tn/s1:.1f}x tar|nc" if tn else "tar|nc not run"
    goal = ("met" if frac >= 0.7 and rs / s1 >= 3 else "NOT met") if rs else \
        ("70% met" if frac >= 0.7 else "70% NOT met") + " (3x rsync not checked: rsync not run)"
    print(f"# {name}: stage-weights (median of 3: {v['s1_all']} s) = {frac*100:.0f}% of the "
          f"slowest limit, {xr}, {xt}; goal 70% and 3x rsync: {goal}")
    if nt > 1:
        print(f"# {name}: {nt} targets take {sn/s1:.2f}x the wall time of 1 in parallel (aggregate "
              f"{rate(sn)*nt:.0f} MB/s), {sc/s1:.2f}x as a chain (aggregate {rate(sc)*nt:.0f} MB/s)")
    st = json.load(open(f"{e['WORK']}/stage-1-{name}.json"))
    out["layouts"][name] = {
        "description": title, "limits_MBps": limits, "slowest_limit": slow_name,
        "slowest_limit_MBps": slow, "stage_1_target_s": s1,
        "stage_1_target_runs_s": [float(x) for x in v["s1_all"].split()],
        "stage_1_target_MBps": rate(s1), "fraction_of_slowest": frac,
        "rsync_ssh_s": rs or None, "rsync_ssh_MBps": rate(rs) or None,
        "x_rsync": rs / s1 if rs else None,
        "tar_nc_s": tn or None, "tar_nc_MBps": rate(tn) or None, "x_tar_nc": tn / s1 if tn else None,
        "stage_n_targets_s": sn, "stage_n_targets_aggregate_MBps": rate(sn) * nt if sn else 0,
        "stage_n_chain_s": sc, "stage_n_chain_aggregate_MBps": rate(sc) * nt if sc else 0,
        "goal_met": frac >= 0.7 and (rs / s1 >= 3 if rs else None), "stage_report_1_target": st}
evs, vms = float(e["EV_S"]), float(e["VM_S"])
if vms > 0:
  print(f"# evict: sparkctl {evs:.3f} s ({int(e['EV_BEFORE'])>>20} MiB -> {int(e['EV_AFTER'])>>20} MiB "
      f"resident), vmtouch -e {vms:.3f} s ({int(e['VM_BEFORE'])>>20} MiB -> {int(e['VM_AFTER'])>>20} "
      f"MiB); time ratio sparkctl/vmtouch {evs/max(vms,1e-6):.2f}")
else:
  print(f"# evict: sparkctl {evs:.3f} s ({int(e['EV_BEFORE'])>>20} MiB -> {int(e['EV_AFTER'])>>20} "
        f"MiB resident); vmtouch not run")
out.update({"evict_s": evs, "evict_resident_before": int(e["EV_BEFORE"]),
            "evict_resident_after": int(e["EV_AFTER"]), "vmtouch_s": vms,
            "vmtouch_resident_before": int(e["VM_BEFORE"]), "vmtouch_resident_after": int(e["VM_AFTER"]),
            "identical": e["WRONG"] == "0"})
print(json.dumps(out, indent=1))
if e.get("JSON_OUT"):
    json.dump(out, open(e["JSON_OUT"], "w"), indent=1)
EOF
exit "$WRONG"
