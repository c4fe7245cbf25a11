"""Where the hardware tables' numbers come from: the vendors' datasheets, and the decimal
prefixes they use ("TB/s" and "GB/s" are 1e12 and 1e9 bytes/s).

``cost_model.hardware`` cites them for devices, ``cost_model.links`` for NVLink, whose
bandwidth the GPU's datasheet gives. No torch here: ``cost_model.links`` loads without it.
"""

from __future__ import annotations

TERA: float = 1e12
GIGA: float = 1e9

H100_SXM_DATASHEET = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM5 datasheet)"
H200_DATASHEET = "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet)"
A100_DATASHEET = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM)"
)
A800_DATASHEET = "https://www.nvidia.cn/data-center/a800/ (A800 80GB SXM datasheet)"
A40_DATASHEET = "https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf"
