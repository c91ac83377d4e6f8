"""What runs on one kind of hardware (vLLM's platforms/): the compiled
kernels, their loader and build, and a platform's own fast paths, reached
from the layers and the model runner through named seams (interface.py).

cpu/: the compiled CPU kernels (csrc/), the layers' bindings to them and
the one-call decode step. On CUDA the layers call Triton and torch
directly, and a CUDA graph replays a decode step (runner/cuda_graph.py).
"""
