"""Host facts: what this machine (or container) has, read relative to a root directory.

Everything is read from `root/proc/...`, `root/sys/...` and, for GPUs, `root/nvidia-smi.csv` when a fake root
is given, so tests describe a host as a small file tree (tests/support/fakehost.py). With the real root ("/") GPUs
come from running nvidia-smi and the store's O_DIRECT support from a real read. Nothing here decides
anything: glm53/planning/plan.py turns these facts into a plan. A fact that cannot be read is None (unknown), never
a guess, and a note says why.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GPU_QUERY = ("nvidia-smi", "--query-gpu=index,name,memory.total,memory.free,pcie.link.gen.current,"
             "pcie.link.width.current", "--format=csv,noheader,nounits")
# cgroup v1 reports "no limit" as a huge page-rounded number (2^63 - 4096 on x86-64); anything this big is no cap.
_V1_UNLIMITED = 1 << 60
# Filesystems whose files cannot be opened with O_DIRECT. Only used for fake roots: on the real root the store
# is probed, because support also depends on the kernel version (overlay, fuse and zfs differ across versions).
NO_ODIRECT_FS = frozenset({"tmpfs", "ramfs", "squashfs", "9p", "fuse.sshfs", "proc", "sysfs", "devtmpfs"})
ODIRECT_BLOCK = 4096


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_mib: int
    free_mib: int
    pcie_gen: int | None
    pcie_width: int | None
    # The CUDA ordinal torch and exllamav3 name it by (cuda:N): its place among the GPUs CUDA_VISIBLE_DEVICES
    # leaves visible, in PCI bus order (CUDA numbers them so with CUDA_DEVICE_ORDER=PCI_BUS_ID, which glm53 sets).
    cuda: int | None = None

    @property
    def pcie_gbps(self) -> float | None:
        """Usable one-way PCIe bandwidth in GB/s (about 80% of the link rate), for ranking and messages."""
        per_lane = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}.get(self.pcie_gen or 0)
        if per_lane is None or not self.pcie_width:
            return None
        return round(per_lane * self.pcie_width * 0.8, 1)


@dataclass(frozen=True)
class Cpu:
    model: str
    flags: frozenset[str]
    logical: int
    physical_cores: int
    sockets: int
    quota_cpus: float | None  # cgroup cpu.max as a CPU count (docker --cpus); None = no quota

    @property
    def smt_siblings(self) -> int:
        """Hardware threads per physical core (2 with SMT on, 1 without)."""
        return max(1, self.logical // max(1, self.physical_cores))

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    @property
    def avx512(self) -> list[str]:
        return sorted(f for f in self.flags if f.startswith("avx512"))


@dataclass(frozen=True)
class Memory:
    total: int | None          # bytes, MemTotal
    available: int | None      # bytes, MemAvailable
    swap_total: int | None     # bytes, SwapTotal
    cgroup: str | None         # "v2", "v1" or None
    limit: int | None          # bytes, the tightest memory cap on our cgroup path; None = no cap
    current: int | None        # bytes charged to our cgroup now
    swap_limit: int | None     # bytes of swap allowed on top of `limit` (v2 swap.max; v1 memsw - limit); None = no cap
    memlock: int | None        # RLIMIT_MEMLOCK soft limit in bytes; None = unlimited
    thp: str | None            # transparent hugepages mode: always / madvise / never


@dataclass(frozen=True)
class Store:
    path: str
    exists: bool
    size: int | None
    fstype: str | None
    mount_point: str | None
    odirect: bool | None       # None = not known (store missing, or nothing to probe)
    odirect_how: str           # "probe: ..." or "fs type ..." — how `odirect` was decided


@dataclass(frozen=True)
class HostFacts:
    root: str
    gpus: tuple[Gpu, ...]
    cpu: Cpu
    numa_nodes: int
    memory: Memory
    store: Store | None
    notes: tuple[str, ...] = field(default=())
    # Why glm53's CPU-lane kernel cannot run here (not built, failed to load), or None. A fact of this install on
    # this host, filled in at the edge (glm53.planning.inputs) on the real host; fake trees leave it None.
    lane_kernel_error: str | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["cpu"]["flags"] = sorted(self.cpu.flags & {"avx2", "fma", "f16c", *self.cpu.avx512})
        out["cpu"]["smt_siblings"] = self.cpu.smt_siblings
        for g, src in zip(out["gpus"], self.gpus, strict=True):
            g["pcie_gbps"] = src.pcie_gbps
        return out


# ---------------------------------------------------------------- small readers


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return None


def _sub(root: Path, path: str) -> Path:
    """`path` (absolute, as seen inside the host) under `root`."""
    return root / path.lstrip("/")


# ---------------------------------------------------------------- GPUs


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of GPU_QUERY output; fields nvidia-smi cannot report ("[N/A]", "[Not Supported]") become None."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 6 or not cells[0].isdigit():
            continue
        # A GPU name may itself contain a comma; the numeric columns are always the last four.
        index, name, nums = cells[0], ", ".join(cells[1:-4]), cells[-4:]
        total, free, gen, width = (_int_or_none(c) for c in nums)
        # Some virtual GPUs report free memory as [N/A]: then the whole card is the best we know.
        gpus.append(Gpu(int(index), name, total or 0, free if free is not None else total or 0, gen, width))
    return gpus


def _environ(root: Path) -> dict[str, str]:
    """The process environment: os.environ on the real root, root/proc/self/environ (NUL-separated) on a fake one."""
    if root == Path("/"):
        return dict(os.environ)
    text = _read(_sub(root, "/proc/self/environ")) or ""
    return dict(kv.split("=", 1) for kv in text.split("\0") if "=" in kv)


def visible_gpus(gpus: list[Gpu], visible: str | None, notes: list[str]) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible, in its order, each with its CUDA ordinal (unset: all of
    them, in nvidia-smi's PCI bus order). nvidia-smi ignores the variable, CUDA does not: without this a plan
    would size a card the engine cannot open. Entries are indices; a UUID or MIG entry cannot be matched to
    nvidia-smi's index rows here, so then every GPU is listed, with a note."""
    if visible is None:
        return [replace(g, cuda=i) for i, g in enumerate(gpus)]
    by_index = {g.index: g for g in gpus}
    out: list[Gpu] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            break
        if not entry.lstrip("-").isdigit():
            notes.append(f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs by UUID or MIG id: not matched to "
                         "nvidia-smi's indices, so every GPU is listed; name them by index to plan for a subset")
            return [replace(g, cuda=i) for i, g in enumerate(gpus)]
        g = by_index.get(int(entry))
        if g is None or any(o.index == g.index for o in out):
            break  # CUDA stops at the first invalid (or repeated) entry, and so do we
        out.append(replace(g, cuda=len(out)))
    if len(out) < len(gpus):
        hidden = ", ".join(str(g.index) for g in gpus if all(o.index != g.index for o in out))
        notes.append(f"CUDA_VISIBLE_DEVICES={visible!r}: GPU {hidden or 'none'} hidden from CUDA, not planned for")
    return out


