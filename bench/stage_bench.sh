#!/usr/bin/env bash
# stage_bench: stage-weights against rsync -a over ssh and tar | nc on the same path, with
# the three limits (source disk read, the link, target disk write) measured in the same run,
# fan-out to 3 targets vs 1, and sparkctl evict vs vmtouch -e.
#
# Network: one namespace per host (sender + up to 3 targets) joined by veth pairs to a
# bridge in its own namespace (the sender has ONE link, as behind a switch). Disk: the
# model lives under /var/tmp (a real filesystem); sender and targets share this machine's
# disk and CPUs, so every figure is a same-machine figure.
#
# Usage: bench/stage_bench.sh BUILD_DIR [--size-gib N] [--targets N] [--json FILE]
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
SPARKCTL=$(readlink -f "$BUILD/cli/sparkctl")
[[ -x $SPARKCTL ]] || { echo "stage_bench: $SPARKCTL not built" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "stage_bench: needs root (namespaces, drop_caches)" >&2; exit 2; }
for t in ip iperf3 rsync nc vmtouch /usr/sbin/sshd ssh-keygen python3 openssl; do
  command -v "$t" >/dev/null || { echo "stage_bench: $t missing" >&2; exit 2; }
done

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
ip netns exec "$(ns s)" ping -c1 -W2 "$(ip_of t1)" >/dev/null

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

ip netns exec "$(ns t1)" iperf3 -s -1 -B "$(ip_of t1)" -p 5201 >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.5
LINK_MBS=$(ip netns exec "$(ns s)" iperf3 -c "$(ip_of t1)" -p 5201 -P 4 -t 5 -J |
  python3 -c "import json,sys; print(int(json.load(sys.stdin)['end']['sum_received']['bits_per_second']/8e6))")

t0=$(now)
dd if=/dev/zero of="$WORK/ddw" bs=64M count=32 oflag=direct status=none
WRITE_MBS=$(mbps $((32 << 26)) "$(python3 -c "print($(now)-$t0)")")
rm -f "$WORK/ddw"
SLOWEST=$(printf '%s\n' "$READ_MBS" "$LINK_MBS" "$WRITE_MBS" | sort -n | head -1)

# --- sshd in t1 for rsync --------------------------------------------------------------------
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

# --- runs ----------------------------------------------------------------------------------
identical() { diff -r -x .sparkctl-manifest.json "$SRC" "$1" >/dev/null; }
WRONG=0

