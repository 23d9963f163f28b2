#!/usr/bin/env bash
# The shipped Prometheus files (packaging/prometheus/): the alert rules pass `promtool check
# rules` and their unit tests (`promtool test rules alerts-test.yml`: each alert fires on the
# series that mean trouble, not before), both scrape configs pass `promtool check config`,
# and every sparkd_* series the rules name is one that daemon/metrics.cc exports.
# Skips (77) with the reason when promtool (Debian prometheus) is missing.
# Usage: prometheus_config_test.sh SRC_DIR BUILD_DIR
set -euo pipefail
SRC=${1:?usage: prometheus_config_test.sh SRC_DIR BUILD_DIR}
command -v promtool >/dev/null ||
  { echo "prometheus_config_test: SKIP: promtool is not installed (scripts/install-deps.sh: prometheus)"; exit 77; }
dir=$SRC/packaging/prometheus
fail=0
err() { echo "prometheus_config_test: FAIL: $*"; fail=1; }

out=$(promtool check rules "$dir/sparkctl-alerts.yml" 2>&1) || err "promtool check rules: $out"
out=$(cd "$dir" && promtool test rules alerts-test.yml 2>&1) || err "promtool test rules: $out"
for c in scrape-open.yml scrape-auth.yml; do
  # --syntax-only: the rule and key files they name live on the Prometheus host.
  out=$(promtool check config --syntax-only "$dir/$c" 2>&1) || err "promtool check config $c: $out"
done
grep -q 'authorization:' "$dir/scrape-auth.yml" || err "scrape-auth.yml sends no credentials"
mapfile -t series < <(grep -o 'sparkd_[a-z_]*' "$dir/sparkctl-alerts.yml" | sed 's/_bucket$//' | sort -u)
((${#series[@]} >= 5)) || err "found only ${#series[@]} sparkd_* series in the rules"
for s in "${series[@]}"; do
  grep -q "\"$s\"" "$SRC/daemon/metrics.cc" || err "the rules use $s, which daemon/metrics.cc does not export"
done
echo "prometheus_config_test: rules, their tests, 2 scrape configs and ${#series[@]} series checked"
((fail == 0)) && echo "prometheus_config_test: OK"
exit $fail