def read_gpus(root: Path, notes: list[str]) -> list[Gpu]:
    visible = _environ(root).get("CUDA_VISIBLE_DEVICES")
    return visible_gpus(_nvidia_smi_gpus(root, notes), visible, notes)


def _nvidia_smi_gpus(root: Path, notes: list[str]) -> list[Gpu]:
    csv = root / "nvidia-smi.csv"
    if root != Path("/"):
        # A fake host: its GPUs are exactly what nvidia-smi.csv lists (none when the file is absent).
        text = _read(csv)
        if text is None:
            notes.append(f"no {csv}: this fake host has no GPU")
        return parse_nvidia_smi(text or "")
    if shutil.which(GPU_QUERY[0]) is None:
        notes.append("nvidia-smi not found: no NVIDIA GPU visible (in Docker: --gpus all)")
        return []
    try:
        done = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        notes.append(f"nvidia-smi failed: {exc}")
        return []
    if done.returncode != 0:
        notes.append(f"nvidia-smi exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}")
        return []
    return parse_nvidia_smi(done.stdout)


# ---------------------------------------------------------------- CPU


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str], int, int | None, int | None]:
    """(model, flags, logical CPUs, physical cores, sockets); cores/sockets None when cpuinfo lacks topology."""
    model, flags, logical = "", frozenset(), 0
    cores: set[tuple[str, str]] = set()
    sockets: set[str] = set()
    for block in re.split(r"\n\s*\n", text):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields:
            continue
        logical += 1
        model = model or fields.get("model name", "")
        if not flags:
            # x86 says "flags", arm64 says "Features".
            flags = frozenset((fields.get("flags") or fields.get("Features") or "").split())
        if "physical id" in fields and "core id" in fields:
            cores.add((fields["physical id"], fields["core id"]))
            sockets.add(fields["physical id"])
    return model, flags, logical, (len(cores) or None), (len(sockets) or None)


