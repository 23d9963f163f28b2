#!/usr/bin/env python3
"""CPU tokens/s of sparkd's native engine through the HTTP API (the OpenAI routes).

Writes the demo model (`sparkctl demo-model`, random weights), starts sparkd for the
one-node ring (env/examples/local.env, free loopback ports), then for each concurrency
(default 1 and 4) sends that many /v1/completions requests at once, each asking for exactly
--max-tokens tokens (ignore_eos), and measures generated tokens / wall seconds. Every
response is checked (HTTP 200, usage.completion_tokens == --max-tokens). Prints a table
(non-data lines start with '#') and one JSON object on the last line.

  python3 bench/api/bench_api.py [--build build] [--max-tokens 64] [--concurrency 1,4] [--rounds 2]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def post(port, path, body, timeout=300):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def health(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())
    except OSError:
        return {}


def run_round(port, concurrency, max_tokens, prompt):
    results = [None] * concurrency
    ttft = [None] * concurrency

    def one(i):
        t0 = time.monotonic()
        try:
            st, j = post(port, "/v1/completions", {"prompt": f"{prompt} {i}", "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
            results[i] = (st, j["usage"]["completion_tokens"])
        except Exception as e:  # noqa: BLE001 - reported as a wrong request
            results[i] = (0, str(e))
        ttft[i] = time.monotonic() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.monotonic() - t0
    wrong = sum(1 for st, n in results if st != 200 or n != max_tokens)
    gen = sum(n for st, n in results if st == 200 and isinstance(n, int))
    return secs, gen, wrong, sum(ttft) / len(ttft)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(SRC, "build"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir", help="serve this checkpoint instead of the demo model")
    a = ap.parse_args()
    conc = [int(c) for c in a.concurrency.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench-api.")
    model = a.model_dir or os.path.join(tmp, "model")
    if not a.model_dir:
        subprocess.run([os.path.join(a.build, "cli/sparkctl"), "demo-model", model], check=True,
                       stdout=subprocess.DEVNULL, timeout=120)
    port = free_port()
    env = dict(os.environ, MODEL_PATH=model, STATE_DIR=os.path.join(tmp, "state"),
               API_PORT=str(port), RDZV_PORT=str(free_port()), SLOTS=str(max(conc)))
    log = open(os.path.join(tmp, "sparkd.log"), "w")
    d = subprocess.Popen([os.path.join(a.build, "daemon/sparkd"), "--config",
                          os.path.join(SRC, "env/examples/local.env"), "--rank", "0"],
                         env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and health(port).get("state") not in ("ready", "fatal"):
            if d.poll() is not None:
                break
            time.sleep(0.2)
        h = health(port)
        if h.get("state") != "ready":
            sys.exit(f"bench_api: sparkd not ready: {h.get('reason')} (log {log.name})")
        post(port, "/v1/completions", {"prompt": "warm up", "max_tokens": 4})
        rows = []
        print(f"# sparkd native engine over HTTP, model {h.get('model')}, {os.cpu_count()} CPUs, "
              f"max_tokens {a.max_tokens}, best of {a.rounds} rounds")
        print(f"# {'concurrency':>11} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'mean_latency_ms':>15} {'wrong':>5}")
        for c in conc:
            best = None
            for _ in range(a.rounds):
                secs, gen, wrong, lat = run_round(port, c, a.max_tokens, "Once upon a time")
                if best is None or gen / secs > best[1] / best[0]:
                    best = (secs, gen, wrong, lat)
            secs, gen, wrong, lat = best
            row = {"concurrency": c, "seconds": round(secs, 4), "generated_tokens": gen,
                   "tokens_per_s": round(gen / secs, 2), "mean_latency_ms": round(lat * 1000, 1),
                   "wrong": wrong}
            rows.append(row)
            print(f"  {c:>11} {secs:>8.3f} {gen:>7} {gen / secs:>9.1f} {lat * 1000:>15.1f} {wrong:>5}")
        ok = all(r["wrong"] == 0 for r in rows)
        print(json.dumps({"bench": "api_native_cpu", "model": h.get("model"), "max_tokens": a.max_tokens,
                          "cpus": os.cpu_count(), "rows": rows, "ok": ok}))
        return 0 if ok else 1
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(timeout=15)
        except subprocess.TimeoutExpired:
            d.kill()


if __name__ == "__main__":
    sys.exit(main())