# stage N targets with stage-recv / stage-send (the halves stage-weights runs over SSH).
stage_run() {  # $1 = number of targets, $2 = extra stage-send option; prints seconds
  local n=$1 extra=${2:-} args=() tokens="" i
  for i in $(seq 1 "$n"); do
    rm -rf "$WORK/t$i"
    local tok
    tok=$(openssl rand -hex 32)
    local line
    line=$(echo "$tok" | ip netns exec "$(ns "t$i")" "$SPARKCTL" stage-recv --dir "$WORK/t$i" \
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
  for i in $(seq 1 "$n"); do identical "$WORK/t$i" || { echo "# WRONG: t$i differs" >&2; WRONG=1; }; done
}

S1=$(stage_run 1)
rm -rf "$WORK/t1"; mkdir -p "$WORK/t1"
drop_caches
t0=$(now)
ip netns exec "$(ns s)" rsync -a -e "$SSH" "$SRC/" "root@$(ip_of t1):$WORK/t1/"
RSYNC_S=$(python3 -c "print($(now)-$t0)")
identical "$WORK/t1" || { echo "# WRONG: rsync copy differs" >&2; WRONG=1; }

rm -rf "$WORK/t1"; mkdir -p "$WORK/t1"
drop_caches
ip netns exec "$(ns t1)" sh -c "nc -l -s $(ip_of t1) -p 9100 | tar -x -C $WORK/t1" &
NCPID=$!
sleep 0.5
t0=$(now)
ip netns exec "$(ns s)" sh -c "tar -c -C $SRC . | nc -N $(ip_of t1) 9100"
wait $NCPID
TARNC_S=$(python3 -c "print($(now)-$t0)")
identical "$WORK/t1" || { echo "# WRONG: tar|nc copy differs" >&2; WRONG=1; }
rm -rf "$WORK/t1"

SN="" SC=""
if ((TARGETS > 1)); then
  SN=$(stage_run "$TARGETS")
  SC=$(stage_run "$TARGETS" --chain)
fi

# --- evict vs vmtouch -e --------------------------------------------------------------------
resident() { "$SPARKCTL" --json cache-stat "$SRC" | python3 -c "import json,sys; print(json.load(sys.stdin)['resident_bytes'])"; }
# Median of 3 rounds each; both binaries warmed first (drop_caches evicted them too).
"$SPARKCTL" --version >/dev/null; vmtouch -h >/dev/null 2>&1 || true
warm() { cat "$SRC"/*.safetensors "$SRC"/tokenizer/* >/dev/null; }
median() { printf '%s\n' "$@" | sort -g | sed -n 2p; }
ev=() vm=()
for _ in 1 2 3; do
  warm
  EV_BEFORE=$(resident)
  t0=$(now)
  "$SPARKCTL" evict --local "$SRC" >/dev/null
  ev+=("$(python3 -c "print($(now)-$t0)")")
  EV_AFTER=$(resident)
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
python3 - "$TOTAL" "$S1" "$RSYNC_S" "$TARNC_S" "${SN:-0}" "$TARGETS" "$READ_MBS" "$LINK_MBS" \
  "$WRITE_MBS" "$SLOWEST" "$MANIFEST_S" "$EV_S" "$EV_BEFORE" "$EV_AFTER" "$VM_S" "$VM_BEFORE" \
  "$VM_AFTER" "$WRONG" "$WORK/stage-1.json" "$JSON_OUT" "${SC:-0}" <<'EOF'
import json, sys
(total, s1, rs, tn, sn, nt, rd, lk, wr, slow, mf, evs, evb, eva, vms, vmb, vma, wrong,
 stage_json, out, sc) = sys.argv[1:]
total = int(total); s1, rs, tn, sn, mf, sc = map(float, (s1, rs, tn, sn, mf, sc))
rd, lk, wr, slow = map(int, (rd, lk, wr, slow))
rate = lambda s: total / s / 1e6 if s > 0 else 0
st = json.load(open(stage_json))
rows = [("stage-weights 1 target", s1, rate(s1)), ("rsync -a over ssh", rs, rate(rs)),
        ("tar | nc", tn, rate(tn))]
if int(nt) > 1:
    rows.append((f"stage-weights {nt} targets", sn, rate(sn) * int(nt)))
    rows.append((f"stage-weights {nt} chain", sc, rate(sc) * int(nt)))
print(f"# {'method':<28} {'seconds':>8} {'MB/s':>8}")
for name, s, r in rows:
    print(f"{name:<30} {s:8.2f} {r:8.0f}")
print(f"# limits MB/s: source read (O_DIRECT dd) {rd}, link (iperf3 -P 4) {lk}, "
      f"target write (O_DIRECT dd) {wr}; slowest {slow}")
print(f"# stage-weights: {rate(s1)/slow*100:.0f}% of the slowest limit, {rs/s1:.1f}x rsync, "
      f"{tn/s1:.1f}x tar|nc; manifest creation (hashing) {mf:.2f} s = {rate(mf):.0f} MB/s")
if int(nt) > 1:
    print(f"# {nt} targets take {sn/s1:.2f}x the wall time of 1 in parallel (aggregate "
          f"{rate(sn)*int(nt):.0f} MB/s), {sc/s1:.2f}x as a chain (aggregate {rate(sc)*int(nt):.0f} MB/s)")
print(f"# evict: sparkctl {float(evs):.3f} s ({int(evb)>>20} MiB -> {int(eva)>>20} MiB resident), "
      f"vmtouch -e {float(vms):.3f} s ({int(vmb)>>20} MiB -> {int(vma)>>20} MiB); "
      f"time ratio sparkctl/vmtouch {float(evs)/max(float(vms),1e-6):.2f}")
j = {"total_bytes": total, "stage_1_target_s": s1, "stage_1_target_MBps": rate(s1),
     "rsync_ssh_s": rs, "rsync_ssh_MBps": rate(rs), "tar_nc_s": tn, "tar_nc_MBps": rate(tn),
     "targets": int(nt), "stage_n_targets_s": sn, "stage_n_targets_aggregate_MBps": rate(sn) * int(nt) if sn else 0,
     "stage_n_chain_s": sc, "stage_n_chain_aggregate_MBps": rate(sc) * int(nt) if sc else 0,
     "limit_source_read_MBps": rd, "limit_link_MBps": lk, "limit_target_write_MBps": wr,
     "slowest_limit_MBps": slow, "fraction_of_slowest": rate(s1) / slow, "x_rsync": rs / s1,
     "x_tar_nc": tn / s1, "manifest_s": mf,
     "evict_s": float(evs), "evict_resident_before": int(evb), "evict_resident_after": int(eva),
     "vmtouch_s": float(vms), "vmtouch_resident_before": int(vmb), "vmtouch_resident_after": int(vma),
     "stage_report_1_target": st, "identical": wrong == "0"}
print(json.dumps(j, indent=1))
if out:
    json.dump(j, open(out, "w"), indent=1)
EOF
exit "$WRONG"
