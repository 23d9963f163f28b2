#!/usr/bin/env bash
# Installs the packages sparkctl needs on Debian 12/13 and Ubuntu 22.04/24.04 (amd64, arm64),
# choosing the versioned names by what apt offers on this system. Idempotent: it skips what
# is installed and runs `apt-get update` only when something is missing.
#
# Two sets:
#   --demo     what scripts/demo.sh needs: the build tools, the libraries, and the few tools
#              the demo itself calls (curl, python3). A node that only runs the ring needs
#              no more.
#   (default)  the demo set plus the test tooling scripts/test.sh uses: doctest, clang and
#              its fuzzing runtime, a real sshd, namespaces, Prometheus' promtool, the man
#              lint, packaging tools.
#   --arch A   cross build for Debian architecture A (e.g. arm64, on an amd64 machine):
#              adds A to dpkg (multiarch), installs the libraries as :A, the cross compiler
#              and qemu-user-static; not the test tools (their tiers run natively only).
#   --check    only report what is missing (exit 1 if anything is).
#   --list     print the name each entry resolves to here (installed, else what apt
#              offers; "# none: ENTRY" where apt has none) and change nothing.
#
# Add a package with one line in its list below:  LIBRARIES+=(libfoo-dev)   # what needs it
# An entry "a|b" is the first of a, b that apt offers; @CLANG@ is the major version of the
# clang apt installs; an alternative cmd:NAME is met by a command NAME on PATH however it got
# there, and is never installed. `optional ENTRY "cost"` marks an entry the scripts can do without: when
# apt offers none of it, that is printed with its cost and the rest goes on.
# CUDA and NCCL are not Debian packages: CMake uses /usr/local/cuda when nvcc is there.
set -euo pipefail

# Build tools (native).
BUILD_TOOLS=(cmake ninja-build g++ ccache pkg-config make)
# Libraries the build links (the -dev packages; :ARCH with --arch).
LIBRARIES=(
  libboost-system-dev libboost-program-options-dev libboost-dev   # Asio, Beast (headers)
  libfmt-dev libssh-dev libibverbs-dev nlohmann-json3-dev
  libopenblas-dev libgloo-dev libxxhash-dev libpcre2-dev
  libssl-dev    # stage: manifest --sha256 (libcrypto)
  libicu-dev    # tokenizer: NFC/NFKC normalizers, Unicode properties (daemon/tokenizer)
)
# What scripts/demo.sh calls besides the binaries.
DEMO_TOOLS=(curl python3 procps)
# Libraries only the tests build against.
TEST_LIBRARIES=(doctest-dev)
# What the tests start or call.
TEST_TOOLS=(
  # clang for the libFuzzer build; the fuzzer and sanitizer runtimes are libclang-rt-N-dev
  # (Debian 12+, Ubuntu 24.04), inside libclang-common-N-dev on older releases.
  clang "libclang-rt-@CLANG@-dev|libclang-common-@CLANG@-dev" clang-format
  dpkg-dev file                                      # cpack -G DEB (install test)
  rdma-core ibverbs-utils                            # RDMA user space: probes, ibv_devinfo
  # A real sshd, namespaces, ping, curl, etc.
  openssh-server openssh-client iproute2 iputils-ping
  iperf3 rsync netcat-openbsd vmtouch
  openssl       # stage_bench generates its data with openssl
  prometheus    # promtool validates /metrics and the alert rules
  systemd       # systemd-analyze verify of the units
  man-db groff-base                                  # man page lint
  lintian       # the .deb checks (tests/scripts/deb_lintian_test.sh)
  # The official OpenAI client and the chat-template reference (tests/scripts/
  # openai_client_wire_test.sh, chat_template_reference_test.sh, tokenizer_fixtures_test.sh;
  # scripts/test.sh runs `npm ci` for their packages); git for the checkout tests.
  # An npm that came with Node.js from elsewhere (NodeSource's nodejs bundles it, and Debian's
  # npm package conflicts with that nodejs) counts: cmd:NAME is a command on PATH.
  "nodejs|cmd:node" "npm|cmd:npm" git
)
# Older form, still honoured: counted with the build tools (native architecture).
PACKAGES=()

declare -A COST=()
# optional ENTRY COST: apt may lack ENTRY on some releases; COST says what is lost then.
optional() { COST[$1]=$2; }
optional "libclang-rt-@CLANG@-dev|libclang-common-@CLANG@-dev" \
  "no libFuzzer runtime: scripts/test.sh skips the fuzz tier (with the reason)"
