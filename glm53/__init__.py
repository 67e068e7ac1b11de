"""glm53: serve GLM-5.3-Flash from one 24 GB GPU by tiering its experts across VRAM, RAM and NVMe."""

import os as _os

__version__ = "0.1.0"

# Before anything starts CUDA: cuda:N must be nvidia-smi's GPU N (PCI bus order), the card the plan sized; CUDA's
# default numbers the fastest card first. An explicit CUDA_DEVICE_ORDER is kept.
_os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
