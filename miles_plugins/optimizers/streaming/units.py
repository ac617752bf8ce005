"""Byte units, one home: GB for what operators read (decimal, like disk vendors), MiB for sizes we allocate."""

GB = 1e9
MiB = 2**20


def binary_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit it fills (GiB, MiB, KiB), else in bytes: a small size in a
    message never reads as "0.00 GiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} bytes"
