"""Peak memory of a KV event publisher when one peer sends a big frame to its replay socket.

Starts a publisher (``services.engine_core.kv_events.ZmqEventPublisher``, replay on loopback tcp)
in a child process, sends it one frame of ``--mib`` MiB from a plain DEALER, and prints the
child's peak RSS before and after. Run it against another checkout's code with
``PYTHONPATH=<checkout>`` to compare.

Usage: ``PYTHONPATH=. python benchmarks/scripts/kv_events_big_frame.py [--mib 256]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import zmq

_CHILD = r"""
import resource, sys, time
from protocol.kv_events import KVEventsConfig
from services.engine_core.kv_events import ZmqEventPublisher
config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
pub = ZmqEventPublisher(config, 0)
print(pub.replay_endpoint, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.stdin.readline()  # the frame was sent
time.sleep(3)  # the publisher's thread had time to take it, if libzmq let it in
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="Size of the frame (default 256 MiB).")
    args = parser.parse_args()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    address, before_kib = child.stdout.readline().split()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    sock.send_multipart([b"", b"\0" * (args.mib << 20)])
    child.stdin.write("\n")
    child.stdin.flush()
    after_kib = child.stdout.readline()
    child.wait()
    sock.close()
    ctx.term()
    print(
        f"{args.mib} MiB frame: publisher peak RSS {int(before_kib) / 1024:.0f} -> {int(after_kib) / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
