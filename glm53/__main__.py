import os

from glm53.devices import DEVICE_ORDER

# Before anything starts CUDA: cuda:N must be nvidia-smi's (PCI bus order) GPU N, the card the plan sized.
os.environ.setdefault(*DEVICE_ORDER)

from glm53.cli import main  # noqa: E402

raise SystemExit(main())
