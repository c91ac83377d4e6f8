"""LoRA adapters as both sides name them: the request for one (request.py),
the states a worker reports and the --lora-modules syntax (modules.py), the
cluster's registry of runtime loads (registry.py), and the rules for an
adapter's files (files.py). Reading and applying adapters is the workers'."""