optional prometheus "no promtool: the metrics tests skip the promtool lint (with the reason)"
optional vmtouch "no vmtouch: no test needs it (it checks sparkctl cache-stat by hand)"
optional iperf3 "no iperf3: no test needs it (it measures a link by hand, beside preflight)"

# Appended by other parts of the project (one line each, below this comment).

usage() { sed -n '2,24p' "$0"; }
mode=test check_only=0 list_only=0 arch=""
while (($#)); do
  case "$1" in
    --demo) mode=demo ;;
    --check) check_only=1 ;;
    --list) list_only=1 check_only=1 ;;
    --arch) arch=${2:?--arch needs a Debian architecture, e.g. arm64}; shift ;;
    --arch=*) arch=${1#--arch=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-deps: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

native=$(dpkg --print-architecture)
[[ $arch == "$native" ]] && arch=""
sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo" >&2; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
updated=0
apt_update() {
  ((updated)) && return 0
  updated=1
  "${sudo[@]}" apt-get update -q
}

# Foreign architecture for a cross build: dpkg must know it before apt can offer :A packages.
if [[ -n $arch ]]; then
  declare -A TRIPLET=([arm64]=aarch64-linux-gnu [amd64]=x86_64-linux-gnu [armhf]=arm-linux-gnueabihf
                      [riscv64]=riscv64-linux-gnu [ppc64el]=powerpc64le-linux-gnu [s390x]=s390x-linux-gnu)
  triplet=${TRIPLET[$arch]:-}
  [[ -n $triplet ]] || { echo "install-deps: no cross compiler known for --arch $arch" >&2; exit 2; }
  if ! dpkg --print-foreign-architectures | grep -qx "$arch"; then
    if ((check_only)); then
      echo "install-deps: dpkg does not know architecture $arch (dpkg --add-architecture $arch)"
      exit 1
    fi
    echo "install-deps: dpkg --add-architecture $arch"
    "${sudo[@]}" dpkg --add-architecture "$arch"
    apt_update
  fi
  BUILD_TOOLS+=("g++-$triplet" qemu-user-static)
fi

installed() { [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true) == "install ok installed" ]]; }
# offered NAME: apt has a candidate version for NAME (a real package, not a virtual one).
offered() {
  local c
  c=$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p' | head -n 1)
  [[ -n $c && $c != "(none)" ]]
}
# qualify NAME: NAME:ARCH for a cross build, unless the package is Architecture: all.
qualify() {
  [[ -z $arch ]] && { echo "$1"; return; }
  local a
  a=$(apt-cache show --no-all-versions "$1" 2>/dev/null | sed -n 's/^Architecture: //p' | head -n 1)
  [[ $a == all ]] && echo "$1" || echo "$1:$arch"
}
# clang_major: the major version of the clang package (installed, else the one apt offers).
clang_major() {
  local d
  d=$(dpkg-query -W -f='${Depends}' clang 2>/dev/null || true)
  [[ -n $d ]] || d=$(apt-cache depends clang 2>/dev/null | sed -n 's/^ *Depends: //p' | tr '\n' ' ')
  sed -n 's/.*clang-\([0-9][0-9]*\).*/\1/p' <<<"$d" | head -n 1
}

# The entries of this run, each with whether it is a library (qualified for --arch).
entries=() libs=()
add() { local kind=$1; shift; for e in "$@"; do entries+=("$e"); libs+=("$kind"); done; }
add tool "${BUILD_TOOLS[@]}" "${PACKAGES[@]}"
add lib "${LIBRARIES[@]}"
add tool "${DEMO_TOOLS[@]}"
if [[ $mode == test ]]; then
  add lib "${TEST_LIBRARIES[@]}"
  [[ -z $arch ]] && add tool "${TEST_TOOLS[@]}"
fi

