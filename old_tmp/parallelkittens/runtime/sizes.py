"""Integer helpers for the host side of a launch. Triton's own `cdiv` and `next_power_of_2` are constexpr
functions that cost microseconds per call outside a kernel, which adds up on every small collective."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (a >= 0, b > 0)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
