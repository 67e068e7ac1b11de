"""Every touch of exllamav3: its contract, the tiered MoE seam, layer placement, and the runtime whose results the
engine reads as typed events. Nothing outside this package imports exllamav3 (tests/exl3/test_exl3_layering.py)."""
