"""What runs the ranks behind LLMEngine: UniProcExecutor (one rank, in this
process) or RayExecutor (tensor parallelism: ranks 1..K-1 as Ray actors),
both meeting the Executor protocol (abstract.py)."""
