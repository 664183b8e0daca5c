#!/usr/bin/env python3
"""cluster_bench: a get served by the local daemon against the same get served one hop away
(the worker's daemon fetches the blocks from the node that holds them, daemon/cluster), in one
run on loopback TCP.

Starts two proximad, A and B, from the same binary as one cluster (static peers, a peer token);
puts --blocks test blocks of 2 MiB on A with `proximactl put`; then, interleaved --repeats
times, `proximactl get` of all of them through A (local: the baseline) and through B (every
block a remote hit: home lookup + FetchBlocks from A), both with the inline transport so that
the worker side is the same. Every get checks every byte. Prints one JSON object per metric:
  {"bench":"cluster","metric":"megabytes_per_second","value":...,"baseline":"local_get",
   "baseline_value":...,"ratio":...}

Usage: cluster_bench.py --proximad=PATH --proximactl=PATH [--blocks=N] [--repeats=N]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from security_bench import start  # noqa: E402  (same daemon start-up, same baseline settings)

# 32 layers x 16 tokens x 8 KV heads x 128 dims x bf16 x (K, V) = 2 MiB per block.
PROFILE = ["--layers=32", "--kv_heads=8", "--head_dim=128", "--tokens_per_block=16",
           "--dtype=bf16", "--transport=inline"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ctl(proximactl, port, *args):
    cmd = [proximactl, *args, "--json", "--target=127.0.0.1:%d" % port, "--timeout=60", *PROFILE]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    if not lines:
        sys.exit("%s failed: %s" % (" ".join(cmd), r.stderr))
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proximad", required=True)
    ap.add_argument("--proximactl", required=True)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="proxima-clusterbench-")
    procs = []
    try:
        with open(d + "/peer.token", "w") as f:
            f.write("bench-peer-" + os.urandom(16).hex() + "\n")
        ports = [free_port(), free_port()]
        peers = ["127.0.0.1:%d" % p for p in ports]
        for name, me in zip(("a", "b"), peers):
            proc, _ = start(a.proximad, d, name, [
                "server.listen=" + me, "cluster.enabled=true", "cluster.advertise=" + me,
                "cluster.peers=[%s]" % ", ".join(peers),
                "cluster.peer_token={file: %s/peer.token}" % d,
                "cluster.health_interval=200ms", "cluster.health_timeout=200ms"])
            procs.append(proc)
        put = ctl(a.proximactl, ports[0], "put", "--seed=7", "--count=%d" % a.blocks)
        if not put["ok"] or put["stored"] != a.blocks:
            sys.exit("put failed: %s" % put)
        deadline = time.time() + 20  # B must see A live, and A's records must reach their homes
        while ctl(a.proximactl, ports[1], "lookup", "--seed=7",
                  "--count=%d" % a.blocks)["prefix_present"] != a.blocks:
            if time.time() > deadline:
                sys.exit("B never found A's blocks")
            time.sleep(0.1)
        runs = {"local": [], "remote": []}
        for _ in range(a.repeats):  # interleaved: machine noise hits both sides alike
            for kind, port in (("local", ports[0]), ("remote", ports[1])):
                g = ctl(a.proximactl, port, "get", "--seed=7", "--count=%d" % a.blocks)
                if not g["ok"] or g["hits"] != a.blocks or g["wrong_bytes"] != 0:
                    sys.exit("%s get failed: %s" % (kind, g))
                runs[kind].append(g["seconds"])
        mb = a.blocks * 2.0 * 1024 * 1024 / 1e6
        for metric, f in (("megabytes_per_second", lambda s: mb / s),
                          ("ms_per_block", lambda s: 1000.0 * s / a.blocks)):
            base = statistics.median(f(s) for s in runs["local"])
            value = statistics.median(f(s) for s in runs["remote"])
            print(json.dumps({"bench": "cluster", "metric": metric, "value": round(value, 3),
                              "config": "one_hop_remote_get_grpc", "baseline": "local_get",
                              "baseline_value": round(base, 3), "ratio": round(value / base, 3),
                              "block_bytes": 2 << 20, "blocks_per_get": a.blocks,
                              "transport": "inline", "repeats": a.repeats}), flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
