#!/usr/bin/env python3
"""Summarise a kernel timeline written by libspark_kernel_trace.so (kernel_trace.cc).

For every CUDA graph replayed at least --min-replays times (a decode step's graph), prints:
  - the step: its period (one replay's first kernel to the next's), the graph's span, the
    work between replays outside the graph (sampler, copies) and the time the GPU was idle;
  - each kernel of the graph, in launch order, folded by name over the replays: how long it
    ran and what it added to the critical path (its end minus the end of the kernel before
    it), which under programmatic launch is smaller than its duration when it overlaps.
With --json FILE the same numbers go to FILE.

Usage: trace_summary.py TRACE.csv [--min-replays 20] [--json OUT] [--top 40]
"""
import argparse
import bisect
import collections
import csv
import json
import re
import statistics
import sys


def short(name):
    n = re.sub(r"^void ", "", name)
    n = re.sub(r"\(anonymous namespace\)::", "", n)
    n = re.sub(r"spark::kernels::", "", n)
    depth, out = 0, []
    for ch in n:  # drop the parameter list (the outermost parentheses at depth 0)
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        out.append(ch)
    n = "".join(out).strip()
    return n if len(n) <= 70 else n[:67] + "..."


def load(path):
    recs = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["kind"] not in ("kernel", "memcpy", "memset"):
                continue
            recs.append({
                "kind": r["kind"], "start": int(r["start_ns"]), "end": int(r["end_ns"]),
                "graph": int(r["graph_id"]), "node": int(r["graph_node"]),
                "corr": int(r["correlation"]),
                "name": short(r["name"]) if r["kind"] == "kernel" else r["kind"] + " " + r["name"],
            })
    recs.sort(key=lambda r: r["start"])
    return recs


def busy(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarise(recs, min_replays):
    replays = collections.defaultdict(list)  # (graph, correlation) -> records
    for r in recs:
        if r["graph"]:
            replays[(r["graph"], r["corr"])].append(r)
    by_graph = collections.defaultdict(list)
    for (g, _), rs in replays.items():
        by_graph[g].append(sorted(rs, key=lambda r: r["start"]))
    starts = [r["start"] for r in recs]
    out = []
    for g, reps in by_graph.items():
        if len(reps) < min_replays:
            continue
        reps.sort(key=lambda rs: rs[0]["start"])
        n_nodes = collections.Counter(len(rs) for rs in reps).most_common(1)[0][0]
        reps = [rs for rs in reps if len(rs) == n_nodes]
        # Steps: consecutive replays of this graph with nothing of another graph between.
        periods, spans, outside, idle, outside_by = [], [], [], [], collections.defaultdict(list)
        for a, b in zip(reps, reps[1:]):
            t0, t1 = a[0]["start"], b[0]["start"]
            lo, hi = bisect.bisect_left(starts, t0), bisect.bisect_left(starts, t1)
            between = [r for r in recs[lo:hi] if r["graph"] != g]
            if any(r["graph"] for r in between):
                continue
            periods.append(t1 - t0)
            spans.append(max(r["end"] for r in a) - t0)
            ext = between
            outside.append(sum(r["end"] - r["start"] for r in ext))
            per = collections.defaultdict(int)
            for r in ext:
                per[r["name"]] += r["end"] - r["start"]
            for k, v in per.items():
                outside_by[k].append(v)
            idle.append((t1 - t0) - busy([(r["start"], min(r["end"], t1)) for r in a + ext]))
        # Kernels in launch order: durations and what each adds to the critical path.
        order = collections.OrderedDict()
        for rs in reps:
            prev_end = None
            for i, r in enumerate(rs):
                d = order.setdefault(i, {"name": r["name"], "dur": [], "add": []})
                d["dur"].append(r["end"] - r["start"])
                d["add"].append(r["end"] - (prev_end if prev_end is not None else r["start"]))
                prev_end = r["end"] if prev_end is None else max(prev_end, r["end"])
        folded = collections.OrderedDict()
        for d in order.values():
            f = folded.setdefault(d["name"], {"count": 0, "dur_us": 0.0, "add_us": 0.0})
            f["count"] += 1
            f["dur_us"] += statistics.median(d["dur"]) / 1e3
            f["add_us"] += statistics.median(d["add"]) / 1e3
        med = lambda v: statistics.median(v) / 1e3 if v else 0.0
        out.append({
            "graph": g, "replays": len(reps), "kernels": n_nodes,
            "steps_measured": len(periods),
            "period_us": med(periods), "graph_span_us": med(spans),
            "outside_graph_us": med(outside), "idle_us": med(idle),
            "outside_by_name_us": {k: med(v) for k, v in outside_by.items()},
            "by_kernel": [{"name": k, **v} for k, v in folded.items()],
        })
    out.sort(key=lambda o: -o["replays"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-replays", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    recs = load(a.trace)
    if not recs:
        sys.exit(f"{a.trace}: no kernel, copy or memset records")
    res = summarise(recs, a.min_replays)
    for o in res:
        print(f"# graph {o['graph']}: {o['replays']} replays of {o['kernels']} kernels, "
              f"{o['steps_measured']} steps measured")
        print(f"  step period {o['period_us']:9.1f} us  graph span {o['graph_span_us']:9.1f} us  "
              f"outside the graph {o['outside_graph_us']:7.1f} us  GPU idle {o['idle_us']:7.1f} us")
        for k, v in sorted(o["outside_by_name_us"].items(), key=lambda kv: -kv[1]):
            print(f"    outside: {v:8.1f} us  {k}")
        print(f"  {'kernel (launch order, folded by name)':70s} {'n':>4s} {'ran us':>9s} {'adds us':>9s}")
        rows = sorted(o["by_kernel"], key=lambda r: -r["add_us"])[: a.top]
        for r in rows:
            print(f"  {r['name']:70s} {r['count']:4d} {r['dur_us']:9.1f} {r['add_us']:9.1f}")
        print(f"  {'sum':70s} {'':4s} {sum(r['dur_us'] for r in o['by_kernel']):9.1f} "
              f"{sum(r['add_us'] for r in o['by_kernel']):9.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
