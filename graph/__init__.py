"""graph/: CUDA graph capture and replay from the input registry, the eager path, the
capture-size policy and the attention-metadata protocol backends implement.

This layer knows no model (it runs a forward callable) and imports nothing from dp_runtime.
"""

from graph.attention_protocol import AttentionMetadataBackend
from graph.capture_record import CaptureRecord
from graph.capture_sizes import bucket_for, capture_sizes, default_capture_sizes
from graph.eager_runner import EagerRunner, next_power_of_two
from graph.forward_mode import ForwardMode
from graph.graph_runner import GraphRunner
from graph.piecewise_runner import AttentionSplit, PiecewiseRunner
from graph.runner_batch import RunnerBatch
from graph.step_plan_view import StepPlanView, padding_name

__all__ = [
    "AttentionMetadataBackend",
    "AttentionSplit",
    "CaptureRecord",
    "EagerRunner",
    "ForwardMode",
    "GraphRunner",
    "PiecewiseRunner",
    "RunnerBatch",
    "StepPlanView",
    "bucket_for",
    "capture_sizes",
    "default_capture_sizes",
    "next_power_of_two",
    "padding_name",
]
