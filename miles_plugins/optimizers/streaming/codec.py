"""Storage formats of a segment: how fp32 values on the device become the bytes in a bucket file.

The update math always runs in fp32; a codec only decides what is stored. Encoding and decoding
run on the device, so the stager only ever moves same-dtype bytes.
"""

from __future__ import annotations

import torch

from .stager import StoreConfigError


class Fp32Codec:
    """Stores fp32 as is: the device buffer's own bytes are the file's bytes (bit-exact)."""

    name = "fp32"
    storage_dtype = torch.float32

    def encoded_nbytes(self, numel: int) -> int:
        return numel * 4

    def reads_in_place(self) -> bool:
        """True: the stager may read straight into the fp32 buffer, no temporary needed."""
        return True

    def empty_encoded(self, numel: int, device: torch.device) -> list[torch.Tensor]:
        raise AssertionError("fp32 reads in place")

    def decode(self, encoded: list[torch.Tensor], out: torch.Tensor) -> None:
        raise AssertionError("fp32 reads in place")

    def encode(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """`values` are logically concatenated; returns the tensors to write back to back."""
        return values


CODECS = {"fp32": Fp32Codec}


def make_codec(moment_dtype: str):
    try:
        return CODECS[moment_dtype]()
    except KeyError:
        raise StoreConfigError(
            f"moment_dtype {moment_dtype!r} is not supported; choose one of {sorted(CODECS)}") from None
