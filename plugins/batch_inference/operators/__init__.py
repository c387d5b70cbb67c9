"""The provider's operators: thin shells over the core.

Imported lazily by name, so ``from batch_inference.operators import
SubmitJobOperator`` does not import the Kubernetes provider.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "SubmitJobOperator": "batch_inference.operators.submit",
    "LocalWorkersOperator": "batch_inference.operators.local_workers",
    "GpuWorkerPodOperator": "batch_inference.operators.gpu_pods",
    "gpu_worker_pods": "batch_inference.operators.gpu_pods",
    "GpuAutopilotOperator": "batch_inference.operators.gpu_autopilot",
    "GpuPodLauncher": "batch_inference.operators.gpu_autopilot",
    "gpu_autopilot_workers": "batch_inference.operators.gpu_autopilot",
    "ValidateOperator": "batch_inference.operators.validate",
    "PublishOperator": "batch_inference.operators.publish",
    "RollbackOperator": "batch_inference.operators.publish",
    "dataset_asset": "batch_inference.operators.publish",
    "FallbackPoolOperator": "batch_inference.operators.fallback",
    "ReviewGateOperator": "batch_inference.operators.review",
    "RegionMergeOperator": "batch_inference.operators.regions",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
