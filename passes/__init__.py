"""Kiln's graph passes: the pass protocol, registry, manager and the built-in passes."""

from kiln.passes.base import GraphPass, KilnPass, PassContext, PassStats, add_graph_input
from kiln.passes.manager import DEFAULT_PIPELINE, PassManager, PassReport, op_counts, verify_graph
from kiln.passes.registry import ENTRY_POINT_GROUP, PHASES, all_pass_factories, create_pass

__all__ = [
    "GraphPass", "KilnPass", "PassContext", "PassStats", "add_graph_input",
    "DEFAULT_PIPELINE", "PassManager", "PassReport", "op_counts", "verify_graph",
    "ENTRY_POINT_GROUP", "PHASES", "all_pass_factories", "create_pass",
]
