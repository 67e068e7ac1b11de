"""Write a fake host as a file tree (proc, sys, nvidia-smi.csv) for `glm53 plan --host-root DIR` and host.py.

`HostSpec()` is the reference box: one RTX 3090 (24576 MiB, PCIe 4 x16), a 24-core EPYC 7443P with SMT,
256 GiB of RAM, no memory cap, memlock unlimited. Tests change only the fields they are about:
    root = write_host(tmp_path, HostSpec(mem_cap_gib=55, swap_cap_gib=0, store="/nvx/experts.glm53"))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

GIB = 1 << 30
# 12,096 records of 9 MiB + 36 KiB (4 KiB-aligned already) plus a header: a complete GLM-5.3-Flash store.
FULL_STORE_BYTES = 42 * 288 * (9 * (1 << 20) + 36 * 1024) + (1 << 20)

RTX3090 = ("NVIDIA GeForce RTX 3090", 24576, 24135, 4, 16)
RTX4080 = ("NVIDIA GeForce RTX 4080", 16376, 15992, 4, 16)
RTX4090 = ("NVIDIA GeForce RTX 4090", 24564, 24080, 4, 16)
A6000 = ("NVIDIA RTX A6000", 49140, 48600, 4, 16)
# The multi-GPU hosts of issue 28: the common home rig, a mixed pair, a four-card box, and a pair whose second
# card is below the minimum (left out with a warning).
DUAL_3090 = (RTX3090, RTX3090)
MIXED_3090_4090 = (RTX3090, RTX4090)
QUAD_3090 = (RTX3090,) * 4
WITH_SMALL = (RTX3090, RTX4080)
EPYC_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 aes pclmulqdq sha_ni vaes "
              "vpclmulqdq adx rdrand rdseed")
BROADWELL_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 aes pclmulqdq adx rdrand rdseed"
IVYBRIDGE_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c aes pclmulqdq rdrand"  # AVX but no AVX2/FMA


@dataclass(frozen=True)
class Cpu:
    model: str = "AMD EPYC 7443P 24-Core Processor"
    flags: str = EPYC_FLAGS
    sockets: int = 1
    cores_per_socket: int = 24
    smt: int = 2


EPYC_7443P = Cpu()
BROADWELL_2S = Cpu("Intel(R) Xeon(R) CPU E5-2699 v4 @ 2.20GHz", BROADWELL_FLAGS, 2, 22, 2)
IVYBRIDGE = Cpu("Intel(R) Xeon(R) CPU E5-2670 v2 @ 2.50GHz", IVYBRIDGE_FLAGS, 1, 10, 2)


@dataclass(frozen=True)
class HostSpec:
    gpus: tuple[tuple[str, int, int, int, int], ...] = (RTX3090,)   # (name, total MiB, free MiB, gen, width)
    cpu: Cpu = EPYC_7443P
    numa_nodes: int = 1
    mem_total_gib: float = 251.5
    mem_available_gib: float = 246.0
    swap_total_gib: float = 8.0
    cgroup: str = "v2"                  # v2 | v1
    mem_cap_gib: float | None = None    # docker --memory
    swap_cap_gib: float | None = None   # swap allowed above the cap (v2 memory.swap.max); None = unlimited
    current_mib: int = 180              # charged to the container's cgroup now
    memlock: int | None = None          # bytes; None = unlimited
    thp: str = "madvise"
    mounts: tuple[tuple[str, str], ...] = (("/", "overlay"), ("/nvx", "ext4"), ("/model", "ext4"))
    store: str | None = None            # create this store file (sparse) at this path
    store_bytes: int = FULL_STORE_BYTES
    extra: dict[str, str] = field(default_factory=dict)  # any other file: path -> content
    cuda_visible: str | None = None     # CUDA_VISIBLE_DEVICES in the process environment (None: unset)

    def but(self, **kw) -> HostSpec:
        return replace(self, **kw)


def _cpuinfo(cpu: Cpu) -> str:
    blocks, n = [], 0
    for _thread in range(cpu.smt):  # Linux numbers every core's first thread before any SMT sibling
        for socket in range(cpu.sockets):
            for core in range(cpu.cores_per_socket):
                blocks.append("\n".join([
                    f"processor\t: {n}", "vendor_id\t: fake", f"model name\t: {cpu.model}",
                    f"physical id\t: {socket}", f"siblings\t: {cpu.cores_per_socket * cpu.smt}",
                    f"core id\t\t: {core}", f"cpu cores\t: {cpu.cores_per_socket}", f"flags\t\t: {cpu.flags}",
                ]))
                n += 1
    return "\n\n".join(blocks) + "\n\n"


def _limits(memlock: int | None) -> str:
    value = "unlimited" if memlock is None else str(memlock)
    return ("Limit                     Soft Limit           Hard Limit           Units     \n"
            "Max cpu time              unlimited            unlimited            seconds   \n"
            "Max open files            1048576              1048576              files     \n"
            f"Max locked memory         {value:<20} {value:<20} bytes     \n"
            "Max address space         unlimited            unlimited            bytes     \n")


def _mountinfo(mounts: tuple[tuple[str, str], ...]) -> str:
    lines = []
    for i, (point, fstype) in enumerate(mounts):
        source = "none" if fstype in ("tmpfs", "overlay") else f"/dev/nvme{i}n1"
        lines.append(f"{100 + i} 1 259:{i} / {point.replace(' ', chr(92) + '040')} rw,relatime - {fstype} {source} rw")
    return "\n".join(lines) + "\n"


def write_host(root: Path, spec: HostSpec = HostSpec()) -> Path:
    """Write `spec` under `root` and return it (pass it as --host-root)."""
    root = Path(root)

    def put(path: str, text: str) -> None:
        p = root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    kb = 1024 * 1024  # kB per GiB
    put("/proc/cpuinfo", _cpuinfo(spec.cpu))
    put("/proc/meminfo", f"MemTotal:       {int(spec.mem_total_gib * kb)} kB\n"
                         f"MemFree:        {int(spec.mem_available_gib * kb * 0.9)} kB\n"
                         f"MemAvailable:   {int(spec.mem_available_gib * kb)} kB\n"
                         f"SwapTotal:      {int(spec.swap_total_gib * kb)} kB\n")
    put("/proc/self/limits", _limits(spec.memlock))
    env = {"PATH": "/usr/bin:/bin"} | ({} if spec.cuda_visible is None else {"CUDA_VISIBLE_DEVICES": spec.cuda_visible})
    put("/proc/self/environ", "".join(f"{k}={v}\0" for k, v in env.items()))
    put("/proc/self/mountinfo", _mountinfo(spec.mounts))
    put("/sys/kernel/mm/transparent_hugepage/enabled",
        " ".join(f"[{m}]" if m == spec.thp else m for m in ("always", "madvise", "never")) + "\n")
    for node in range(spec.numa_nodes):
        put(f"/sys/devices/system/node/node{node}/cpulist", "0\n")
    cap = None if spec.mem_cap_gib is None else int(spec.mem_cap_gib * GIB)
    swap = None if spec.swap_cap_gib is None else int(spec.swap_cap_gib * GIB)
    current = spec.current_mib << 20
    if spec.cgroup == "v2":
        put("/sys/fs/cgroup/memory.max", f"{cap if cap is not None else 'max'}\n")
        put("/sys/fs/cgroup/memory.current", f"{current}\n")
        put("/sys/fs/cgroup/memory.swap.max", f"{swap if swap is not None else 'max'}\n")
        put("/sys/fs/cgroup/cpu.max", "max 100000\n")
    else:
        unlimited = 9223372036854771712
        put("/sys/fs/cgroup/memory/memory.limit_in_bytes", f"{cap if cap is not None else unlimited}\n")
        put("/sys/fs/cgroup/memory/memory.usage_in_bytes", f"{current}\n")
        memsw = unlimited if cap is None or swap is None else cap + swap
        put("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes", f"{memsw}\n")
    if spec.gpus:
        put("/nvidia-smi.csv", "".join(f"{i}, {name}, {total}, {free}, {gen}, {width}\n"
                                       for i, (name, total, free, gen, width) in enumerate(spec.gpus)))
    if spec.store:
        p = root / spec.store.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("wb") as f:
            f.truncate(spec.store_bytes)  # sparse: a 107 GiB store costs no disk
    for path, text in spec.extra.items():
        put(path, text)
    return root
