# Sourced by scripts/distro-test.sh and scripts/cross-arm64.sh: copies a checkout into a
# Debian root whose build trees are kept between runs.
#
# sync_checkout SRC DEST STAGE_PARENT: makes DEST hold the files git sees in SRC (tracked
# and new, not ignored; everything but build* without git), by content: a file whose bytes
# changed gets the current time as its mtime, an unchanged one keeps its own, a file gone
# from SRC goes. DEST/build and DEST/build-* (build trees made in the root) are kept.
# Why by content: ninja rebuilds what is newer than its output. A copy that restores the
# checkout's mtimes (tar -x) can give an edited file a time older than an object built from
# an earlier copy, and that stale object then counts as up to date (a caller compiled
# against an old declaration fails at the link, far from its cause). Without rsync (or
# with SPARK_SYNC_NO_RSYNC=1) every file gets the current time: always correct, and every
# object is rebuilt (a ccache makes that cheap). STAGE_PARENT holds the staging copy (on
# DEST's filesystem, so that it is cheap).
sync_checkout() {
  local src=$1 dest=$2 parent=$3 stage
  stage=$(mktemp -d "$parent/sync.XXXXXX")
  if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    # Tracked files deleted in the work tree are listed too: not there, not copied.
    (cd "$src" && git ls-files -z -co --exclude-standard |
      while IFS= read -r -d '' f; do if [[ -e $f || -L $f ]]; then printf '%s\0' "$f"; fi; done |
      tar --null -T - -cf -) | tar -xf - -C "$stage"
  else
    tar -C "$src" --exclude='./build*' -cf - . | tar -xf - -C "$stage"
  fi
  mkdir -p "$dest"
  if command -v rsync >/dev/null && [[ -z ${SPARK_SYNC_NO_RSYNC:-} ]]; then
    # -c: compare contents; no -t: what is copied is stamped now.
    rsync -rlc --delete --exclude='/build' --exclude='/build-*' "$stage/" "$dest/"
  else
    echo "sync-checkout: no rsync: every file of $dest gets a new mtime, so everything is" \
      "rebuilt (apt-get install rsync for an incremental rebuild)"
    find "$dest" -mindepth 1 -maxdepth 1 ! -name build ! -name 'build-*' -exec rm -rf --one-file-system {} +
    tar -C "$stage" -cf - . | tar -m -xf - -C "$dest"
  fi
  rm -rf --one-file-system "$stage"
}
