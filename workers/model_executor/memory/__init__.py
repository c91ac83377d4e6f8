"""Memory: sizing the KV cache from a profiling forward (memory_profiler.py)
and keeping a CPU step's freed memory for the next step (cpu_memory.py)."""
