#!/usr/bin/env bash
# Install and package: `cmake --install` into a DESTDIR puts the binaries, man pages and
# example cluster files where they belong and the installed sparkctl works; `cpack -G DEB`
# makes a .deb whose contents list the same files.
# Usage: install_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: install_test.sh SRC_DIR BUILD_DIR}
BUILD=${2:?usage: install_test.sh SRC_DIR BUILD_DIR}
tmp=$(mktemp -d /tmp/sparkctl-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0
err() { echo "install_test: FAIL: $*"; fail=1; }

# 1. cmake --install into a DESTDIR, prefix /usr as the package uses.
DESTDIR=$tmp/root cmake --install "$BUILD" --prefix /usr >"$tmp/install.log"
root=$tmp/root/usr
expect=(
  bin/sparkctl sbin/sparkd
  share/man/man1/sparkctl.1 share/man/man1/sparkctl-config.1 share/man/man5/sparkctl.env.5
  share/sparkctl/examples/local.env share/sparkctl/examples/two-sparks.env
  share/sparkctl/examples/three-sparks.env share/sparkctl/examples/four-sparks.env
)
for f in "${expect[@]}"; do [[ -f $root/$f ]] || err "cmake --install did not install $f"; done
for p in "$SRC"/man/*.[1-8]; do
  n=$(basename "$p"); [[ -f $root/share/man/man${n##*.}/$n ]] || err "man page $n not installed"
done
[[ -x $root/bin/sparkctl ]] || err "bin/sparkctl is not executable"
# The installed binary runs and validates the installed examples.
if [[ -x $root/bin/sparkctl ]]; then
  env -i PATH="$PATH" "$root/bin/sparkctl" --version >/dev/null || err "installed sparkctl --version failed"
  for e in "$root"/share/sparkctl/examples/*.env; do
    env -i PATH="$PATH" "$root/bin/sparkctl" --config "$e" config check >/dev/null 2>"$tmp/err" ||
      err "installed sparkctl config check $(basename "$e"): $(cat "$tmp/err")"
  done
fi
echo "install_test: cmake --install checked (${#expect[@]} files)"

# 2. cpack -G DEB, in its own directory so the build tree stays clean.
(cd "$tmp" && cpack -G DEB --config "$BUILD/CPackConfig.cmake" -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1) ||
  { err "cpack failed:"; tail -n 20 "$tmp/cpack.log"; exit 1; }
deb=$(ls "$tmp"/pkg/*.deb 2>/dev/null | head -n 1)
[[ -n $deb ]] || { err "cpack made no .deb"; exit 1; }
dpkg-deb -c "$deb" | awk '{print $NF}' >"$tmp/contents"
for f in "${expect[@]}"; do grep -qx "./usr/$f" "$tmp/contents" || err "$(basename "$deb") lacks /usr/$f"; done
[[ $(dpkg-deb -f "$deb" Package) == sparkctl ]] || err "package name is not sparkctl"
depends=$(dpkg-deb -f "$deb" Depends)
grep -q "libc6" <<<"$depends" || err "Depends was not filled in by dpkg-shlibdeps: '$depends'"
echo "install_test: $(basename "$deb"): $(wc -l <"$tmp/contents") entries, Depends: $depends"

((fail == 0)) && echo "install_test: OK"
exit $fail
