"""Model architectures. One file per family."""
