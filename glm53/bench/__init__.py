"""Every benchmark of glm53, registered once under `glm53 bench`. No product module imports this package
(tests/bench/test_bench_imports.py scans for it): the product runs one hot path, and what a benchmark must inject (the
emulated drive) goes through a narrow hook the product never installs (glm53.bench.emulated_disk).

  decode           exact / fast / nvme modes next to stock exllamav3 and the PCIe bound (GPU); --baseline REV
                   runs an earlier commit's code side by side (decode_baseline)
  depth            full depth at a 24 GB budget and 131,072 tokens: plan against load, TTFT, decode, peak
                   device memory, stock's tokens, where a step's time goes (GPU; a process per mode)
  host_step(_nvme) the host's microseconds per decoded MoE layer step; --baseline REV likewise (worktree)
  nvme             the nvme tier's decode model against the disk's raw rate
  store            store pack / verify / reader throughput against raw O_DIRECT
  stream           engine tokens/s against tokens/s a streaming client receives
  agent            a scripted coding-agent session over HTTP: prefix reuse, TTFT against the cold prefill rate
                   (agent_script: its text; served: the server under test, started or given by URL)
  serve            decode tok/s through HTTP at several concurrent streams (serve_bench)
  fairness         a short request's wait while replies without max_tokens hold every decode slot (HTTP)
  cpu_lane         the CPU expert kernel against the host's RAM bandwidth
  lookahead        the next layer's router run ahead: its recall
  read_contention  what the store's reads cost the planning thread
  disk_sweep       the store disk's raw O_DIRECT random-record rate by reads in flight
  depth_probe      the full-depth fixture in stock exllamav3: load, TTFT, decode, device memory (GPU)
  zero_copy        one MoE layer at bsz 1: misses read in place from pinned RAM vs copied first vs all in VRAM (GPU)
  copiers, worktree, emulated_disk: their shared helpers
"""

from __future__ import annotations

import importlib
from typing import Any

# (module, its register function), in the order of `glm53 bench --help`.
BENCHES = (
    ("glm53.bench.cli", "register_stream"),
    ("glm53.bench.cli", "register_store"),
    ("glm53.bench.cli", "register_agent"),
    ("glm53.bench.cli", "register_serve"),
    ("glm53.bench.cli", "register_fairness"),
    ("glm53.bench.decode", "register_bench"),
    ("glm53.bench.cli", "register_depth"),
    ("glm53.bench.nvme", "register_bench"),
    ("glm53.bench.cpu_lane", "register_bench"),
    ("glm53.bench.lookahead", "register_bench"),
    ("glm53.bench.host_step", "register_bench"),
    ("glm53.bench.disk_sweep", "register_bench"),
    ("glm53.bench.depth_probe", "register_bench"),
    ("glm53.bench.zero_copy", "register_bench"),
)


def register_bench(bench_sub: Any) -> None:
    for module, func in BENCHES:
        getattr(importlib.import_module(module), func)(bench_sub)
