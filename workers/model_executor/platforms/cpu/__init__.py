"""The CPU platform: the compiled kernels (csrc/, built by kernel_build.py,
loaded by kernels.py), what the layers reach of them (matmul.py's few-row
matmul, gguf_blocks.py's GGUF block kernels; bind.py gives each layer the
library), the one-call decode step (decode_step.py), and which dtype the CPU
multiplies in (precision.py).

The layers import only kernels, matmul and gguf_blocks from here (leaves
that know no layer); the rest reads the layers and the model's decode plan.
"""
