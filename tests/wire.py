"""A slow, lossy wire between stand-in hosts, in user space: what ``tc netem`` does, for kernels without it.

Each host (a network namespace, tests/hosts.py) gets a TUN interface named ``eth0``; one
forwarder process holds every TUN and moves IPv4 packets between them by destination address,
holding each for ``delay_ms`` and dropping each with probability ``loss`` (on every packet, in both
directions, as netem on each link's egress would). TCP sees real delay and real loss: it
retransmits, its window shrinks, and every byte still arrives.

    python tests/wire.py DELAY_MS LOSS NAMESPACE:ADDRESS ...    # prints "ready" once the TUNs exist

The forwarder runs until SIGTERM, then prints ``forwarded N dropped M`` (packets) and exits; the
TUNs vanish with it.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time

TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
INTERFACE = "eth0"

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_tun(namespace: str) -> int:
    """A TUN interface ``eth0`` made inside ``namespace``; its file descriptor, held by this process."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", INTERFACE.encode(), IFF_TUN | IFF_NO_PI))
    finally:
        _setns(home)
        os.close(home)
        os.close(target)
    return fd


def forward(tuns: dict[bytes, int], delay_s: float, loss: float, counts: dict[str, int], seed: int = 0) -> None:
    """Move packets between TUNs by IPv4 destination, each held ``delay_s`` and dropped with probability ``loss``."""
    rng = random.Random(seed)
    poller = select.poll()
    for fd in tuns.values():
        poller.register(fd, select.POLLIN)
    queue: list[tuple[float, int, int, bytes]] = []  # (when due, order, out fd, packet)
    order = 0
    while True:
        wait_ms = max(0, int((queue[0][0] - time.monotonic()) * 1000) + 1) if queue else 1000
        for fd, _ in poller.poll(wait_ms):
            packet = os.read(fd, 65536)
            out = tuns.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
            if out is None:
                continue
            if rng.random() < loss:
                counts["dropped"] += 1
                continue
            heapq.heappush(queue, (time.monotonic() + delay_s, order, out, packet))
            order += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, packet = heapq.heappop(queue)
            try:
                os.write(out, packet)
                counts["forwarded"] += 1
            except OSError:  # the interface is down (a cut link): the packet is lost
                counts["dropped"] += 1


def main(argv: list[str]) -> None:
    delay_ms, loss, hosts = float(argv[0]), float(argv[1]), argv[2:]
    tuns = {}
    for item in hosts:
        namespace, address = item.split(":")
        tuns[socket.inet_aton(address)] = open_tun(namespace)
    counts = {"forwarded": 0, "dropped": 0}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        forward(tuns, delay_ms / 1000, loss, counts)
    finally:
        print(f"forwarded {counts['forwarded']} dropped {counts['dropped']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
