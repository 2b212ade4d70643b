"""Model sources, capture into FX, and (with the compile issue) buckets and Inductor compile."""

from kiln.compiler.capture import SUPPORTED_ARCHITECTURES, CapturedModel, UnsupportedArchitectureError, capture
from kiln.compiler.model_source import ModelSource, ModelSourceError, default_model_path, resolve_model

__all__ = [
    "SUPPORTED_ARCHITECTURES", "CapturedModel", "UnsupportedArchitectureError", "capture",
    "ModelSource", "ModelSourceError", "default_model_path", "resolve_model",
]
