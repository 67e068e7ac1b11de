"""Engines behind the server: the interface, the CPU reference backend, the demo model."""
