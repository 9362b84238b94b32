"""Closed-form capacity planning (kv-cache-management section 7, inference-optimization 8.1-8.6).

One file per job: kv_format (eq. 1, KV formats), memory_budget (eqs. 3-5),
concurrency (eqs. 6-7), tail_waste (block size), flops (prefill work),
keep_offload (break-even wait), retention (V_h), batch_config (8.6.3),
catalog (devices and models), planner (all of it for one node), report, plot, cli.
"""
from trajserve.plan.catalog import DeviceSpec, ModelSpec, get_device, get_model
from trajserve.plan.planner import Plan, PlanRequest, plan

__all__ = ["DeviceSpec", "ModelSpec", "Plan", "PlanRequest", "get_device", "get_model", "plan"]
