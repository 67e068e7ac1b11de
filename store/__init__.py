"""The expert record store: format v1 (store.format), pack (store.pack), verify (store.verify), the engine's
O_DIRECT reader (store.reader) on the store's own native library (store.native, built from store/csrc), and the
project's one safetensors header reader (store.safetensors_header). docs/store-format.md documents the file byte
by byte.

No torch and nothing of glm53 here (tests/store/test_store_standalone.py checks it): numpy, xxhash and safetensors
header parsing only, so the store tools run in a bare container; what they need from glm53's settings, its
callers pass. Submodules are imported where used; importing `store` itself costs nothing.
"""

FORMAT_VERSION = 1
