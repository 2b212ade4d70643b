"""Custom ops of Kiln (`torch.ops.kiln.*`).

Each op has a plain-torch reference (CPU, and the ground truth in tests), a fake (meta)
implementation for tracing, and, for fused ops on CUDA, a Triton implementation.
Importing this package registers every op.

The Triton implementations live in `kiln.kernels.triton_*` and register themselves for
the CUDA dispatch key when imported. They are imported here only when a CUDA GPU and the
`triton` package are both present, so CPU-only machines need neither; tests that run the
Triton kernels on CPU (`TRITON_INTERPRET=1`) import those modules themselves, because the
interpreter must be switched on before the kernels are defined.
"""

if __name__ == "kernels":
    # This folder was imported as the top-level package `kernels`, not as `kiln.kernels`: the
    # repository root was on sys.path ahead of site-packages (`python -m ...` or `python -c ...`
    # run from the checkout puts the working directory first). That name is Hugging Face's
    # `kernels` package, which transformers (>= 5.25 depends on it) imports while it builds a
    # model. Hand the import over to that package, found as if this folder were not on the
    # path. Where it is not installed this module stays empty: transformers (which then finds
    # it by name) reads no version off it and leaves it alone.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _sys.modules["kernels"] = _module = _util.module_from_spec(_spec)  # the import returns this one
        _spec.loader.exec_module(_module)
else:
    import logging

    import torch

    from kiln.kernels import activation as activation  # noqa: F401  (kiln::silu_and_mul, kiln::gelu_tanh_and_mul)
    from kiln.kernels import attention as attention  # noqa: F401  (registers kiln::attention)
    from kiln.kernels import fp8 as fp8  # noqa: F401  (kiln::quantize_fp8_per_token, kiln::fp8_linear)
    from kiln.kernels import fp8_fused_linear as fp8_fused_linear  # noqa: F401  (kiln::*_fp8_linear)
    from kiln.kernels import gated_delta_net as gated_delta_net  # noqa: F401  (kiln::*gated_delta_net)
    from kiln.kernels import mamba as mamba  # noqa: F401  (kiln::selective_scan, kiln::paged_selective_scan)
    from kiln.kernels import mamba2 as mamba2  # noqa: F401  (kiln::mamba2_scan, kiln::paged_mamba2_scan)
    from kiln.kernels import short_conv as short_conv  # noqa: F401  (kiln::short_conv, kiln::paged_short_conv)
    from kiln.kernels import collectives as collectives  # noqa: F401  (kiln::all_reduce, kiln::all_gather)
    from kiln.kernels import layer_norm as layer_norm  # noqa: F401  (registers kiln::add_layer_norm)
    from kiln.kernels import linear as linear  # noqa: F401  (registers kiln::linear)
    from kiln.kernels import moe as moe  # noqa: F401  (registers kiln::fused_moe)
    from kiln.kernels import paged_attention as paged_attention  # noqa: F401
    from kiln.kernels import rms_norm as rms_norm  # noqa: F401  (kiln::rms_norm, kiln::add_rms_norm)
    from kiln.kernels import rope as rope  # noqa: F401  (registers kiln::rope)
    from kiln.kernels import rope_paged_attention as rope_paged_attention  # noqa: F401

    logger = logging.getLogger("kiln.kernels")

    TRITON_KERNEL_MODULES = ("triton_norm", "triton_rope", "triton_activation", "triton_paged_attention",
                             "triton_linear", "triton_moe", "triton_fp8", "triton_fp8_fused_linear",
                             "triton_causal_conv", "triton_gated_delta_net", "triton_mamba2", "triton_mamba",
                             "triton_shared_expert_gate")


    def triton_kernels_available() -> bool:
        """True when the CUDA implementations of Kiln's ops are registered (GPU + Triton)."""
        return _TRITON_REGISTERED


    def _register_triton_kernels() -> bool:
        if not torch.cuda.is_available():
            return False
        import importlib

        try:
            import triton  # noqa: F401
        except ImportError:
            logger.warning("CUDA is available but the `triton` package is not: Kiln's fused ops fall back "
                           "to their plain-torch references (pip install triton)")
            return False
        for name in TRITON_KERNEL_MODULES:
            importlib.import_module(f"kiln.kernels.{name}")
        return True


    _TRITON_REGISTERED = _register_triton_kernels()

    __all__ = ["activation", "attention", "collectives", "fp8", "fp8_fused_linear", "layer_norm", "linear", "moe", "paged_attention", "rms_norm", "rope",
               "rope_paged_attention",
               "triton_kernels_available"]
