"""Stand-in hosts for multi-host tests: Linux network namespaces on one switch.

Each host is a network namespace with one interface (``eth0``, the inner end of a veth pair) and
its own address in a private /24 that exists only inside namespaces made here. The outer ends
of the veth pairs sit on a bridge in a third namespace, the switch, so hosts reach each other
only over their veths, never over loopback, and nothing outside the test bed is reachable from
them (they have no other route). A link cut sets a host's port on the switch down: its packets
go nowhere, as when a cable or a top-of-rack switch fails, and the processes on both sides see
it only through timeouts.

    with Hosts(2) as hosts:
        proc = hosts.popen(0, [sys.executable, "train.py"], env=...)   # runs inside host 0
        hosts.cut(1)        # partition host 1 from the others
        hosts.kill(1)       # SIGKILL every process on host 1

``Hosts(2, wire=(5, 0.01))`` links the hosts through a user-space wire instead (tests/wire.py:
TUN interfaces and a forwarding process that delays every packet 5 ms and drops 1% of them), for
kernels without ``tc netem``.

Everything is torn down on exit (processes killed, namespaces deleted), also after a failure.
Tests that need it skip where namespaces cannot be made (not root, no ``ip``): :func:`skip_reason`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from functools import cache
from itertools import count
from pathlib import Path

PREFIX = "lsh"  # namespace names: lsh<pid>-<n>s (switch), lsh<pid>-<n>h<i> (hosts), n: the n-th test bed of the process
_beds = count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@cache
def skip_reason() -> str | None:
    """Why multi-host tests cannot run here, or None: they need root and ``ip`` with network namespaces."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2): the multi-host test bed builds network namespaces with it"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_SYS_ADMIN"
    name = f"{PREFIX}{os.getpid()}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"network namespaces are not permitted here: `ip netns add` said {made.stderr.strip()!r}"
    _ip("netns", "del", name, check=False)
    return None


@cache
def wire_skip_reason() -> str | None:
    """Why the user-space wire (TUN interfaces) cannot run here, or None."""
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as err:
        return f"no TUN device for the user-space wire (/dev/net/tun: {err.strerror})"
    return None


class Hosts:
    """``count`` stand-in hosts on one switch; ``address(i)`` is host ``i``'s address."""

    INTERFACE = "eth0"  # the name every host sees for its link (what GLOO_SOCKET_IFNAME names)

    def __init__(self, count: int, wire: tuple[float, float] | None = None) -> None:
        self.count, self.wire = count, wire  # wire: (delay in ms, loss probability) of every packet
        self._wire_process: subprocess.Popen | None = None
        self.wire_counts: dict[str, int] = {}  # packets the wire forwarded and dropped, once closed
        pid, bed = os.getpid(), next(_beds)
        self.switch = f"{PREFIX}{pid}-{bed}s"
        self.names = [f"{PREFIX}{pid}-{bed}h{i}" for i in range(count)]
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50 + bed) % 250}"  # 10.200-249.x.0/24, inside these namespaces only
        self._procs: list[subprocess.Popen] = []

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        if self.wire is not None:
            return self._build_wire()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            port = f"p{i}"
            # Made inside the switch namespace, then the inner end moves to the host and is renamed there.
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", f"h{i}")
            _ip("-n", self.switch, "link", "set", f"h{i}", "netns", name)
            _ip("-n", name, "link", "set", f"h{i}", "name", self.INTERFACE)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            self._bring_up(i)

    def _build_wire(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        delay_ms, loss = self.wire
        self._wire_process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("wire.py")), str(delay_ms), str(loss),
             *(f"{name}:{self.address(i)}" for i, name in enumerate(self.names))],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if self._wire_process.stdout.readline().strip() != "ready":
            raise RuntimeError("the user-space wire (tests/wire.py) did not start")
        for i in range(self.count):
            self._bring_up(i)

    def _bring_up(self, host: int) -> None:
        """Host ``host``'s address on its interface, the interface and loopback up."""
        name = self.names[host]
        _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", self.INTERFACE)
        _ip("-n", name, "link", "set", self.INTERFACE, "up")
        _ip("-n", name, "link", "set", "lo", "up")

    def popen(self, host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside host ``host`` (``ip netns exec``); killed at teardown if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment plus what a process on any host needs: gloo's interface."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": self.INTERFACE, **extra}

    def lightning_env(self, host: int, **extra: str) -> dict[str, str]:
        """:meth:`env` for one rank per host launched through Lightning's environment: MASTER_ADDR on host 0, NODE_RANK."""
        return self.env(**{"MASTER_ADDR": self.address(0), "MASTER_PORT": "29500", "NODE_RANK": str(host), **extra})

    def pids(self, host: int) -> list[int]:
        """Every process running inside host ``host``."""
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split()]

    def cut(self, host: int) -> None:
        """Partition host ``host``: its port on the switch (its wire interface) goes down: nothing in or out."""
        if self.wire is not None:
            _ip("-n", self.names[host], "link", "set", self.INTERFACE, "down")
        else:
            _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def kill(self, host: int) -> None:
        """SIGKILL every process on host ``host``, as when the machine dies."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kill whatever still runs on the hosts, then delete every namespace made here."""
        for host in range(self.count):  # a namespace never made has no pids
            self.kill(host)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._wire_process is not None:
            self._wire_process.terminate()
            try:
                words = self._wire_process.communicate(timeout=10)[0].split()
                self.wire_counts = {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2)}
            except (subprocess.TimeoutExpired, ValueError):
                self._wire_process.kill()
                self._wire_process.wait(timeout=10)
        deadline = time.monotonic() + 10
        for name in [*self.names, self.switch]:
            while (
                _ip("netns", "del", name, check=False).returncode != 0 and name in _list().split() and time.monotonic() < deadline
            ):
                time.sleep(0.1)


def _list() -> str:
    return _ip("netns", "list", check=False).stdout
