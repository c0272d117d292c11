"""How long a ZMQ message takes to reach a process that was idle, by how long
it idled, sleeping in its poll or spinning.

    python benchmarks/wake_latency.py --gaps-ms 0 1 5 25 --messages 40

A server process (a ROUTER polled as the engine process polls its request
plane: ``poll(5 ms)`` when sleeping, ``poll(0)`` when spinning) answers each
message after a pause of the given gap; an asyncio client (a DEALER, as the
gateway's worker client) waits as long again before its next message. Both
read the host's monotonic clock, which every process on one Linux host
shares, so each direction is timed on its own: "to server" from the client's
send to the server's poll returning, "back" from the server's send to the
client's receive. With ``--spin`` the server polls without sleeping and the
client's loop is kept awake by a task that yields at once, over and over.
Prints the medians and writes a JSON record.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_record  # noqa: E402
from worker.processes import free_port  # noqa: E402


def serve(endpoint: str, spin: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if sock not in dict(poller.poll(0 if spin else 5)):
            continue
        arrived = time.monotonic()
        client, payload = sock.recv_multipart()
        if payload == b"stop":
            break
        sent, gap_ms = (float(x) for x in payload.split(b","))
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        sock.send_multipart([client, f"{arrived - sent},{time.monotonic()}".encode()])
    sock.close()
    ctx.term()


async def measure(endpoint: str, gaps_ms: list[float], n: int, spin: bool) -> list[dict[str, Any]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    await asyncio.sleep(0.3)  # the connection up before the first timing
    stop = False

    async def keep_awake() -> None:
        while not stop:
            await asyncio.sleep(0)

    task = asyncio.create_task(keep_awake()) if spin else None
    rows = []
    for gap in gaps_ms:
        there, back = [], []
        for _ in range(n):
            await sock.send(f"{time.monotonic()},{gap}".encode())
            reply = await sock.recv()
            now = time.monotonic()
            one_way, sent = (float(x) for x in reply.split(b","))
            there.append(one_way * 1e3)
            back.append((now - sent) * 1e3)
            await asyncio.sleep(gap / 1e3)
        row = {
            "spin": spin,
            "gap_ms": gap,
            "to_server_ms_median": statistics.median(there),
            "back_ms_median": statistics.median(back),
        }
        rows.append(row)
        print(
            f"{'spin' if spin else 'sleep':>5} gap {gap:>5g} ms: to server "
            f"{row['to_server_ms_median']:.3f} ms, back {row['back_ms_median']:.3f} ms",
            flush=True,
        )
    stop = True
    if task is not None:
        await task
    await sock.send(b"stop")
    sock.close(linger=500)
    ctx.term()
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 1, 5, 25])
    ap.add_argument("--messages", type=int, default=40, help="messages per gap (default: 40)")
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=("sleep", "spin"),
        default=["sleep", "spin"],
        help="how both sides wait (default: both, one after the other)",
    )
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    rows = []
    for mode in args.modes:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        server = multiprocessing.get_context("spawn").Process(
            target=serve, args=(endpoint, mode == "spin")
        )
        server.start()
        try:
            rows += asyncio.run(measure(endpoint, args.gaps_ms, args.messages, mode == "spin"))
        finally:
            server.join(10)
            if server.is_alive():
                server.kill()
    write_record(
        "wake_latency",
        argv if argv is not None else sys.argv[1:],
        {"rows": rows},
        args.output_file,
        "wake-latency",
    )


if __name__ == "__main__":
    main()
