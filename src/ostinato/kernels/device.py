"""What the kernels' launch plans need to know of the device they run on."""

from __future__ import annotations

import torch


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on CPU: a small pretend GPU, so CPU tests split small batches too
    return torch.cuda.get_device_properties(device).multi_processor_count
