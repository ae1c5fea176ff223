"""Graph rewrites over a lowered plan: the fused MLP (mlp.py) and Winograd convolutions
(winograd.py); luisaml/compiler.py runs them before the schedule."""
