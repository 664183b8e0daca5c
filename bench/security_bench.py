#!/usr/bin/env python3
"""security_bench: what TLS + mTLS + bearer tokens cost, against plaintext without tokens,
measured in one run on loopback TCP.

Starts two proximad on free loopback ports from the same binary and config, except that the
secure one has server.tls (with a client CA: mTLS) and a token-protected namespace; makes a CA
and certificates with the openssl CLI. For each workload, runs `proximactl load` against the
plaintext daemon and the secure one, interleaved --repeats times, and reports the medians.
Prints one JSON object per workload and metric:
  {"bench":"security","workload":"small_blocks","metric":"calls_per_second","value":...,
   "baseline":"plaintext_open","baseline_value":...,"ratio":...}

Usage: security_bench.py --proximad=PATH --proximactl=PATH [--duration=S] [--repeats=N]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {
    # 4 KiB blocks: the per-call cost (handshake amortized, authentication, record framing).
    "small_blocks": ["--layers=1", "--kv_heads=1", "--head_dim=64", "--tokens_per_block=16",
                     "--dtype=fp16", "--batch=1"],
    # 256 KiB blocks, 4 per call: the per-byte cost (encryption).
    "large_blocks": ["--layers=4", "--kv_heads=8", "--head_dim=128", "--tokens_per_block=16",
                     "--dtype=bf16", "--batch=4"],
}


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", d + "/ca.key", "-out", d + "/ca.crt", "-days", "1",
            "-subj", "/CN=bench ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        with open(d + "/%s.ext" % name, "w") as f:
            f.write(ext + "\n")
        openssl("req", *ec, "-keyout", "%s/%s.key" % (d, name), "-out", "%s/%s.csr" % (d, name),
                "-subj", "/CN=" + name)
        openssl("x509", "-req", "-in", "%s/%s.csr" % (d, name), "-CA", d + "/ca.crt", "-CAkey",
                d + "/ca.key", "-CAcreateserial", "-out", "%s/%s.crt" % (d, name), "-days", "1",
                "-extfile", "%s/%s.ext" % (d, name))
    with open(d + "/bench.token", "w") as f:
        f.write("bench-token-" + os.urandom(16).hex() + "\n")


def start(proximad, d, name, sets):
    port_file = "%s/%s.port" % (d, name)
    args = [proximad, "--port_file=" + port_file, "--set=server.listen=127.0.0.1:0",
            "--set=server.unix_socket=", "--set=server.metrics_listen=",
            "--set=tiers.host.capacity_bytes=1GiB", "--set=log.level=warning"]
    args += ["--set=" + s for s in sets]
    proc = subprocess.Popen(args, stderr=open("%s/%s.log" % (d, name), "w"))
    deadline = time.time() + 20
    while time.time() < deadline:
        if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
            with open(port_file) as f:
                return proc, json.load(f)["tcp_port"]
        if proc.poll() is not None:
            sys.exit("proximad (%s) exited: %s" % (name, open("%s/%s.log" % (d, name)).read()))
        time.sleep(0.05)
    sys.exit("proximad (%s) did not start" % name)


def load(proximactl, port, extra, workload, duration, env):
    # Inline: the block bytes inside the gRPC calls, so inside TLS. With the UCX data plane on
    # (the default), `auto` would move them over UCX, outside TLS, and measure no encryption.
    cmd = [proximactl, "load", "--json", "--target=127.0.0.1:%d" % port, "--clients=4",
           "--duration=%g" % duration, "--working_set=64", "--get_fraction=0.8",
           "--transport=inline", *extra,
           *WORKLOADS[workload]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration + 60)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["ok"]:
        sys.exit("load failed: %s" % out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proximad", required=True)
    ap.add_argument("--proximactl", required=True)
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="proxima-secbench-")
    procs = []
    try:
        make_pki(d)
        plain, plain_port = start(a.proximad, d, "plain", [])
        procs.append(plain)
        secure, secure_port = start(a.proximad, d, "secure", [
            "server.tls.cert_file=%s/server.crt" % d, "server.tls.key_file=%s/server.key" % d,
            "server.tls.client_ca_file=%s/ca.crt" % d,
            "namespaces=[{name: default, tokens: [{name: bench, file: %s/bench.token}]}]" % d])
        procs.append(secure)
        env = dict(os.environ)
        secure_env = dict(env, PROXIMA_TOKEN=open(d + "/bench.token").read().strip())
        tls_flags = ["--tls_ca=%s/ca.crt" % d, "--tls_cert=%s/client.crt" % d,
                     "--tls_key=%s/client.key" % d]
        for workload in WORKLOADS:
            runs = {"plain": [], "secure": []}
            for _ in range(a.repeats):  # interleaved: machine noise hits both sides alike
                runs["plain"].append(load(a.proximactl, plain_port, [], workload, a.duration, env))
                runs["secure"].append(load(a.proximactl, secure_port, tls_flags, workload,
                                           a.duration, secure_env))
            for metric in ("calls_per_second", "megabytes_per_second", "p99_ms"):
                base = statistics.median(r[metric] for r in runs["plain"])
                value = statistics.median(r[metric] for r in runs["secure"])
                print(json.dumps({"bench": "security", "workload": workload, "metric": metric,
                                  "value": round(value, 3), "config": "tls+mtls+token",
                                  "baseline": "plaintext_open", "baseline_value": round(base, 3),
                                  "ratio": round(value / base, 3) if base else None,
                                  "clients": 4, "repeats": a.repeats,
                                  "seconds_each": a.duration}), flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
