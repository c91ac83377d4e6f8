"""One module per attention backend: torch_sdpa (the reference), cpu_kernel,
triton_attn and flash_attn, each with its metadata, builder and impl behind
abstract.AttentionBackend; varlen holds what the last two share. The
selector (../selector.py) picks one."""
