"""Graph rewrites over a lowered plan: the fused MLP (mlp.py) and Winograd convolutions
(winograd.py) and recurrent cells as a GEMM and phased steps (rnn.py); luisaml/compiler.py runs them before the schedule."""