# satisfied ENTRY KIND: some alternative of ENTRY is installed (versions resolved as known).
satisfied() {
  local alt name
  IFS='|' read -r -a alts <<<"$1"
  for alt in "${alts[@]}"; do
    if [[ $alt == cmd:* ]]; then
      command -v "${alt#cmd:}" >/dev/null && return 0
      continue
    fi
    if [[ $alt == *@CLANG@* ]]; then
      [[ -n $clang ]] || continue
      alt=${alt//@CLANG@/$clang}
    fi
    name=$alt
    [[ $2 == lib && -n $arch ]] && name="$alt:$arch"
    installed "$name" && return 0
    # Architecture: all packages are installed under their plain name.
    [[ $name != "$alt" ]] && installed "$alt" && [[ $(dpkg-query -W -f='${Architecture}' "$alt") == all ]] && return 0
  done
  return 1
}

clang=$(clang_major)
# resolve ENTRY KIND: the installed alternative, else the first that apt offers, else "".
resolve() {
  local alt name
  IFS='|' read -r -a alts <<<"$1"
  for pass in installed offered; do
    for alt in "${alts[@]}"; do
      if [[ $alt == cmd:* ]]; then
        [[ $pass == installed ]] && command -v "${alt#cmd:}" >/dev/null &&
          { echo "# command on PATH, not from apt: ${alt#cmd:}"; return; }
        continue
      fi
      if [[ $alt == *@CLANG@* ]]; then
        [[ -n $clang ]] || continue
        alt=${alt//@CLANG@/$clang}
      fi
      name=$alt
      [[ $2 == lib && -n $arch ]] && name=$(qualify "$alt")
      if [[ $pass == installed ]]; then installed "$name" && { echo "$name"; return; }
      else offered "$name" && { echo "$name"; return; }; fi
    done
  done
  return 0
}
if ((list_only)); then
  for i in "${!entries[@]}"; do
    n=$(resolve "${entries[$i]}" "${libs[$i]}")
    [[ -n $n ]] && echo "$n" || echo "# none: ${entries[$i]//@CLANG@/${clang:-N}}${COST[${entries[$i]}]:+ (${COST[${entries[$i]}]})}"
  done
  exit 0
fi
pending=() pending_kind=()
for i in "${!entries[@]}"; do
  satisfied "${entries[$i]}" "${libs[$i]}" || { pending+=("${entries[$i]}"); pending_kind+=("${libs[$i]}"); }
done

if ((${#pending[@]} == 0)); then
  echo "install-deps: all ${#entries[@]} packages of the $mode set present${arch:+ (libraries for $arch)}"
  exit 0
fi
echo "install-deps: missing: ${pending[*]}"
((check_only)) && exit 1

# Resolve each missing entry to a name apt offers here.
apt_update
[[ -n $clang ]] || clang=$(clang_major)
to_install=() lost=() absent=()
for i in "${!pending[@]}"; do
  e=${pending[$i]} pick=""
  IFS='|' read -r -a alts <<<"$e"
  for alt in "${alts[@]}"; do
    [[ $alt == cmd:* ]] && continue
    if [[ $alt == *@CLANG@* ]]; then
      [[ -n $clang ]] || continue
      alt=${alt//@CLANG@/$clang}
    fi
    [[ ${pending_kind[$i]} == lib ]] && alt=$(qualify "$alt")
    if offered "$alt"; then pick=$alt; break; fi
  done
  shown=${e//@CLANG@/${clang:-N}}
  if [[ -n $pick ]]; then
    [[ ${pick%:*} != "$e" ]] && echo "install-deps: $shown -> ${pick%:*} (what apt offers here)"
    to_install+=("$pick")
  elif [[ -n ${COST[$e]:-} ]]; then
    lost+=("$shown: ${COST[$e]}")
  else
    absent+=("$shown")
  fi
done

if ((${#to_install[@]})); then
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${to_install[@]}"
  echo "install-deps: installed ${#to_install[@]} package(s)"
fi

# The toolchain's versions: CMakeLists.txt needs CMake 3.25, the code GCC 12 (C++20).
ver_lt() { [[ $1 != "$2" && $(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1) == "$1" ]]; }
fail=0
if command -v cmake >/dev/null; then
  v=$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')
  if ver_lt "$v" 3.25; then
    echo "install-deps: cmake $v is older than 3.25, which CMakeLists.txt needs; nothing can be" \
      "built. Install a newer CMake (Kitware's APT repository, or the cmake snap) and rerun." >&2
    fail=1
  fi
fi
if command -v g++ >/dev/null; then
  v=$(g++ -dumpfullversion 2>/dev/null || g++ -dumpversion)
  if ver_lt "$v" 12 && ! command -v g++-12 >/dev/null && ! command -v g++-13 >/dev/null; then
    if offered g++-12; then
      echo "install-deps: g++ $v is older than 12 (C++20): installing g++-12 beside it"
      "${sudo[@]}" apt-get install -y -q --no-install-recommends g++-12
    else
      echo "install-deps: g++ $v is older than 12 and apt offers no g++-12; the build needs GCC 12 (C++20)" >&2
      fail=1
    fi
  fi
fi

for l in "${lost[@]}"; do echo "install-deps: not offered by apt here: $l" >&2; done
if ((${#absent[@]})); then
  hint=""
  grep -qi ubuntu /etc/os-release 2>/dev/null && hint=" (Ubuntu: is the universe component enabled? add-apt-repository universe)"
  echo "install-deps: apt offers none of: ${absent[*]}$hint; the $mode set is incomplete" >&2
  fail=1
fi
exit $fail
