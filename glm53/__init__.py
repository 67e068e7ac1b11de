"""glm53: serve GLM-5.3-Flash from one 24 GB GPU by tiering its experts across VRAM, RAM and NVMe."""

__version__ = "0.1.0"
