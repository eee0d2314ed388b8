"""Device: verified chunks into one torch buffer on the loading device, and tensors as views of it.

Imported only when ``join(..., device=...)`` asks for a device (importing torch
costs seconds; seeders and relays never pay it).

- ``HostSink`` (``device="cpu"``): the store's host buffer *is* the device
  buffer (``torch.frombuffer``, no copy), so a chunk is usable the moment it is
  verified; the sink only records when.
- ``CudaSink`` (``device="cuda:N"``): one device buffer for the whole blob.  A
  worker thread (so the network loop never waits on PCIe) copies each verified
  chunk into one of a small ring of reused pinned staging buffers, then issues
  the host-to-device copy on a side stream and records one event per chunk.
  A staging buffer is reused only after its previous copy's event completed.
  Waiters make the caller's current stream wait on the chunk events, so a
  tensor is usable in stream order without a host sync.
- ``Loader``: the tensor index over either sink: ``wait_tensor``,
  ``iter_tensors``, ``state_dict`` and the stage report.  A tensor whose
  offset is not a multiple of its element size cannot be a view: it is copied
  once, and counted.
"""
from __future__ import annotations

import difflib
import math
import queue
import threading
import time

import numpy as np
import torch

from ..errors import P2PError
from .store import ANY_CHUNK, StoreClosed

