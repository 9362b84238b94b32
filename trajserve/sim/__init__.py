"""Simulator: the real Scheduler, KVCacheManager and radix cache driven by a
roofline cost model on a virtual clock (DESIGN.md: "Executor.execute(batch):
ModelRunner | CostModelRunner").

One file per job: hardware (device + model numbers from the plan catalog or a
calibrated profile), cost_model (step time), executor (CostModelRunner),
tokens (synthetic token ids for workloads without text), workload (sessions
and calls), synthetic (agent / chat workloads), trace_workloads (Mooncake,
Claude Code), simulator (the event loop), build (one simulation's control
plane), metrics, plot, sweep (hit rate vs cache size), fit + calibrate
(hardware profile from the real engine), validate (predicted vs measured),
cli (arguments) and report (`simulate`'s table). docs/simulate.md.
"""
from trajserve.sim.cost_model import CostModel, StepCost
from trajserve.sim.executor import CostModelRunner
from trajserve.sim.hardware import Hardware, ModelCost

__all__ = ["CostModel", "CostModelRunner", "Hardware", "ModelCost", "StepCost"]
