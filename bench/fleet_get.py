"""Fleet get on loopback: N hosts take a model from an S3 server, each client's reads capped.

Compares, same model, same cap per client (each host its own throttling proxy in front of
``moto_server``, the real S3 API server the tests use):

  (a) seeder: ``p2pw seed s3://... --manifest M`` reads the bucket alone; N - 1 hosts ``p2pw join`` it;
  (b) fleet:  ``p2pw tracker``; N hosts ``p2pw get s3://... --tracker``, every one an origin reader.

Reports time to the last exit, origin bytes read in all (over the model's size), and the bound
S / (N x cap) that reading in parallel can reach (loopback's links are not the limit here).  Not the
issue's bed (network namespaces, htb per destination); a loopback stand-in for it.

    python bench/fleet_get.py --hosts 4 --size-mb 64 --cap-mbs 16 [--json OUT]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
         "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Throttle:
    """An HTTP proxy to ``upstream`` sending response bodies at most ``rate`` bytes/s in all (one S3 client)."""

    def __init__(self, upstream: int, rate: float):
        lock, state = threading.Lock(), {"free_at": 0.0}

        def wait(n: int) -> None:
            with lock:
                start = max(time.monotonic(), state["free_at"])
                state["free_at"] = start + n / rate
            time.sleep(max(0.0, start + n / rate - time.monotonic()))

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                up = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
                up.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                r = up.getresponse()
                data = r.read()
                up.close()
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else
                                                       r.getheader("Content-Length") or 0))
                self.end_headers()
                if self.command != "HEAD":
                    for i in range(0, len(data), 256 << 10):
                        wait(len(data[i:i + (256 << 10)]))
                        self.wfile.write(data[i:i + (256 << 10)])

            do_GET = do_HEAD = do_PUT = do_POST = do_any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def p2pw(*args, env=None, log=None):
    return subprocess.Popen([sys.executable, "-m", "p2pweights", *map(str, args)], env=dict(os.environ, **(env or {})),
                            stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_file(path: str, procs, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{path} never appeared")
        time.sleep(0.05)
    return json.loads(open(path).read())


def finish(procs, started: float, timeout: float = 600) -> float:
    for p in procs:
        if p.wait(timeout) != 0:
            raise RuntimeError(f"a host exited {p.returncode}")
    return time.monotonic() - started


def run_seeder(work, url, manifest, n, proxies, moto_env):
    seed_env = {**moto_env, "AWS_ENDPOINT_URL": proxies[0].url}
    seeder = p2pw("seed", url, "--manifest", manifest, "--host", "127.0.0.1", "--port", 0, "--ready",
                  f"{work}/a.ready", "--report", f"{work}/a-seed.json", "--exit-after", n - 1, env=seed_env)
    info = wait_file(f"{work}/a.ready", [seeder])
    t0 = time.monotonic()
    joins = [p2pw("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "--model-id",
                  info["model_id"], "--out", f"{work}/a{k}", "-q") for k in range(n - 1)]
    took = finish(joins, t0)
    seeder.wait(60)
    return took, json.load(open(f"{work}/a-seed.json"))["bytes_read"]


def run_fleet(work, url, manifest, n, proxies, moto_env):
    tracker = p2pw("tracker", "--host", "127.0.0.1", "--port", 0, "--ready", f"{work}/t.ready")
    try:
        port = wait_file(f"{work}/t.ready", [tracker])["port"]
        t0 = time.monotonic()
        gets = [p2pw("get", url, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--out", f"{work}/b{k}",
                     "-q", "--report", f"{work}/b{k}.json", *(["--manifest", manifest] if k == 0 else []),
                     "--s3-range-size", "1MiB", env={**moto_env, "AWS_ENDPOINT_URL": proxies[k].url})
                for k in range(n)]
        took = finish(gets, t0)
        read = sum(json.load(open(f"{work}/b{k}.json"))["origin_bytes_read"] for k in range(n))
        return took, read
    finally:
        tracker.terminate()
        tracker.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--size-mb", type=float, default=64)
    ap.add_argument("--cap-mbs", type=float, default=16, help="each client's S3 read rate, MB/s")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    import boto3

    from p2pweights.sources.synth import write_synthetic_model

    work = tempfile.mkdtemp(prefix="p2pw-fleet-get-")
    os.environ["P2PW_CACHE_DIR"] = f"{work}/cache"
    port = free_port()
    moto = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, **CREDS))
    proxies = []
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(0.1)
        moto_env = {**CREDS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        write_synthetic_model(f"{work}/model", size_mb=args.size_mb, shards=4)
        s3 = boto3.client("s3", endpoint_url=moto_env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
        s3.create_bucket(Bucket="bench")
        size = 0
        for name in sorted(os.listdir(f"{work}/model")):
            s3.upload_file(f"{work}/model/{name}", "bench", f"model/{name}")
            size += os.path.getsize(f"{work}/model/{name}")
        url = "s3://bench/model"
        subprocess.run([sys.executable, "-m", "p2pweights", "manifest", url, "-o", f"{work}/m.json"], check=True,
                       env=dict(os.environ, **moto_env), stdout=subprocess.DEVNULL)
        proxies = [Throttle(port, args.cap_mbs * 1e6) for _ in range(args.hosts)]
        bound = size / (args.hosts * args.cap_mbs * 1e6)
        rows = []
        for run in range(args.runs):
            for name, fn in (("seeder", run_seeder), ("fleet", run_fleet)):
                d = f"{work}/{name}{run}"
                os.makedirs(d)
                took, read = fn(d, url, f"{work}/m.json", args.hosts, proxies, moto_env)
                rows.append({"mode": name, "seconds": round(took, 3), "origin_read_x": round(read / size, 3),
                             "over_bound": round(took / bound, 2)})
                print(f"{name:7s} N={args.hosts} {size / 1e6:.0f} MB cap {args.cap_mbs:g} MB/s/client: "
                      f"{took:6.2f} s, origin read {read / size:.3f} x the model, {took / bound:.2f} x "
                      f"S/(N cap) = {bound:.2f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"hosts": args.hosts, "bytes": size, "cap_mbs": args.cap_mbs, "rows": rows}, f, indent=1)
    finally:
        for p in proxies:
            p.close()
        moto.terminate()
        moto.wait(10)


if __name__ == "__main__":
    main()
