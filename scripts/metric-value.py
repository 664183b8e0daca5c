#!/usr/bin/env python3
"""Prints the value of one series at a running proximad's metrics endpoint, or nan.

    scripts/metric-value.py PORT_FILE SERIES

PORT_FILE: the daemon's --port_file ({"metrics_port": N, ...}); SERIES: name and labels exactly
as exported, e.g. 'proxima_namespace_bytes{namespace="app"}'. Used by the benchmark scripts.
"""
import json
import sys
import urllib.request

port = json.load(open(sys.argv[1]))["metrics_port"]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
print(next((line.split()[1] for line in text.splitlines()
            if line.startswith(sys.argv[2] + " ")), "nan"))
