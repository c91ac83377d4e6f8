"""The engine's core: sequences, the KV block pool and manager, the
scheduler, sampling parameters and the outputs it hands back."""
