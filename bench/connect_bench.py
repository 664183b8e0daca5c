#!/usr/bin/env python3
"""connect_bench: what checking each new UCX worker address in a child process
(ucx.check_worker_addresses) costs a client's first connect, against the same daemon binary with
the check off, measured in one run.

Starts two proximad from the same binary on Unix sockets in a scratch directory, one with the
check (the default) and one without. Each round times --connects runs of
`proximactl info --transport=ucx` against each (a new process, so a new UCX worker address and a
new ConnectUcx every time: the case the check costs), interleaved, --repeats rounds. Reports the
medians, per connect, and the daemon's own count of children run. Prints JSON lines:
  {"bench":"connect","metric":"ms_per_first_connect","value":...,
   "baseline":"check_off","baseline_value":...,"ratio":...}

Usage: connect_bench.py --proximad=PATH --proximactl=PATH [--connects=N] [--repeats=N]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request


def start(proximad, d, name, check):
    port_file = "%s/%s.port" % (d, name)
    args = [proximad, "--port_file=" + port_file, "--set=server.listen=",
            "--set=server.unix_socket=%s/%s.sock" % (d, name),
            "--set=server.metrics_listen=127.0.0.1:0", "--set=tiers.host.capacity_bytes=64MiB",
            "--set=ucx.check_worker_addresses=" + ("true" if check else "false")]
    log = open("%s/%s.log" % (d, name), "w")
    proc = subprocess.Popen(args, stdout=log, stderr=log)
    for _ in range(200):
        if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
            with open(port_file) as f:
                return proc, json.load(f)["metrics_port"]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit("proximad %s did not start: see %s/%s.log" % (name, d, name))


def round_ms(proximactl, target, connects):
    start = time.perf_counter()
    for _ in range(connects):
        out = subprocess.run([proximactl, "info", "--target=" + target, "--transport=ucx"],
                             check=True, capture_output=True, text=True).stdout
        if "transport: ucx" not in out:
            raise SystemExit("proximactl did not connect over UCX:\n" + out)
    return (time.perf_counter() - start) * 1000 / connects


def metric(port, name):
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--proximad", required=True)
    p.add_argument("--proximactl", required=True)
    p.add_argument("--connects", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    d = tempfile.mkdtemp(prefix="proxima-connect-bench-")
    procs = []
    try:
        on, on_metrics = start(a.proximad, d, "check_on", True)
        procs.append(on)
        off, _ = start(a.proximad, d, "check_off", False)
        procs.append(off)
        on_target, off_target = "unix:%s/check_on.sock" % d, "unix:%s/check_off.sock" % d
        round_ms(a.proximactl, on_target, 1)  # warm-up: page cache, the daemons' first calls
        round_ms(a.proximactl, off_target, 1)
        on_ms, off_ms = [], []
        for _ in range(a.repeats):
            off_ms.append(round_ms(a.proximactl, off_target, a.connects))
            on_ms.append(round_ms(a.proximactl, on_target, a.connects))
        value, base = statistics.median(on_ms), statistics.median(off_ms)
        print(json.dumps({"bench": "connect", "metric": "ms_per_first_connect",
                          "value": round(value, 2), "baseline": "check_off",
                          "baseline_value": round(base, 2), "ratio": round(value / base, 3),
                          "added_ms": round(value - base, 2), "rounds_on": [round(x, 1) for x in on_ms],
                          "rounds_off": [round(x, 1) for x in off_ms],
                          "children_run": metric(on_metrics, "proxima_ucx_address_checks_total"),
                          "connects_per_round": a.connects}))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
