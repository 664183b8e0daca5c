#!/usr/bin/env python3
"""cluster_bench: a get served by the local daemon against the same get served one hop away
(the worker's daemon fetches the blocks from the node that holds them, daemon/cluster), with
the peer hop over UCX and over gRPC, in one run on loopback.

Starts three proximad, A, B and C, from the same binary as one cluster (static peers, a peer
token, the UCX data plane on): B fetches from peers over UCX (cluster.transport auto: the
holder sends the blocks to B's worker as UCX messages), C over gRPC (cluster.transport grpc: the
bytes come inline in the peer's answer). Puts --blocks test blocks of 2 MiB on A with
`proximactl put`; then, interleaved --repeats times, `proximactl get` of all of them through A
(local: the baseline), through B and through C (every block a remote hit: home lookup +
FetchBlocks from A), all with the inline worker transport so that the worker side is the same.
Every get checks every byte. Prints one JSON object per metric and configuration:
  {"bench":"cluster","metric":"megabytes_per_second","config":"one_hop_remote_get_ucx",
   "value":...,"baseline":"local_get","baseline_value":...,"ratio":...}
and the UCX peer hop against the gRPC one ("baseline":"one_hop_remote_get_grpc").

Then the hand-off at shutdown (cluster.spill.handoff, docs/cluster.md), in a second cluster of
three (all on cluster.transport auto): --handoff_blocks blocks of 2 MiB put on A, gotten through B
--repeats times (the one-hop UCX get, the baseline), then A is sent SIGTERM and hands them to B
and C; its log line gives the bytes and seconds of the hand-off, and B must then find and read
every block byte-exact:
  {"bench":"cluster","metric":"megabytes_per_second","config":"handoff_at_shutdown",
   "value":...,"baseline":"one_hop_remote_get_ucx","baseline_value":...,"ratio":...}

Usage: cluster_bench.py --proximad=PATH --proximactl=PATH [--blocks=N] [--repeats=N]
                        [--handoff_blocks=N]
"""
import argparse
import json
import os
import random
import re
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


def free_ports(n):
    """`n` distinct free loopback ports, picked at random below the kernel's ephemeral range, as
    common/testing/free_port.h picks them (a port from that range can be taken, before its daemon
    binds it, by any process's outgoing connection); from the ephemeral range when there is no
    room below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports = []
    while len(ports) < n:
        candidates = [random.randrange(10000, low) for _ in range(100)] if low > 11000 else []
        for port in candidates + [0]:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                port = s.getsockname()[1]
            if port not in ports:
                ports.append(port)
            break
    return ports


def ctl(proximactl, port, *args):
    cmd = [proximactl, *args, "--json", "--target=127.0.0.1:%d" % port, "--timeout=60", *PROFILE]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    if not lines:
        sys.exit("%s failed: %s" % (" ".join(cmd), r.stderr))
    return json.loads(lines[-1])


def start_cluster(a, d, names, node_sets):
    """Daemons `names` as one cluster; node_sets(i) are node i's own --set overrides."""
    ports = free_ports(len(names))
    peers = ["127.0.0.1:%d" % p for p in ports]
    procs = []
    for i, (name, me) in enumerate(zip(names, peers)):
        proc, _ = start(a.proximad, d, name, [
            "server.listen=" + me, "ucx.enabled=true", "cluster.enabled=true",
            "cluster.advertise=" + me, "cluster.peers=[%s]" % ", ".join(peers),
            "cluster.peer_token={file: %s/peer.token}" % d,
            "cluster.health_interval=200ms", "cluster.health_timeout=200ms"] + node_sets(i))
        procs.append(proc)
    return procs, ports


def wait_found(a, ports, seed, count):
    deadline = time.time() + 20  # peers must see the holder live, and records reach their homes
    for port in ports:
        while ctl(a.proximactl, port, "lookup", "--seed=%d" % seed,
                  "--count=%d" % count)["prefix_present"] != count:
            if time.time() > deadline:
                sys.exit("the blocks of seed %d were never all found through port %d"
                         % (seed, port))
            time.sleep(0.1)


