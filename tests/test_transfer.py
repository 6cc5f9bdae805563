import pytest
import torch

from tinyllm_cli.transfer import to_device


@pytest.mark.parametrize("values,dtype", [([3, 1, 2], torch.long), ([], torch.long), ([0.5, 2.0], torch.float32)])
def test_to_device_keeps_values_and_dtype(values, dtype):
    t = to_device(values, "cpu", dtype)
    assert t.dtype == dtype and t.device.type == "cpu" and t.tolist() == values
