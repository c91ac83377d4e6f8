"""proto (arrives with the serving issue)."""
