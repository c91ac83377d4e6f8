"""router (arrives with the serving issue)."""
