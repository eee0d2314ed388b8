"""One TCP flow for measuring a host's capped uplink; runs inside a namespace.

    python flow.py recv ADDR PORT      listen, print "ready", take one
                                       connection, drain it to EOF, print JSON
                                       {"bytes", "t_first", "t_last"}
    python flow.py send ADDR PORT SECS send zeros as fast as TCP allows for
                                       SECS seconds, close, print JSON {"bytes"}

Times are CLOCK_MONOTONIC, which all network namespaces share, so the parent
can put several receivers' windows on one time line.
"""

import json
import socket
import sys
import time

CHUNK = 1 << 16


def recv(addr: str, port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    total = 0
    t_first = t_last = None
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        now = time.monotonic()
        if t_first is None:
            t_first = now
        t_last = now
        total += n
    conn.close()
    srv.close()
    print(json.dumps({"bytes": total, "t_first": t_first, "t_last": t_last}), flush=True)


def send(addr: str, port: int, seconds: float) -> None:
    sock = socket.create_connection((addr, port), timeout=30)
    payload = bytes(CHUNK * 4)
    total = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.sendall(payload)
        total += len(payload)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # wait for the receiver to close: every byte has landed
    sock.close()
    print(json.dumps({"bytes": total}), flush=True)


if __name__ == "__main__":
    mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "recv":
        recv(addr, port)
    elif mode == "send":
        send(addr, port, float(sys.argv[4]))
    else:
        sys.exit(f"unknown mode {mode!r}")
