"""An emulated slow-link cluster: one network namespace per worker, joined by a bridge.

Layout for N workers (names carry a per-run prefix so runs never collide):

    namespace {p}-sw : bridge br0 <- veth {p}s{i}  (tbf: rate R toward worker i)
    namespace {p}-w{i}: eth0 10.213.0.{i+1}/24      (tbf: rate R from worker i)

Every link is limited with `tc qdisc ... tbf` in both directions, so a worker's uplink and
downlink each run at R, like a machine on a switched network.

With `nodes=K`, the N workers are grouped into K nodes of N/K workers, one namespace per
node ({p}-w{k}, address 10.213.0.{k+1}): workers i*N/K .. (i+1)*N/K - 1 share node i's
limited link to the switch, and reach each other over that namespace's loopback, unlimited
(traffic to a local address never leaves through eth0), as GPUs inside one machine do.
`link_bytes()` reads what crossed each node's link and its loopback, so a run's inter-node
and intra-node bytes are measured on the wire, not inferred. All addresses live inside
namespaces this module creates; nothing touches the host's own interfaces. netem is not
available on this project's machines, so latency is modelled (edgc simulate), not emulated.

With `cores`, worker i runs under `taskset -c cores[i]`: pinned to CPUs of its own, in
namespaces or on loopback (edgc.bench.emulation.worker_cores picks them).

Everything is torn down on exit from the `with` block, on success, failure or Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from types import FrameType

logger = logging.getLogger(__name__)

__all__ = ["Cluster", "NetnsUnavailable", "parse_rate", "stale_namespaces"]

SUBNET = "10.213.0"  # inside our own namespaces only
_PREFIX_RE = re.compile(r"^edgc\d+-(sw|w\d+)$")


class NetnsUnavailable(RuntimeError):
    """Namespaces or tc cannot be used here (not root, or iproute2 missing)."""


def parse_rate(text: str) -> float:
    """Bits per second from a tc-style rate: "200mbit", "1gbit", "500kbit", "10mbps" (bytes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)\s*", text.lower())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected a number and unit like 200mbit, 1gbit or 25mbps")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    bits = float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return bits


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def stale_namespaces() -> list[str]:
    """Namespaces left by an edgc run that was killed before it could clean up."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line and _PREFIX_RE.match(line.split()[0])]


@dataclass
class Cluster:
    """N workers and how to reach them: in namespaces with rate-limited links, or on loopback.

    With `bandwidth=None` it is loopback mode: no namespaces, no limits, 127.0.0.1. With
    `cores`, each worker is pinned to its own list of CPUs.
    """

    n: int
    bandwidth: str | None = "200mbit"
    prefix: str = field(default_factory=lambda: f"edgc{os.getpid()}")
    nodes: int | None = None  # group the workers into this many nodes (None: one per worker)
    cores: list[list[int]] | None = None  # the CPUs of each worker (None: not pinned)
    _made: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.nodes is not None and (self.nodes < 1 or self.n % self.nodes):
            raise ValueError(f"--nodes {self.nodes} must divide the {self.n} workers evenly")
        if self.cores is not None and (len(self.cores) != self.n or not all(self.cores)):
            raise ValueError(f"cores must give each of the {self.n} workers at least one CPU, got {self.cores}")

    @property
    def node_count(self) -> int:
        """Namespaces with a link of their own: the nodes, or one per worker."""
        return self.nodes if self.nodes is not None else self.n

    def node(self, i: int) -> int:
        """The node of worker i."""
        return i // (self.n // self.node_count)

    @property
    def emulated(self) -> bool:
        return self.bandwidth is not None

    @property
    def bits_per_second(self) -> float | None:
        return parse_rate(self.bandwidth) if self.bandwidth else None

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{self.node(i) + 1}" if self.emulated else "127.0.0.1"

    @property
    def ifname(self) -> str:
        return "eth0" if self.emulated else "lo"

    def command(self, i: int, argv: list[str]) -> list[str]:
        """argv run as worker i (inside its namespace when emulated, on its CPUs when pinned)."""
        inner = ["ip", "netns", "exec", f"{self.prefix}-w{self.node(i)}", *argv] if self.emulated else list(argv)
        # (taskset's affinity passes through ip's exec to the worker and every thread it starts)
        return ["taskset", "-c", ",".join(map(str, self.cores[i])), *inner] if self.cores else inner

    def threads(self, i: int) -> int:
        """Compute threads for worker i: its own CPUs when pinned, else an even share of the machine's."""
        return len(self.cores[i]) if self.cores else max(1, (os.cpu_count() or 1) // self.n)

    @staticmethod
    def check() -> None:
        """Raise NetnsUnavailable, saying what is missing and what to do instead."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("emulating slow links needs root (network namespaces and tc); "
                                   "run as root, or use --loopback to run on 127.0.0.1 without rate limits")
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if missing:
            raise NetnsUnavailable(f"{' and '.join(missing)} not found (Debian package iproute2); "
                                   "install it, or use --loopback")

    def __enter__(self) -> Cluster:
        if self.bandwidth is None:  # (not emulated: loopback)
            return self
        self.check()
        parse_rate(self.bandwidth)  # validate before touching anything
        self._old_handlers = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()
        for s, h in getattr(self, "_old_handlers", {}).items():
            signal.signal(s, h)

    def _setup(self) -> None:
        p, rate = self.prefix, self.bandwidth
        assert rate is not None  # (__enter__ sets up an emulated cluster only)
        # The bucket holds 4 ms of traffic (at least 32 KiB): enough to sustain the rate at
        # the kernel's timer granularity, small enough that a message does not slip through
        # faster than the link. A 1 MB burst let sub-megabyte P/Q all-reduces beat the
        # line rate by up to 10% in `edgc bench comm`.
        burst = max(32 * 1024, int(parse_rate(rate) / 8 * 0.004))
        tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        switch = f"{p}-sw"
        _run("ip", "netns", "add", switch)
        self._made.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i in range(self.node_count):
            ns = f"{p}-w{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            # create the pair inside the worker namespace so no interface ever sits in the host's
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"s{i}", "netns", switch)
            _run("ip", "-n", switch, "link", "set", f"s{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)
            _run("ip", "netns", "exec", switch, "tc", "qdisc", "add", "dev", f"s{i}", *tbf)
        logger.info("emulated cluster %s: %s workers in %s namespaces at %s each way", p, self.n, self.node_count,
                    rate)

    def link_bytes(self) -> tuple[int, int]:
        """(bytes sent over the nodes' links, bytes sent over their loopbacks) so far,
        summed over the nodes, from the kernel's interface counters; (0, 0) on loopback."""
        if not self.emulated:
            return 0, 0
        inter = intra = 0
        for i in range(self.node_count):
            inter += _tx_bytes(f"{self.prefix}-w{i}", "eth0")
            intra += _tx_bytes(f"{self.prefix}-w{i}", "lo")
        return inter, intra

    def teardown(self) -> None:
        """Delete every namespace this cluster made (their links and qdiscs go with them)."""
        while self._made:
            ns = self._made.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _tx_bytes(namespace: str, dev: str) -> int:
    """The bytes interface `dev` of `namespace` has sent (its kernel counter)."""
    proc = subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"reading {dev}'s counters in {namespace} failed: {proc.stderr.strip()}")
    return int(proc.stdout.strip())


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