def handoff(a, d, procs):
    """The hand-off run; its daemons are appended to `procs` (the caller stops them)."""
    n = a.handoff_blocks
    started, ports = start_cluster(
        a, d, ("ha", "hb", "hc"),
        lambda i: ["log.level=info"] if i == 0 else ["cluster.spill.handoff=0s"])
    procs.extend(started)
    put = ctl(a.proximactl, ports[0], "put", "--seed=9", "--count=%d" % n)
    if not put["ok"] or put["stored"] != n:
        sys.exit("put failed: %s" % put)
    wait_found(a, ports[1:2], 9, n)
    gets = []
    for _ in range(a.repeats):
        g = ctl(a.proximactl, ports[1], "get", "--seed=9", "--count=%d" % n)
        if not g["ok"] or g["hits"] != n or g["wrong_bytes"] != 0:
            sys.exit("remote get failed: %s" % g)
        gets.append(g["seconds"])
    start_s = time.time()
    started[0].send_signal(signal.SIGTERM)
    started[0].wait(timeout=60)
    exit_s = time.time() - start_s
    log = open(d + "/ha.log").read()
    m = re.search(r"handed blocks off to peers before exit blocks=(\d+) bytes=(\d+) "
                  r"left_blocks=(\d+) deleted_blocks=\d+ rounds=(\d+) ended=\"([^\"]*)\" "
                  r"seconds=([0-9.e-]+)", log)
    if not m:
        sys.exit("no hand-off line in A's log:\n" + log[-3000:])
    moved, moved_bytes, left, rounds, ended, seconds = (
        int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5),
        float(m.group(6)))
    wait_found(a, ports[1:2], 9, n)  # the receivers' records reach the homes without A
    g = ctl(a.proximactl, ports[1], "get", "--seed=9", "--count=%d" % n)
    if not g["ok"] or g["hits"] != n or g["wrong_bytes"] != 0:
        sys.exit("get after the hand-off failed: %s" % g)
    value = moved_bytes / 1e6 / seconds
    base = statistics.median(n * 2.0 * 1024 * 1024 / 1e6 / s for s in gets)
    print(json.dumps({"bench": "cluster", "metric": "megabytes_per_second",
                      "config": "handoff_at_shutdown", "value": round(value, 3),
                      "baseline": "one_hop_remote_get_ucx", "baseline_value": round(base, 3),
                      "ratio": round(value / base, 3), "block_bytes": 2 << 20, "blocks": n,
                      "moved_blocks": moved, "left_blocks": left, "rounds": rounds,
                      "ended": ended,
                      "handoff_seconds": round(seconds, 4), "sigterm_to_exit_seconds":
                      round(exit_s, 3), "found_after": g["hits"], "repeats": a.repeats}),
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proximad", required=True)
    ap.add_argument("--proximactl", required=True)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--handoff_blocks", type=int, default=64)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="proxima-clusterbench-")
    procs = []
    try:
        with open(d + "/peer.token", "w") as f:
            f.write("bench-peer-" + os.urandom(16).hex() + "\n")
        # A and B on cluster.transport auto (UCX between them), C on grpc; none hands off.
        started, ports = start_cluster(
            a, d, ("a", "b", "c"),
            lambda i: ["cluster.transport=" + ("grpc" if i == 2 else "auto"),
                       "cluster.spill.handoff=0s"])
        procs.extend(started)
        put = ctl(a.proximactl, ports[0], "put", "--seed=7", "--count=%d" % a.blocks)
        if not put["ok"] or put["stored"] != a.blocks:
            sys.exit("put failed: %s" % put)
        wait_found(a, ports[1:], 7, a.blocks)
        kinds = (("local", ports[0]), ("ucx", ports[1]), ("grpc", ports[2]))
        runs = {kind: [] for kind, _ in kinds}
        for _ in range(a.repeats):  # interleaved: machine noise hits every side alike
            for kind, port in kinds:
                g = ctl(a.proximactl, port, "get", "--seed=7", "--count=%d" % a.blocks)
                if not g["ok"] or g["hits"] != a.blocks or g["wrong_bytes"] != 0:
                    sys.exit("%s get failed: %s" % (kind, g))
                runs[kind].append(g["seconds"])
        mb = a.blocks * 2.0 * 1024 * 1024 / 1e6
        for metric, f in (("megabytes_per_second", lambda s: mb / s),
                          ("ms_per_block", lambda s: 1000.0 * s / a.blocks)):
            med = {kind: statistics.median(f(s) for s in runs[kind]) for kind, _ in kinds}
            for config, base_name, kind, base in (
                    ("one_hop_remote_get_ucx", "local_get", "ucx", "local"),
                    ("one_hop_remote_get_grpc", "local_get", "grpc", "local"),
                    ("one_hop_remote_get_ucx", "one_hop_remote_get_grpc", "ucx", "grpc")):
                print(json.dumps({"bench": "cluster", "metric": metric,
                                  "value": round(med[kind], 3), "config": config,
                                  "baseline": base_name, "baseline_value": round(med[base], 3),
                                  "ratio": round(med[kind] / med[base], 3),
                                  "block_bytes": 2 << 20, "blocks_per_get": a.blocks,
                                  "worker_transport": "inline", "repeats": a.repeats}),
                      flush=True)
        if a.handoff_blocks > 0:
            handoff(a, d, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
