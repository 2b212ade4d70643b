"""Model sources, capture into FX, and (with the compile issue) buckets and Inductor compile."""

from kiln.compiler.capture import CapturedModel, UnsupportedArchitectureError, capture
from kiln.compiler.model_source import ModelSource, ModelSourceError, default_model_path, resolve_model

__all__ = [
    "CapturedModel", "UnsupportedArchitectureError", "capture",
    "ModelSource", "ModelSourceError", "default_model_path", "resolve_model",
]
