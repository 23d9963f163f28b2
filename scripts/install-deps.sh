#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent: it skips what is
# installed and runs `apt-get update` only when something is missing.
#
# Others append to the list with one line, e.g.
#   PACKAGES+=(libfoo-dev)   # what needs it
# CUDA is not an apt package here: CMake uses /usr/local/cuda when nvcc is there.
#
# Usage: scripts/install-deps.sh [--check]   (--check: only list what is missing, exit 1 if any)
set -euo pipefail

PACKAGES=(
  # Build tools.
  cmake ninja-build g++ ccache pkg-config make dpkg-dev file
  # clang for the libFuzzer build (libclang-rt has the fuzzer and sanitizer runtimes).
  clang libclang-rt-14-dev clang-format
  # Libraries.
  libboost-system-dev libboost-program-options-dev libboost-dev   # Asio, Beast (headers)
  libfmt-dev libssh-dev libibverbs-dev nlohmann-json3-dev doctest-dev
  libopenblas-dev libgloo-dev libxxhash-dev libpcre2-dev
  # RDMA user space (probes, ibv_devinfo in tests and docs).
  rdma-core ibverbs-utils
  # What the tests start or call: a real sshd, namespaces, ping, curl, etc.
  openssh-server openssh-client iproute2 iputils-ping curl
  iperf3 rsync netcat-openbsd procps python3 vmtouch
  # Monitoring (the metrics tests validate rules with promtool), systemd units (analyze).
  prometheus systemd
  # The .deb checks (tests/scripts/deb_lintian_test.sh).
  lintian
  # Man page lint.
  man-db groff-base
)

# Appended by other parts of the project (one line each, below this comment).
PACKAGES+=(libssl-dev openssl)   # stage: manifest --sha256 (libcrypto); stage_bench generates data with openssl
PACKAGES+=(libicu-dev)   # tokenizer: NFC/NFKC normalizers, Unicode properties (daemon/tokenizer)

check_only=0
[[ "${1:-}" == "--check" ]] && check_only=1

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install-deps: missing: ${missing[*]}"
((check_only)) && exit 1

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: installed ${#missing[@]} package(s)"
