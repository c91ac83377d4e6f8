"""Building blocks of the models: norms, rotary embeddings, attention over
the paged KV cache, linear layers, fused MoE and quantization."""
