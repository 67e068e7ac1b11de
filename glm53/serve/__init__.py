"""Composition: settings -> host facts -> plan -> engine -> app, in one place.

`choice` decides which engine these settings and this checkpoint get (the plan for an EXL3 checkpoint on this
host, the CPU reference backend for a small HF one, the demo model when none is configured); `demo` generates the
demo checkpoints and sizes the GPU one; `cli` is `glm53 serve`, which hands that engine to the server package (glm53.server), which knows nothing of planning.
"""
