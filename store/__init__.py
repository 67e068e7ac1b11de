"""The expert record store: format v1 (store.format), pack (store.pack), verify (store.verify) and the engine's
O_DIRECT reader (store.reader). docs/store-format.md documents the file byte by byte.

No torch here: numpy, xxhash and safetensors header parsing only, so the store tools run in a bare container.
Submodules are imported where used; importing `store` itself costs nothing (the CLI front door imports
store.cli at every start).
"""

FORMAT_VERSION = 1
