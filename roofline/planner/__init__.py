"""Capacity planner (`roofline plan`): the seeds' serving cost model as a tool.

From a model's shape, a GPU's memory/bandwidth/FLOP/s and a workload (context, batch) it predicts
KV-pool size, concurrent-sequence capacity (naive vs paged), decode step time and throughput,
arithmetic intensity vs the ridge point, the saturation batch and prefill time; `--measure`
checks the prediction against the engine on the running machine.
"""

from roofline.planner.cost_model import Plan, PlanInputs, decode_at, make_plan, prefill, saturation_batch
from roofline.planner.hardware import GPU_PRESETS, HardwareSpec, get_hardware
from roofline.planner.model_specs import MODEL_PRESETS, ModelSpec, load_model_spec

__all__ = [
    "GPU_PRESETS", "HardwareSpec", "MODEL_PRESETS", "ModelSpec", "Plan", "PlanInputs", "decode_at",
    "get_hardware", "load_model_spec", "make_plan", "prefill", "saturation_batch",
]
