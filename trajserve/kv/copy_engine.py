"""Asynchronous block copies between the device pool and host memory.

Spec: kv-cache-management "异步分页换入换出": swaps go to a copy engine that
runs beside the compute (a CUDA copy stream on a GPU; one background thread
here), so a step never waits for a transfer it does not need, and a reload
is pipelined with the prefill that needs it:

    save   device blocks -> a host tensor. The blocks stay allocated (their
           path is pinned) until the copy has landed; the owner then remaps
           them to the host tier and frees the device frames (the spec's
           "callback" that switches TIER_GPU to TIER_HOST).
    load   a host tensor -> device blocks, one layer at a time. A step whose
           batch reads those blocks waits, before each layer's attention,
           for that layer only (wait_layer): layer l's copy overlaps the
           compute of the layers before it, and the prefill of a resumed
           turn's observation hides the reload ("流水线化分块重新加载与观测预填充").

Layer granularity is what makes the overlap real: attention at layer l
needs the old KV of layer l and nothing deeper. Both directions run on one
thread, in submission order, like one bidirectional copy stream.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V pools [num_blocks, H_kv, B, d] (MLA: V is K)
HostBlocks = list[torch.Tensor] | torch.Tensor  # blocks of [layers, 2, H_kv, B, d] (MLA: [layers, 1, 1, B, row])


class LayerPages:
    """Where each layer keeps a block's K and V: at the block's id in its own
    tensors (pages None), or, in a window model's pool (kv/window_pool.py),
    at the block's page for that layer in tensors every layer shares.
    `carried`: the layers every saved block carries, in their order in it (a
    window model's global layers); `window`: a window model's window layers,
    which a saved block carries after those when it had its window part
    (kv/window_parts.py: the points worth resuming from)."""

    def __init__(self, num_layers: int, pages: np.ndarray | None = None, carried: list[int] | None = None) -> None:
        self.pages = pages
        self.carried = list(range(num_layers)) if carried is None else carried
        self.window = [i for i in range(num_layers) if i not in set(self.carried)]

    def index(self, block_ids: list[int], layer: int, device) -> torch.Tensor:
        ids = block_ids if self.pages is None else self.pages[block_ids, layer]
        return torch.as_tensor(ids, dtype=torch.long, device=device)

    def with_window(self, block_ids: list[int]) -> list[bool]:
        """Which of these blocks have their window part now (none outside a window pool)."""
        if not self.window:
            return [False] * len(block_ids)
        return (self.pages[block_ids, self.window[0]] >= 0).tolist()


def gather_blocks(kv_caches: KVCaches, block_ids: list[int], lp: LayerPages | None = None,
                  windows: list[bool] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """KV of these blocks as [n, layers, 2, H_kv, B, d] on the host (the
    layout the host and disk tiers store; a latent attention's pool:
    [n, layers, 1, 1, B, row], its one tensor a layer; a window model's:
    its global layers). windows: which blocks also carry their window part
    (their window layers after the global ones; each must have it): then a
    list of blocks, those longer."""
    lp = lp or LayerPages(len(kv_caches))
    k0 = kv_caches[0][0]
    # Gathered straight into the one output (2.2 -> 3.0 GB/s on a 2-core Xeon
    # for 64 blocks of SmolLM2, against stacking per-layer gathers twice).
    one = kv_caches[0][1] is k0  # a latent attention's pool: one tensor a layer (K and V the same)
    out = _gather(kv_caches, block_ids, lp.carried, lp, one)
    if not windows or not any(windows):
        return out
    with_win = [b for b, w in zip(block_ids, windows) if w]
    win = iter(_gather(kv_caches, with_win, lp.window, lp, one))
    return [torch.cat([g, next(win)]) if w else g for g, w in zip(out, windows)]


def _gather(kv_caches: KVCaches, block_ids: list[int], layers: list[int], lp: LayerPages, one: bool
            ) -> torch.Tensor:
    k0 = kv_caches[0][0]
    out = torch.empty((len(block_ids), len(layers), 1 if one else 2, *k0.shape[1:]), dtype=k0.dtype,
                      device=k0.device)
    for i, layer in enumerate(layers):
        k, v = kv_caches[layer]
        idx = lp.index(block_ids, layer, k0.device)
        out[:, i, 0] = k.index_select(0, idx)
        if not one:
            out[:, i, 1] = v.index_select(0, idx)
    return out.cpu()


def scatter_blocks(kv_caches: KVCaches, block_ids: list[int], data, lp: LayerPages, layers=None) -> None:
    """The inverse of gather_blocks: blocks (a tensor of rows, or a list, some
    carrying their window part) written into these device blocks; layers:
    only these (all)."""
    n, g = len(data), len(lp.carried)
    device = kv_caches[0][0].device
    slot = {layer: i for i, layer in enumerate(lp.carried)} | {layer: g + j for j, layer in enumerate(lp.window)}
    for layer in (range(len(kv_caches)) if layers is None else layers):
        k, v = kv_caches[layer]
        i = slot[layer]
        if isinstance(data, torch.Tensor):  # rows of one shape
            if i >= data.shape[1]:
                continue
            ids, src = block_ids[:n], data[:, i]
        else:
            rows = [r for r in range(n) if data[r].shape[0] > i]  # a window layer: the blocks that carry it
            if not rows:
                continue
            ids, src = [block_ids[r] for r in rows], torch.stack([data[r][i] for r in rows])
        idx = lp.index(ids, layer, device)
        src = src.to(device, non_blocking=True)
        k.index_copy_(0, idx, src[:, 0])
        if v is not k:
            v.index_copy_(0, idx, src[:, 1])


class CopyJob:
    """One transfer. `layers_done` counts layers copied (loads); `data` holds
    a save's host copy [n, layers, 2, H_kv, B, d] once done."""

    def __init__(self, kind: str, block_ids: list[int], num_layers: int) -> None:
        self.kind = kind
        self.block_ids = block_ids
        self.num_layers = num_layers
        self.layers_done = 0
        self.filled = 0  # loads: blocks actually written (a disk read may stop early)
        self.windows: list[bool] = []  # loads: which of those came with their window part
        self.data: torch.Tensor | None = None
        self.nbytes = 0
        self.seconds = 0.0  # copy time on the copy thread
        self.waited_s = 0.0  # time steps spent waiting for this job (a stall)
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    @property
    def done(self) -> bool:
        return self.layers_done >= self.num_layers or self.error is not None

    def wait(self) -> None:
        self.wait_layer(self.num_layers - 1)

    def wait_layer(self, layer: int) -> float:
        """Block until layer `layer` is copied; returns the seconds waited."""
        dt = 0.0
        if self.layers_done <= layer and self.error is None:
            t = time.perf_counter()
            with self._cond:
                self._cond.wait_for(lambda: self.layers_done > layer or self.error is not None)
            dt = time.perf_counter() - t
            self.waited_s += dt
        if self.error is not None:
            raise RuntimeError(f"KV {self.kind} of {len(self.block_ids)} blocks failed") from self.error
        return dt

    def _advance(self, layers: int) -> None:
        with self._cond:
            self.layers_done = layers
            self._cond.notify_all()

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self.error = err
            self._cond.notify_all()


class CopyEngine:
    def __init__(self, kv_caches: KVCaches, lp: LayerPages | None = None) -> None:
        self.kv_caches = kv_caches
        self.lp = lp or LayerPages(len(kv_caches))
        self.device = kv_caches[0][0].device
        # One intra-op thread for copies (the setting is per thread): on a CPU the
        # copy shares cores with the forward, and a second OpenMP team spinning
        # beside the forward's costs more than a memcpy gains from threads.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajserve-kv-copy",
                                          initializer=torch.set_num_threads, initargs=(1,))
        # Device blocks being written by a load: the runner checks a batch against these.
        self.loading: dict[int, CopyJob] = {}
        self.wait_s = 0.0  # total time steps waited for loads (stalls not hidden by compute)

    # ------------------------------------------------------------ submit
    def save(self, block_ids: list[int], windows: list[bool] | None = None) -> CopyJob:
        """Copy device blocks to a host tensor, in the background. The caller
        keeps the blocks allocated and unwritten until job.done; windows:
        which also carry their window part (gather_blocks), which the caller
        holds as long."""
        job = CopyJob("save", list(block_ids), 1)
        self._thread.submit(self._run_save, job, windows)
        return job

    def load(self, block_ids: list[int], data: HostBlocks | Callable[[], HostBlocks | None]) -> CopyJob:
        """Copy host KV into device blocks, layer by layer, in the background.
        `data`: k <= len(block_ids) blocks, each [layers, 2, H_kv, B, d] (a
        list, or a tensor with a leading block axis), or a function run on
        the copy thread first that returns them (a disk read): only the first
        k blocks are written. Nothing may read the blocks before the layer it
        needs is done: the runner waits (layer_barrier)."""
        job = CopyJob("load", list(block_ids), len(self.kv_caches))
        for b in job.block_ids:
            self.loading[b] = job
        self._thread.submit(self._run_load, job, data)
        return job

    def finish(self, job: CopyJob) -> None:
        """Wait for the job and forget it (engine thread; before its blocks
        are freed or handed to anyone who does not wait per layer)."""
        try:
            job.wait()
        finally:
            if job.kind == "load":
                for b in job.block_ids:
                    if self.loading.get(b) is job:
                        del self.loading[b]

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)

    # ----------------------------------------------------------- runner side
    def jobs_for(self, block_ids: list[list[int]]) -> list[CopyJob]:
        """Loads in flight that write any of these blocks (the tables a batch reads)."""
        if not self.loading:
            return []
        jobs: dict[int, CopyJob] = {}
        loading = self.loading
        for table in block_ids:
            for b in table:
                j = loading.get(b)
                if j is not None and not j.done:
                    jobs[id(j)] = j
        return list(jobs.values())

    def layer_barrier(self, jobs: list[CopyJob]) -> Callable[[int], None] | None:
        """The hook a forward calls before layer l's attention."""
        if not jobs:
            return None

        def before_layer(layer: int) -> None:
            for j in jobs:
                self.wait_s += j.wait_layer(layer)
        return before_layer

    # ------------------------------------------------------------ the thread
    def _run_save(self, job: CopyJob, windows: list[bool] | None) -> None:
        try:
            t = time.perf_counter()
            data = gather_blocks(self.kv_caches, job.block_ids, self.lp, windows)
            job.data = data
            job.nbytes = sum(b.nbytes for b in data) if isinstance(data, list) else data.nbytes
            job.seconds = time.perf_counter() - t
            job._advance(1)  # last: a waiter sees data, nbytes and seconds set
        except BaseException as e:  # noqa: BLE001 -- reported to the waiter, never lost on the thread
            job._fail(e)

    def _run_load(self, job: CopyJob, data) -> None:
        try:
            t = time.perf_counter()
            if callable(data):
                data = data()
            n = 0 if data is None else len(data)
            job.filled = n
            job.nbytes = sum(b.numel() * b.element_size() for b in data) if n else 0
            g = len(self.lp.carried)
            job.windows = [data[i].shape[0] > g for i in range(n)]
            for layer in range(len(self.kv_caches)):
                if n:  # gathered per layer: layer 0 is on the device after 1/L of the copy
                    scatter_blocks(self.kv_caches, job.block_ids[:n], data, self.lp, (layer,))
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                job.seconds = time.perf_counter() - t
                job._advance(layer + 1)
        except BaseException as e:  # noqa: BLE001
            job._fail(e)