def _sys_topology(root: Path) -> tuple[int | None, int | None]:
    """(physical cores, sockets) from /sys/devices/system/cpu/cpu*/topology, for hosts whose cpuinfo lacks it."""
    cores, sockets = set(), set()
    for topo in sorted(_sub(root, "/sys/devices/system/cpu").glob("cpu[0-9]*/topology")):
        pkg, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        if pkg is not None and core is not None:
            cores.add((pkg.strip(), core.strip()))
            sockets.add(pkg.strip())
    return (len(cores) or None), (len(sockets) or None)


def _cpu_quota(root: Path) -> float | None:
    """`docker --cpus N` as N: cgroup v2 cpu.max "quota period" (tightest on our path), or v1 cfs quota/period."""
    quotas = []
    for d in _ancestors(_sub(root, "/sys/fs/cgroup"), _cgroup_paths(root)[0]):
        quota, period = ((_read(d / "cpu.max") or "max").split() + ["100000"])[:2]
        if quota != "max" and _int_or_none(quota) and _int_or_none(period):
            quotas.append(int(quota) / int(period))
    if quotas or (_sub(root, "/sys/fs/cgroup/cpu.max")).exists():
        return min(quotas, default=None)
    quota = _int_or_none(_read(_sub(root, "/sys/fs/cgroup/cpu/cpu.cfs_quota_us")))
    period = _int_or_none(_read(_sub(root, "/sys/fs/cgroup/cpu/cpu.cfs_period_us")))
    if quota and quota > 0 and period:
        return quota / period
    return None


def read_cpu(root: Path, notes: list[str]) -> Cpu:
    model, flags, logical, cores, sockets = parse_cpuinfo(_read(_sub(root, "/proc/cpuinfo")) or "")
    if cores is None:
        cores, sockets = _sys_topology(root)
    if root == Path("/") and not flags:
        # Not Linux-x86 cpuinfo (or none at all): py-cpuinfo knows other ways to ask the CPU.
        try:
            import cpuinfo  # py-cpuinfo

            info = cpuinfo.get_cpu_info()
            flags = frozenset(info.get("flags", []))
            model = model or info.get("brand_raw", "")
            logical = logical or int(info.get("count", 0))
        except Exception as exc:  # a fallback only: any failure leaves the facts unknown, with a note
            notes.append(f"py-cpuinfo failed: {exc}")
    if logical == 0:
        logical = (os.cpu_count() or 1) if root == Path("/") else 1
        notes.append("no /proc/cpuinfo: CPU count guessed")
    if cores is None:
        notes.append("CPU topology unknown: assuming no SMT (physical cores = logical CPUs)")
        cores = logical
    return Cpu(model or "unknown CPU", flags, logical, cores, sockets or 1, _cpu_quota(root))


