#!/usr/bin/env python3
"""Run a torchrun job on an emulated multi-host cluster built from network namespaces.

    sudo python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 2 --nic-rate 1gbit -- \
        -m lab.bench.bench_resharding --suite paper

Why: the paper's cluster model is "fast inside a host, one slow full-duplex NIC per
host". On one machine we reproduce it (docs/design.md §7) with one Linux
network namespace per host, one veth "NIC" each plugged into a bridge that lives in
its own namespace, and a ``tc tbf`` rate limit on both directions of every NIC. Ranks
of one host talk over that namespace's loopback (unlimited); ranks of different hosts
cross two rate-limited links.

Everything is named ``mr<pid>…`` (unique per run of this tool) and uses addresses in
10.77.0.0/24 that exist only inside namespaces created here. Namespaces, and every
process still inside them, are removed on exit: normal end, error, SIGINT, SIGTERM,
SIGHUP. Anything the job writes to TMPDIR (torchrun's ``torchelastic_*`` dirs) lands in a
private temp dir that is deleted too.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

SUBNET = "10.77.0"


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built here (not root, no ``ip``, netns refused)."""


@dataclass(frozen=True)
class ClusterLayout:
    """Names and addresses of one emulated cluster (pure data: dry-run prints it)."""

    prefix: str
    hosts: int
    rate: str
    burst: str = "256kb"
    latency: str = "100ms"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}sw"

    def host_ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def host_addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def namespaces(self) -> list[str]:
        return [self.host_ns(i) for i in range(self.hosts)] + [self.switch_ns]

    def setup_commands(self) -> list[list[str]]:
        """The ``ip``/``tc`` commands that build the cluster, in order (the recipe of docs/design.md §7)."""
        sw = self.switch_ns
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        cmds = [
            ["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "set", "lo", "up"],
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "br0", "up"],
        ]
        for i in range(self.hosts):
            ns, port = self.host_ns(i), f"p{i}"
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", sw],
                ["ip", "-n", sw, "link", "set", port, "master", "br0"],
                ["ip", "-n", sw, "link", "set", port, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.host_addr(i)}/24", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                # host egress, then host ingress (= the switch port's egress)
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf],
                ["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", port, "root", *tbf],
            ]
        return cmds

    def host_command(self, i: int, procs_per_host: int, master_port: int, cmd: Sequence[str],
                     python: str = sys.executable) -> list[str]:
        """The command that runs host ``i``'s torchrun inside its namespace, own hostname."""
        torchrun = [python, "-m", "torch.distributed.run", "--nnodes", str(self.hosts),
                    "--nproc-per-node", str(procs_per_host), "--node-rank", str(i),
                    "--master-addr", self.host_addr(0), "--master-port", str(master_port), *cmd]
        # `sh -c 'hostname "$0"; exec "$@"' NAME ARGS…` avoids any quoting of the user command
        return ["ip", "netns", "exec", self.host_ns(i), "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.host_ns(i), *torchrun]


def check_privileges() -> None:
    """Raise ClusterError saying exactly what is missing."""
    if shutil.which("ip") is None:
        raise ClusterError("the `ip` command (iproute2) is not installed; the emulated cluster needs it")
    if shutil.which("tc") is None:
        raise ClusterError("the `tc` command (iproute2) is not installed; the emulated cluster needs it")
    if shutil.which("unshare") is None:
        raise ClusterError("the `unshare` command (util-linux) is not installed")
    if os.geteuid() != 0:
        raise ClusterError(f"creating network namespaces needs root; running as uid {os.geteuid()}")


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise ClusterError(f"`{shlex.join(cmd)}` failed with exit code {res.returncode}: {res.stdout.strip()}")


def existing_namespaces() -> set[str]:
    res = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return {line.split()[0] for line in res.stdout.splitlines() if line.strip()}


def _ns_pids(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _kill_ns_processes(namespaces: Sequence[str], grace_s: float = 3.0) -> None:
    """SIGTERM everything inside our namespaces, then SIGKILL what is left.

    torchrun starts its workers in new sessions, so killing torchrun's process group is not
    enough; `ip netns pids` finds every process still inside a namespace.
    """
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        pids = [p for ns in namespaces for p in _ns_pids(ns)]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_ns_pids(ns) for ns in namespaces):
            time.sleep(0.1)


def teardown(layout: ClusterLayout) -> list[str]:
    """Remove our namespaces (killing what runs in them). Returns the names that could not be removed."""
    mine = [ns for ns in layout.namespaces() if ns in existing_namespaces()]
    _kill_ns_processes(mine)
    failed = []
    for ns in mine:
        res = subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode != 0:
            failed.append(f"{ns}: {res.stdout.strip()}")
    return failed


def _pump(name: str, stream, lock: threading.Lock, out) -> None:
    """Copy one host's output to ours, each line prefixed with the host name."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            out.write(f"[{name}] {line}\n")
            out.flush()
    stream.close()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N → 128+N, like a shell


def run_cluster(layout: ClusterLayout, procs_per_host: int, master_port: int, cmd: Sequence[str],
                out=sys.stdout, timeout_s: float | None = None) -> int:
    """Build the cluster, run the job on every host, tear everything down; returns the worst exit code."""
    check_privileges()
    clash = set(layout.namespaces()) & existing_namespaces()
    if clash:
        raise ClusterError(f"namespaces {sorted(clash)} already exist; refusing to reuse them")
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tmp = tempfile.mkdtemp(prefix=f"{layout.prefix}-")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1", TMPDIR=tmp,
               MPLCONFIGDIR=os.path.join(tmp, "mpl"))
    previous = {}

    def _on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread: the caller handles signals
            pass
    worst = 0
    try:
        for c in layout.setup_commands():
            _run(c)
        for i in range(layout.hosts):
            p = subprocess.Popen(layout.host_command(i, procs_per_host, master_port, cmd), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(layout.host_ns(i), p.stdout, lock, out), daemon=True)
            t.start()
            pumps.append(t)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if deadline is not None and time.monotonic() > deadline:
                with lock:
                    out.write(f"[emulate_cluster] timeout after {timeout_s:.0f}s; killing the job\n")
                worst = 124
                break
            # one host failing usually leaves the others blocked in a collective: stop them
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5.0)
                break
            time.sleep(0.1)
        for p in procs:
            if p.poll() is not None:
                worst = max(worst, _exit_code(p.returncode))
    except KeyboardInterrupt as e:
        with lock:
            out.write(f"[emulate_cluster] interrupted ({e}); tearing down\n")
        worst = max(worst, 130)
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the teardown
            signal.signal(sig, signal.SIG_IGN)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        failed = teardown(layout)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.returncode not in (None, 0):
                worst = max(worst, _exit_code(p.returncode))
        for t in pumps:
            t.join(timeout=2)
        shutil.rmtree(tmp, ignore_errors=True)
        for sig, h in previous.items():
            signal.signal(sig, h)
        if failed:
            out.write(f"[emulate_cluster] could not remove namespaces: {failed}\n")
            worst = max(worst, 1)
    return worst


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("usage: emulate_cluster.py [options] -- SCRIPT [ARGS...]  (the `--` is required)")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, required=True, help="number of emulated hosts (network namespaces)")
    ap.add_argument("--procs-per-host", type=int, required=True, help="torchrun --nproc-per-node on each host")
    ap.add_argument("--nic-rate", default="1gbit", help="tc rate of every host NIC, each direction (e.g. 1gbit, 200mbit)")
    ap.add_argument("--burst", default="256kb", help="tbf burst")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--prefix", default=None, help="namespace name prefix (default mr<pid>)")
    ap.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds (exit 124)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and do nothing")
    args = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        ap.error("no command after `--`")
    if not 1 <= args.hosts <= 200:
        ap.error(f"--hosts {args.hosts} must be in 1..200 (addresses are 10.77.0.1..200)")
    if args.procs_per_host < 1:
        ap.error(f"--procs-per-host {args.procs_per_host} must be >= 1")
    return args, cmd


def main(argv: Sequence[str] | None = None) -> int:
    args, cmd = parse_args(sys.argv[1:] if argv is None else argv)
    layout = ClusterLayout(prefix=args.prefix or f"mr{os.getpid()}", hosts=args.hosts,
                           rate=args.nic_rate, burst=args.burst)
    if args.dry_run:
        for c in layout.setup_commands():
            print(shlex.join(c))
        for i in range(layout.hosts):
            print("GLOO_SOCKET_IFNAME=eth0 " + shlex.join(layout.host_command(i, args.procs_per_host,
                                                                              args.master_port, cmd)) + " &")
        for ns in layout.namespaces():
            print(shlex.join(["ip", "netns", "del", ns]))
        return 0
    try:
        return run_cluster(layout, args.procs_per_host, args.master_port, cmd, timeout_s=args.timeout)
    except ClusterError as e:
        print(f"emulate_cluster: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
