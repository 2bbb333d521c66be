"""Raw-byte views of tensors: every dtype, every stride, including the strided one-element case."""

import pytest
import torch

from trainer.transport.tensors import as_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 2, 5])
def test_strided_input_becomes_its_elements_bytes(dtype, numel):
    # x[::2] of a one-element result has stride 2 yet reports is_contiguous(): it used to fail the
    # uint8 view on the GPU test (bf16, 2-element source).
    source = (torch.arange(2 * numel, dtype=torch.float32) * 1.5).to(dtype)
    strided = source[::2]
    raw = as_bytes(strided)
    assert raw.dtype == torch.uint8 and raw.numel() == strided.numel() * strided.element_size()
    assert torch.equal(raw.view(dtype), strided.reshape(-1))