def read_numa_nodes(root: Path) -> int:
    nodes = list(_sub(root, "/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))


# ---------------------------------------------------------------- memory


def parse_meminfo(text: str) -> dict[str, int]:
    """Bytes by field name ("MemTotal: 263842856 kB" -> 263842856 * 1024)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def parse_memlock(limits_text: str) -> int | None:
    """Soft RLIMIT_MEMLOCK from /proc/self/limits, in bytes; None = unlimited (or the line is missing)."""
    for line in limits_text.splitlines():
        if line.startswith("Max locked memory"):
            soft = line[len("Max locked memory"):].split()[0]
            return None if soft == "unlimited" else _int_or_none(soft)
    return None


def _cgroup_paths(root: Path) -> tuple[str, str]:
    """Our cgroup's path (v2 unified, v1 memory controller) from /proc/self/cgroup; "/" inside a container."""
    v2, v1 = "/", "/"
    for line in (_read(_sub(root, "/proc/self/cgroup")) or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path or "/"
        elif "memory" in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _ancestors(base: Path, cgpath: str) -> list[Path]:
    """The cgroup directory and each parent up to the mount root; a cap anywhere above us applies to us."""
    parts = [p for p in cgpath.split("/") if p]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    # In a container the host's path is not mounted: the cgroup root is then our own cgroup.
    return [d for d in dirs if d.is_dir()] or [base]


def _tightest(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def read_cgroup(root: Path) -> tuple[str | None, int | None, int | None, int | None]:
    """(version, memory cap, current usage, swap cap) in bytes; caps are None when unlimited."""
    v2path, v1path = _cgroup_paths(root)
    base = _sub(root, "/sys/fs/cgroup")
    dirs = _ancestors(base, v2path)
    if any((d / "memory.max").exists() for d in dirs):
        def cap(name: str) -> int | None:
            return _tightest([_int_or_none(_read(d / name)) for d in dirs])  # "max" parses as None

        current = next((v for d in dirs if (v := _int_or_none(_read(d / "memory.current"))) is not None), None)
        return "v2", cap("memory.max"), current, cap("memory.swap.max")
    v1base = base / "memory"
    if (v1base / "memory.limit_in_bytes").exists():
        dirs = _ancestors(v1base, v1path)

        def cap1(name: str) -> int | None:
            vals = [_int_or_none(_read(d / name)) for d in dirs]
            return _tightest([v for v in vals if v is not None and v < _V1_UNLIMITED])

        limit, memsw = cap1("memory.limit_in_bytes"), cap1("memory.memsw.limit_in_bytes")
        current = _int_or_none(_read(dirs[0] / "memory.usage_in_bytes"))
        # v1 caps memory+swap together; the swap allowance is what memsw leaves above the memory cap.
        swap = None if memsw is None else max(0, memsw - (limit or memsw))
        return "v1", limit, current, swap
    return None, None, None, None


def read_memory(root: Path) -> Memory:
    info = parse_meminfo(_read(_sub(root, "/proc/meminfo")) or "")
    version, limit, current, swap = read_cgroup(root)
    thp_text = _read(_sub(root, "/sys/kernel/mm/transparent_hugepage/enabled")) or ""
    thp = m.group(1) if (m := re.search(r"\[(\w+)\]", thp_text)) else None
    return Memory(info.get("MemTotal"), info.get("MemAvailable"), info.get("SwapTotal"), version, limit, current,
                  swap, parse_memlock(_read(_sub(root, "/proc/self/limits")) or ""), thp)


# ---------------------------------------------------------------- the store


def _unescape_mount(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \040 \011 \012 \134.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def mount_of(mountinfo: str, path: str) -> tuple[str | None, str | None]:
    """(mount point, fs type) of the longest mount point that is a prefix of `path`; later mounts win ties."""
    best: tuple[str | None, str | None] = (None, None)
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields = pre.split()
        if not sep or len(fields) < 5 or not post.split():
            continue
        point = _unescape_mount(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best[0] is None or len(point) >= len(best[0])):
            best = (point, post.split()[0])
    return best


def probe_odirect(path: str) -> tuple[bool, str]:
    """Open `path` with O_DIRECT and read one aligned 4 KiB block into a page-aligned (mmap) buffer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        why = "O_DIRECT refused (EINVAL)" if exc.errno == errno.EINVAL else f"open failed: {exc.strerror}"
        return False, f"probe: {why}"
    try:
        buf = mmap.mmap(-1, ODIRECT_BLOCK)  # anonymous mmap is page-aligned, which O_DIRECT requires
        try:
            got = os.preadv(fd, [buf], 0)
        finally:
            buf.close()
    except OSError as exc:
        return False, f"probe: aligned O_DIRECT read failed: {exc.strerror}"
    finally:
        os.close(fd)
    return True, f"probe: read {got} bytes with O_DIRECT"


def read_store(root: Path, path: str) -> Store:
    point, fstype = mount_of(_read(_sub(root, "/proc/self/mountinfo")) or "", path)
    real = _sub(root, path)
    exists = real.is_file()
    size = real.stat().st_size if exists else None
    if not exists:
        odirect, how = None, "store missing: nothing to probe"
    elif root == Path("/"):
        odirect, how = probe_odirect(str(real))
    elif fstype is None:
        odirect, how = None, "fs type unknown (no mountinfo entry)"
    else:
        odirect = fstype not in NO_ODIRECT_FS
        how = f"fs type {fstype} " + ("supports O_DIRECT" if odirect else "does not support O_DIRECT")
    return Store(path, exists, size, fstype, point, odirect, how)


# ---------------------------------------------------------------- everything


def read_host(root: str | os.PathLike = "/", store: str | None = None) -> HostFacts:
    """All facts about the host under `root` ("/" for this machine), and about `store` if given."""
    base = Path(root).resolve()
    if store and base == Path("/"):
        store = os.path.abspath(store)  # on the real host a relative path means the working directory, as anywhere
    notes: list[str] = []
    gpus = read_gpus(base, notes)
    cpu = read_cpu(base, notes)
    memory = read_memory(base)
    if memory.total is None:
        notes.append("no /proc/meminfo: RAM unknown")
    return HostFacts(str(base), tuple(gpus), cpu, read_numa_nodes(base), memory,
                     read_store(base, store) if store else None, tuple(notes))
