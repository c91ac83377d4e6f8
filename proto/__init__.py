"""The contract between the router's processes and a worker's: everything
that crosses the process boundary, and nothing that needs torch. The
messages (messages.py) and what rides in them (sampling_params.py,
structured_params.py, logit_bias.py, logprobs.py, stats.py), the errors
(errors.py), the request checks both sides run (request_checks.py,
grammar.py, json_pointer.py, verdict_cache.py), the prefix-cache key chain
(block_hash.py), LoRA names and states (lora/), tracing and log set-up
(tracing.py, replica_logs.py), and a light tokenizer loader (model_files.py,
tokenizer.py, chat_templates/, gguf_file.py's metadata, gguf_sentencepiece.py).
The gRPC API is v1/shoal.proto (the source of truth) and its generated
Python stubs (`make proto` regenerates them)."""
