#!/usr/bin/env python3
"""Object store reads: p2pw's parallel ranged GETs against one single-stream GET per object, same server, same run.

    python bench/s3.py [--size 256MiB] [--shards 8] [--repeat 3] [--stream-cap 0,50]
                       [--s3-concurrency 16] [--s3-range-size 8MiB]

A synthetic sharded checkpoint is uploaded to a moto S3 server started here
(``moto_server``, its own process, objects kept in memory), then read into a
preallocated blob buffer three ways, alternating so all see the same machine:

- ``single``: one GET per object, in name order, each body streamed with
  ``readinto`` straight into the buffer (boto3, one connection): what a
  program that fetches the objects itself does.
- ``ranged``: ``S3Source.read_into`` over the whole blob: ``--s3-concurrency``
  ranged GETs of ``--s3-range-size`` in flight (what ``p2pw seed s3://`` reads with).
- ``seed-scan``: ``S3Checkpoint.build`` into the store buffer, exactly what
  ``p2pw seed s3://`` does before serving (ranged reads plus chunk hashing
  and the tensor index).

``--stream-cap MB/s`` puts a TCP proxy in front of the server that paces each
connection to that rate, as a real object store caps each connection (S3:
tens of MB/s to about 100 MB/s per stream) while the aggregate scales with
connections; 0 means no proxy.  Loopback moto has no per-stream limit and is
itself the bottleneck (it is Python, and it reads a whole object for every
ranged GET), so the uncapped ratio shows p2pw's overhead, the capped one the
lever.  Prints GB/s per mode and the median ratios.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from p2pweights.cli import human, size  # noqa: E402

CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, int]:
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    p = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL,
                         env=dict(os.environ, **CREDS, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(8 << 30)))
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p, port
        except OSError:
            if p.poll() is not None:
                break
            time.sleep(0.1)
    p.kill()
    raise SystemExit("bench/s3.py: moto_server did not start (pip install 'moto[server]')")


class CappedProxy:
    """A TCP proxy that paces every connection's server-to-client bytes to ``rate`` bytes/s."""

    def __init__(self, upstream: int, rate: float):
        self.upstream, self.rate = upstream, rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server, 0), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(src, dst, rate):
        buf = memoryview(bytearray(64 << 10))
        start, sent = time.monotonic(), 0
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(buf[:n])
                sent += n
                if rate:
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
                    elif ahead < -0.05:  # idle between requests does not bank credit
                        start, sent = time.monotonic(), 0
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self):
        self.sock.close()


def single_stream(client, bucket: str, objects, files, buffer) -> int:
    """One GET per object, in order, each body read straight into its place in ``buffer``."""
    view, n = memoryview(buffer), 0
    offsets = {f["name"]: f["offset"] for f in files}
    for name, key, size_, _ in objects:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        lo, done = offsets[name], 0
        while done < size_:
            k = body.readinto(view[lo + done: lo + size_])
            if not k:
                raise RuntimeError(f"{key}: short body")
            done += k
        n += done
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size, default=256 << 20, help="checkpoint size (default 256MiB)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stream-cap", default="0,50", help="per-connection MB/s caps to run (0: no proxy)")
    ap.add_argument("--s3-concurrency", type=int, default=16)
    ap.add_argument("--s3-range-size", type=size, default=8 << 20)
    args = ap.parse_args(argv)
    os.environ.update(CREDS, AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)

    import boto3
    import botocore.config

    from p2pweights.sources.objstore import S3Checkpoint
    from p2pweights.storage.store import host_buffer
    from p2pweights.sources.synth import write_synthetic_model

    moto, port = start_moto()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_synthetic_model(tmp, size_mb=args.size / (1 << 20), shards=args.shards)
            up = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
            up.create_bucket(Bucket="bench")
            for name in sorted(os.listdir(tmp)):
                up.upload_file(os.path.join(tmp, name), "bench", "model/" + name)
        url = "s3://bench/model"
        print(f"bench/s3.py: {args.shards} shards on moto at 127.0.0.1:{port}; ranged: "
              f"{args.s3_concurrency} GETs of {human(args.s3_range_size)} in flight", flush=True)
        for cap in [float(c) for c in args.stream_cap.split(",")]:
            proxy = CappedProxy(port, cap * 1e6) if cap else None
            os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port if proxy else port}"
            ckpt = S3Checkpoint(url, args.s3_concurrency, args.s3_range_size)
            total, nbytes = ckpt.total, sum(f["size"] for f in ckpt.files)
            objects = [(f["name"], ckpt.keys[f["name"]], f["size"], f["etag"]) for f in ckpt.files]
            one = boto3.client("s3", config=botocore.config.Config(max_pool_connections=1))
            buffer = host_buffer(total)
            memoryview(buffer)[:] = b"\1" * total  # touched: page faults out of every timing
            rates: dict[str, list[float]] = {"single": [], "ranged": [], "seed-scan": []}
            for _ in range(args.repeat):
                t = time.perf_counter()
                assert single_stream(one, "bench", objects, ckpt.files, buffer) == nbytes
                rates["single"].append(nbytes / (time.perf_counter() - t) / 1e9)
                source = ckpt.source()
                t = time.perf_counter()
                source.read_into(0, memoryview(buffer)[:total])
                rates["ranged"].append(nbytes / (time.perf_counter() - t) / 1e9)
                source.close()
                t = time.perf_counter()
                m, n, _ = ckpt.build(4 << 20, into=lambda _: buffer)
                assert n and m.total_size == total
                rates["seed-scan"].append(nbytes / (time.perf_counter() - t) / 1e9)
            med = {k: statistics.median(v) for k, v in rates.items()}
            label = f"per-stream cap {cap:g} MB/s" if cap else "no per-stream cap"
            print(f"{human(nbytes)}, {label}: " + ", ".join(
                f"{k} {med[k]:.3f} GB/s ({' '.join(f'{x:.3f}' for x in v)})" for k, v in rates.items()))
            print(f"  ranged / single = {med['ranged'] / med['single']:.2f}x, "
                  f"seed-scan / single = {med['seed-scan'] / med['single']:.2f}x", flush=True)
            if proxy:
                proxy.close()
    finally:
        moto.terminate()
        moto.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
