"""Fixtures of the proxima package tests: a real proximad on loopback, started per test module.

The package is imported from this source tree with the extension modules of a CMake build
($PROXIMA_BUILD_DIR, default <repo>/build) when that build has them, else as installed by pip.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG_ROOT = os.path.dirname(_HERE)
_REPO = os.path.dirname(os.path.dirname(_PKG_ROOT))
BUILD_DIR = os.environ.get("PROXIMA_BUILD_DIR", os.path.join(_REPO, "build"))

if glob.glob(os.path.join(BUILD_DIR, "client", "python", "_proxima*.so")):
    os.environ["PROXIMA_EXTENSION_DIRS"] = os.pathsep.join(
        [os.path.join(BUILD_DIR, "client", "python"), os.path.join(BUILD_DIR, "tools", "eval")])
    sys.path.insert(0, _PKG_ROOT)


def proximad_path() -> str:
    path = os.environ.get("PROXIMAD", os.path.join(BUILD_DIR, "daemon", "proximad"))
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"proximad at {path}: expected an executable (set PROXIMAD or "
                                "PROXIMA_BUILD_DIR)")
    return path


class Daemon:
    """A proximad process on loopback and a Unix socket in a fresh directory."""

    def __init__(self, sets=(), config_text=None):
        self.dir = tempfile.mkdtemp(prefix="proxima-py-")
        self.socket = os.path.join(self.dir, "proximad.sock")
        self.sets = ["server.listen=127.0.0.1:0", f"server.unix_socket={self.socket}",
                     "server.metrics_listen=", "tiers.host.capacity_bytes=64MiB",
                     "server.shutdown_grace_seconds=1", *sets]
        self.config_text = config_text
        self.proc = None
        self.start()

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def start(self):
        port_file = os.path.join(self.dir, "port.json")
        if os.path.exists(port_file):
            os.remove(port_file)
        argv = [proximad_path(), f"--port_file={port_file}"]
        if self.config_text is not None:
            cfg = os.path.join(self.dir, "proxima.yaml")
            with open(cfg, "w") as f:
                f.write(self.config_text)
            argv.append(f"--config={cfg}")
        argv += [f"--set={s}" for s in self.sets]
        self.log = open(os.path.join(self.dir, "proximad.log"), "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
                ports = json.load(open(port_file))
                self.tcp_port, self.metrics_port = ports["tcp_port"], ports["metrics_port"]
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"proximad exited during start-up: {self.read_log()}")
            time.sleep(0.02)
        raise TimeoutError(f"proximad did not start within 20 s: {self.read_log()}")

    def read_log(self) -> str:
        with open(os.path.join(self.dir, "proximad.log"), errors="replace") as f:
            return f.read()

    def metric(self, series: str) -> float:
        """One series of the daemon's /metrics (start it with server.metrics_listen=127.0.0.1:0)."""
        if not self.metrics_port:
            raise RuntimeError("proximad started without metrics (server.metrics_listen)")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as r:
            for line in r.read().decode().splitlines():
                name, _, value = line.rpartition(" ")
                if name == series:
                    return float(value)
        raise KeyError(f"{series}: not among proximad's metrics")

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self):
        """SIGSTOP, returning once every thread of the daemon is stopped."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = f"/proc/{self.proc.pid}/task"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for tid in os.listdir(tasks):
                with open(f"{tasks}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            if all(s in ("T", "t") for s in states):
                return
            time.sleep(0.005)
        raise TimeoutError(f"proximad {self.proc.pid} did not stop within 10 s")

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self):
        self.kill()
        self.start()


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    yield d
    d.kill()


@pytest.fixture
def client(daemon):
    import proxima
    return proxima.Client(daemon.target)
