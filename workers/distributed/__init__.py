"""Tensor parallelism across processes: the other ranks as Ray actors and
the compact per-step inputs rank 0 broadcasts to them."""
