"""Small arithmetic shared by the engine, the router and the benchmarks (no torch here)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a items."""
    return -(-a // b)
