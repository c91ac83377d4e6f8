"""Sampling: the sampler over per-row tensors (sampler.py), those tensors
(metadata.py), the counter-based noise that draws seeded rows (noise.py),
and the builder that stages them from a step's sequences (builder.py)."""
