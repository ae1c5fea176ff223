"""Warp-wide reductions for the GPU's warp-per-row stages (operators/rows.py): luisa-python's warp
builtins, re-exported so that a generated module imports them by name (the DSL resolves a call's
name in the module's globals, and these are not in luisa's table of builtin names)."""
from luisa.builtin import warp_active_any, warp_active_max, warp_active_min, warp_active_sum  # noqa: F401