# safetensors dtype -> torch dtype attribute (those this torch has)
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
STAGING_SLOTS = 4
GB = 1e9


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``; P2PError if this torch has none."""
    attr = TORCH_DTYPES.get(name)
    if attr is None or not hasattr(torch, attr):
        raise P2PError(f"dtype {name} has no torch {torch.__version__} equivalent; read its bytes with wait_range")
    return getattr(torch, attr)


def parse_device(device: str) -> torch.device:
    """``device`` as a torch device this process can load to; P2PError otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise P2PError(f"device {device!r} is not supported: use 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise P2PError(f"device {device!r} asked for, but this torch has no usable CUDA")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise P2PError(f"device {device!r}: this host has {torch.cuda.device_count()} CUDA devices")
    return dev


class TensorNotFound(KeyError):
    """``wait_tensor`` of a name the manifest's tensor index does not hold."""

    def __str__(self):
        return self.args[0]


class HostSink:
    """CPU: the store's host buffer is the destination; records when each chunk became usable."""

    def __init__(self, store):
        self.store = store
        self.device = torch.device("cpu")
        size = store.manifest.total_size
        self.buffer = torch.frombuffer(store.buffer, dtype=torch.uint8, count=size) if size else \
            torch.empty(0, dtype=torch.uint8)
        self.landed_at = np.full(store.manifest.n_chunks, np.nan)
        self.stage_host = self.h2d = 0.0

    def put(self, index: int, data) -> None:
        self.landed_at[index] = time.monotonic()

    def usable(self) -> np.ndarray:
        return np.frombuffer(self.store.have, dtype=bool)  # a view: verified in place == usable

    def wait_chunks(self, indices, timeout) -> bool:
        return True  # verified in place == usable

    def wait_progress(self, seen: int, timeout: float | None) -> None:
        """Block until more chunks are usable than ``seen`` (or ``timeout``)."""
        with self.store.cond:
            if self.store.count == seen and not self.store.error:
                self.store.sleep_until(ANY_CHUNK, timeout if timeout is not None else 1.0)

    def close(self) -> None:
        pass


class CudaSink:
    """CUDA: pinned staging ring + side stream + one event per chunk into one device buffer."""

    def __init__(self, store, device: str, on_error=None, slots: int = STAGING_SLOTS):
        m = store.manifest
        self.store, self.on_error = store, on_error
        self.device = torch.device(device)
        self.buffer = torch.empty(m.total_size, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.slots = [torch.empty(m.chunk_size, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.in_slot: list = [None] * slots  # (chunk index, start event, end event) still in flight
        self.events: list = [None] * m.n_chunks  # end event of each chunk's copy until it is seen complete
        self.queued = np.zeros(m.n_chunks, dtype=bool)
        self.n_queued = 0
        self.landed_at = np.full(m.n_chunks, np.nan)
        self.stage_host = self.h2d = 0.0
        self.error: str | None = None
        self.cond = threading.Condition()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="p2pw-h2d", daemon=True)
        self.thread.start()

    def put(self, index: int, data) -> None:
        """Queue verified chunk ``index`` for the device (called on the network loop: returns at once)."""
        self.queue.put((index, data))

    def _run(self) -> None:
        try:
            with torch.cuda.device(self.device):
                self._copy_loop()
        except Exception as e:  # a CUDA error: fail the download loudly
            self.error = f"copy to {self.device} failed: {e!r}"
            with self.cond:
                self.cond.notify_all()
            if self.on_error:
                self.on_error(self.error)

    def _copy_loop(self) -> None:
        k = 0
        while True:
            busy = any(s is not None for s in self.in_slot)
            try:
                item = self.queue.get(timeout=0.002) if busy else self.queue.get()
            except queue.Empty:
                for s in range(len(self.slots)):  # idle: notice copies that finished
                    if self.in_slot[s] is not None and self.in_slot[s][2].query():
                        self._retire(s)
                continue
            if item is None:
                for s in range(len(self.slots)):
                    self._retire(s)
                return
            index, data = item
            s, k = k % len(self.slots), k + 1
            self._retire(s)  # its previous copy must be done before we overwrite the staging bytes
            lo, hi = self.store.manifest.chunk_span(index)
            t0 = time.perf_counter()
            self.slots[s][: hi - lo].copy_(torch.frombuffer(data, dtype=torch.uint8))
            self.stage_host += time.perf_counter() - t0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record(self.stream)
                self.buffer[lo:hi].copy_(self.slots[s][: hi - lo], non_blocking=True)
                end.record(self.stream)
            self.in_slot[s] = (index, start, end)
            with self.cond:
                self.events[index] = end
                self.queued[index] = True
                self.n_queued += 1
                self.cond.notify_all()

    def _retire(self, s: int) -> None:
        if self.in_slot[s] is None:
            return
        index, start, end = self.in_slot[s]
        end.synchronize()
        self.h2d += start.elapsed_time(end) / 1e3
        self.landed_at[index] = time.monotonic()
        self.events[index] = None
        self.in_slot[s] = None

    def usable(self) -> np.ndarray:
        return self.queued

    def wait_chunks(self, indices, timeout) -> bool:
        """Wait until the copies of ``indices`` are issued, then order the caller's stream after them."""
        indices = list(indices)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not all(self.queued[i] for i in indices):
                if self.error or self.store.error:
                    raise P2PError(self.error or self.store.error)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(min(left, 0.1) if left is not None else 0.1)
            events = {id(ev): ev for ev in (self.events[i] for i in indices) if ev is not None}
        current = torch.cuda.current_stream(self.device)
        for ev in events.values():
            current.wait_event(ev)
        return True

    def wait_progress(self, seen: int, timeout: float | None) -> None:
        with self.cond:
            if self.n_queued == seen and not self.error:
                self.cond.wait(timeout if timeout is not None else 1.0)

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(10)


def timed(fn, into: list):
    """``fn`` that adds the seconds each call took to ``into[0]``."""
    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            into[0] += time.perf_counter() - t0
    return wrapper


class Loader:
    """Tensors of a download on ``device``, usable as soon as their chunks are."""

    def __init__(self, node, store, device: str, started: float):
        self.store, self.manifest, self.started = store, store.manifest, started
        dev = parse_device(device)
        self.sink = CudaSink(store, str(dev), on_error=node.fail) if dev.type == "cuda" else HostSink(store)
        store.sinks.append(self.sink)
        self.verify = [0.0]
        node.digest = timed(node.digest, self.verify)
        self.index = {t["name"]: t for t in self.manifest.tensors}
        self.views: dict[str, torch.Tensor] = {}
        self.copies = self.copied_bytes = 0
        self.lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.sink.device

    def _chunks(self, t: dict) -> range:
        return self.manifest.chunks_covering(t["offset"], t["offset"] + t["nbytes"])

    def wait_chunks(self, chunks, timeout: float | None) -> bool:
        """Wait for chunks to be verified and on the device; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if not self.store.wait_chunks(chunks, timeout):
                return False
        except StoreClosed as e:
            raise P2PError(str(e)) from None
        return self.sink.wait_chunks(chunks, None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _entry(self, name: str) -> dict:
        t = self.index.get(name)
        if t is None:
            near = difflib.get_close_matches(name, self.index, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TensorNotFound(f"no tensor {name!r} in model {self.manifest.model_id[:16]} "
                                 f"({len(self.index)} tensors){hint}")
        return t

    def place(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s place in the device buffer, now: a view whose bytes are valid once
        ``wait_tensor(name)`` returned (an unaligned tensor, which cannot be a view, raises P2PError)."""
        t = self._entry(name)
        if t["offset"] % torch_dtype(t["dtype"]).itemsize:
            raise P2PError(f"tensor {name!r} starts at an unaligned offset: it has no place to view before it "
                           f"arrives (use wait_tensor, or p2pw pack the checkpoint)")
        return self._view(t)

    def wait_tensor(self, name: str, timeout: float | None = None) -> torch.Tensor:
        """Tensor ``name`` as a view into the device buffer, once all of its bytes are there."""
        t = self._entry(name)
        chunks = self._chunks(t)
        if not self.wait_chunks(chunks, timeout):
            have = sum(self.store.have[chunks.start:chunks.stop])
            got = sum(min(hi, t["offset"] + t["nbytes"]) - max(lo, t["offset"])
                      for lo, hi in (self.manifest.chunk_span(i) for i in chunks if self.store.have[i]))
            raise TimeoutError(f"tensor {name!r} ({t['dtype']}{t['shape']}, {t['nbytes']} bytes) not on "
                               f"{self.device} after {timeout} s: {got} of {t['nbytes']} bytes arrived "
                               f"({have} of {len(chunks)} chunks verified)")
        return self._view(t)

    def _view(self, t: dict) -> torch.Tensor:
        with self.lock:
            view = self.views.get(t["name"])
            if view is None:
                dtype = torch_dtype(t["dtype"])
                raw = self.sink.buffer[t["offset"]:t["offset"] + t["nbytes"]]
                if t["offset"] % dtype.itemsize:  # an unaligned safetensors offset: a view is impossible
                    raw = raw.clone()
                    self.copies += 1
                    self.copied_bytes += t["nbytes"]
                view = self.views[t["name"]] = raw.view(dtype).view(t["shape"])
            return view

    def iter_tensors(self, timeout: float | None = None):
        """Yield ``(name, tensor)`` as tensors become usable, in that order; ``timeout`` bounds each wait."""
        pending = sorted(self.index.values(), key=lambda t: t["offset"])
        c = self.manifest.chunk_size
        first = np.array([t["offset"] // c for t in pending], dtype=np.int64)
        last = np.array([(t["offset"] + t["nbytes"] - 1) // c if t["nbytes"] else t["offset"] // c - 1
                         for t in pending], dtype=np.int64)
        alive = np.ones(len(pending), dtype=bool)
        while alive.any():
            usable = self.sink.usable()
            seen = int(usable.sum())
            cum = np.concatenate([[0], np.cumsum(usable, dtype=np.int64)])
            ready = alive & (cum[last + 1] - cum[np.maximum(first, 0)] == last + 1 - first)
            if not ready.any():
                if self.store.error:
                    raise P2PError(self.store.error)
                t0 = time.monotonic()
                self.sink.wait_progress(seen, timeout)
                if timeout is not None and time.monotonic() - t0 >= timeout and int(self.sink.usable().sum()) == seen:
                    t = pending[int(np.flatnonzero(alive)[0])]
                    self.wait_tensor(t["name"], 0)  # raises the timeout error that names it
                continue
            for i in np.flatnonzero(ready):
                alive[i] = False
                yield pending[i]["name"], self.wait_tensor(pending[i]["name"])

    def state_dict(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """Every tensor (views, in index order) once the whole blob is on the device."""
        if not self.wait_chunks(range(self.manifest.n_chunks), timeout):
            raise TimeoutError(f"state_dict not complete after {timeout} s: {self.store.count} of "
                               f"{self.manifest.n_chunks} chunks verified")
        return {name: self._view(t) for name, t in self.index.items()}

    def report(self) -> dict:
        """Stage spans: seconds and GB/s for fetch, verify, stage_host, h2d; when tensors became usable."""
        m, total = self.manifest, self.manifest.total_size
        done = self.store.done_at or time.monotonic()
        usable_at = []
        for t in self.index.values():
            chunks = self._chunks(t)
            times = self.sink.landed_at[chunks.start:chunks.stop]
            usable_at.append(float(times.max()) if len(times) else self.started)
        usable_at = [u for u in usable_at if not math.isnan(u)]

        def span(seconds: float, nbytes: int = total) -> dict:
            return {"seconds": round(seconds, 6), "GBps": round(nbytes / seconds / GB, 3) if seconds > 0 else None}

        return {
            "device": str(self.device), "bytes": total, "chunks": m.n_chunks, "tensors": len(self.index),
            "fetch": span(done - self.started), "verify": span(self.verify[0]),
            "stage_host": span(self.sink.stage_host), "h2d": span(self.sink.h2d),
            "first_tensor_usable_s": round(min(usable_at) - self.started, 6) if usable_at else None,
            "last_tensor_usable_s": round(max(usable_at) - self.started, 6) if len(usable_at) == len(self.index)
            else None,
            "unaligned_copies": self.copies, "copied_bytes": self.copied_bytes,
        }

    def close(self) -> None:
        self.sink.close()


def format_report(r: dict) -> str:
    """The stage report as a few aligned lines."""
    lines = [f"load to {r['device']}: {r['bytes'] / GB:.3f} GB, {r['chunks']} chunks, {r['tensors']} tensors"]
    for stage in ("fetch", "verify", "stage_host", "h2d"):
        s = r[stage]
        rate = f"{s['GBps']:8.2f} GB/s" if s["GBps"] else "       -  (no such stage on this device)"
        lines.append(f"  {stage:<11}{s['seconds']:9.3f} s {rate}")
    for key, label in (("first_tensor_usable_s", "first tensor usable"), ("last_tensor_usable_s", "last tensor usable")):
        v = r[key]
        lines.append(f"  {label:<20} at {v:.3f} s" if v is not None else f"  {label:<20} -")
    lines.append(f"  unaligned tensors copied: {r['unaligned_copies']} ({r['copied_bytes']} bytes)")
    return "\n".join(lines)
