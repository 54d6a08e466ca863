"""METP: weight-ring MLP (Alg. 1-2), ring attention inner loop (Alg. 3-4), two-level MHA (Alg. 5-6)."""
