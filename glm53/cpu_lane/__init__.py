"""The CPU lane of fast mode: RAM-resident experts computed by the CPU where they sit, in parallel with the GPU.

kernel   the compiled EXL3 expert kernel (C++, built at install) and its pinned thread pool
planner  per layer and step, which missed picks go to the CPU lane and which cross PCIe (pure), its cost model
         and the least-squares calibration that fits it
calibrate  start-up measurements on this host: the kernel on a synthetic expert, RAM read bandwidth
lane     the worker that runs a step's CPU picks, with deadlines, recomputation and failure handling
bench    `glm53 bench cpu-lane`
"""
