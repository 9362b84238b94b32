"""Step time of one scheduler step from a roofline cost model.

A step runs every scheduled chunk in one forward: sequence i brings c_i new
tokens (a prefill chunk, or 1 for a decode) after h_i tokens already in the
cache. Per device of a TP replica (inference-optimization 8.2.1, T_step):

    T_step = max(F / (P * MFU), D / (beta * MBU)) + t_fixed + n_seq * t_seq

    F = [2 N_mm sum_i c_i + 2 N_head n_sampled + 4 L d_q sum_i N_pair,i] / TP
    N_pair,i = c_i h_i + c_i (c_i + 1) / 2        (inference-optimization 8.2.3)
    D = D_w / TP + m_token,dev * sum_i (h_i + c_i)     (KV bytes at beta_KV if given)

  * 2 N_mm per new token: every projection and MLP weight multiplies each
    token once (the LM head, N_head = vocab x hidden, only for rows sampled).
  * attention: each of the N_pair causal query-key pairs costs 2 d_q for
    Q K^T and 2 d_q for P V, in each of L layers; the c_i (c_i + 1) / 2
    triangle is prefill's quadratic term, c_i h_i the cached context.
  * weights are streamed once per step, whatever the batch (mixed prefill +
    decode batches share that read); each sequence reads its own KV
    (h_i cached tokens) and writes c_i new ones, with m_token from eq. 1
    (kv-cache-management) split over TP.
  * beta_KV: a calibrated engine whose attention kernel reads KV slower
    than its matmuls stream weights (paged gathers) gets its own rate for
    the KV bytes; catalog GPUs use beta for both.
  * t_fixed: launches, host scheduling and sync, independent of the work
    (the spec's 8.2.2 fit has 26.22 ms of it without CUDA graphs);
    t_seq: per-sequence host work (0 for catalog GPUs, fitted by calibrate).

Weight offload (inference-optimization 8.4.3): offload_bytes of weights per
device live in host memory and cross the host link every step; with two or
more prefetch buffers the copy overlaps the step, with one it adds
(trajserve.plan.weight_offload.step_with_offload, the planner's formula).

Copy-on-write block copies run before the forward, on the device: each reads
and writes one block, 2 x block bytes at beta x MBU. Tier transfers (host
DRAM over the host link, NVMe) take bytes / link bandwidth per device, each
device moving its own KV shard over its own link (as trajserve.plan does).
"""
from __future__ import annotations

from dataclasses import dataclass

from trajserve.plan.flops import causal_pairs
from trajserve.plan.weight_offload import step_with_offload
from trajserve.sim.hardware import Hardware, ModelCost

LINKS = ("host", "nvme")


@dataclass(slots=True)
class StepCost:
    compute_s: float = 0.0
    memory_s: float = 0.0
    overhead_s: float = 0.0
    copy_s: float = 0.0
    flops: float = 0.0       # per device
    bytes: float = 0.0       # per device
    offload_s: float = 0.0   # offloaded weights over the host link
    offload_buffers: int = 2

    @property
    def total_s(self) -> float:
        work = max(self.compute_s, self.memory_s)
        if self.offload_s:
            work = step_with_offload(work, self.offload_s, self.offload_buffers)
        return work + self.overhead_s + self.copy_s

    @property
    def compute_bound(self) -> bool:
        return self.compute_s >= self.memory_s


class CostModel:
    def __init__(self, hw: Hardware, model: ModelCost, offload_bytes: float = 0.0, offload_buffers: int = 2) -> None:
        self.hw, self.model = hw, model
        if offload_bytes and hw.host_link_bandwidth <= 0:
            raise ValueError(f"{hw.name}: weight offload needs the host link's bandwidth (catalog or profile)")
        self.offload_s = offload_bytes / model.tp / hw.host_link_bandwidth if offload_bytes else 0.0
        self.offload_buffers = offload_buffers
        tp = model.tp
        # Seconds per unit of work, per device: the formula above with the
        # constants folded once, so a step costs a few multiply-adds.
        eff = hw.peak_flops * hw.mfu
        att = (hw.attention_flops or hw.peak_flops) * hw.mfu
        self.s_per_token = 2 * model.matmul_params / tp / eff
        self.s_per_sample = 2 * model.head_params / tp / eff
        self.s_per_pair = 4 * model.num_layers * model.q_dim / tp / att
        bw = hw.bandwidth * hw.mbu
        self.s_weights = model.weight_read_bytes / tp / bw
        self.s_per_kv_token = model.m_token_device / ((hw.kv_bandwidth or hw.bandwidth) * hw.mbu)
        self.flops_per_token = 2 * model.matmul_params / tp
        self.flops_per_sample = 2 * model.head_params / tp
        self.flops_per_pair = 4 * model.num_layers * model.q_dim / tp

    def step(self, num_tokens: int, num_pairs: int, kv_tokens: int, num_seqs: int, num_sampled: int,
             num_copies: int = 0, block_size: int = 16) -> StepCost:
        """Aggregates of one step: num_tokens = sum c_i, num_pairs = sum N_pair,i,
        kv_tokens = sum (h_i + c_i), num_seqs sequences, num_sampled rows of logits."""
        if num_seqs == 0:
            return StepCost()
        hw = self.hw
        return StepCost(
            compute_s=num_tokens * self.s_per_token + num_sampled * self.s_per_sample + num_pairs * self.s_per_pair,
            memory_s=self.s_weights + kv_tokens * self.s_per_kv_token,
            overhead_s=hw.fixed_overhead_s + num_seqs * hw.per_seq_overhead_s,
            copy_s=self.copy_time(num_copies, block_size),
            flops=num_tokens * self.flops_per_token + num_sampled * self.flops_per_sample
            + num_pairs * self.flops_per_pair,
            bytes=self.model.weight_read_bytes / self.model.tp + kv_tokens * self.model.m_token_device,
            offload_s=self.offload_s, offload_buffers=self.offload_buffers)

    def step_for(self, chunks: list[tuple[int, int]], num_sampled: int | None = None) -> StepCost:
        """chunks: (c_i new tokens, h_i cached tokens) per sequence; by default
        every sequence samples (the end of its chunk is its last token)."""
        n = sum(c for c, _ in chunks)
        pairs = sum(causal_pairs(c, h) for c, h in chunks)
        kv = sum(c + h for c, h in chunks)
        return self.step(n, pairs, kv, len(chunks), len(chunks) if num_sampled is None else num_sampled)

    def copy_time(self, num_blocks: int, block_size: int) -> float:
        """Copy-on-write: read + write of each block in device memory."""
        if not num_blocks:
            return 0.0
        return 2 * num_blocks * self.model.block_bytes_device(block_size) / (self.hw.bandwidth * self.hw.mbu)

    def transfer_time(self, num_blocks: int, block_size: int, link: str) -> float:
        """Moving KV blocks between tiers over one link, one direction."""
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; allowed: {', '.join(LINKS)}")
        bw = self.hw.host_link_bandwidth if link == "host" else self.hw.nvme_bandwidth
        if bw <= 0:
            raise ValueError(f"{self.hw.name}: {link} bandwidth unknown; set it in the catalog or profile")
        return num_blocks * self.model.block_bytes_device(block_size) / bw
