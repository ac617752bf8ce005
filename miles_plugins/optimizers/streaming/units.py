"""Byte units, one home: GB for what operators read (decimal, like disk vendors), MiB for sizes we allocate."""

GB = 1e9
MiB = 2**20
