"""Host facts read from fake trees (tests/support/fakehost.py) and, where it is harmless, from this machine."""

from __future__ import annotations

import json

from fakehost import BROADWELL_2S, GIB, RTX3090, RTX4080, RTX4090, HostSpec, write_host

from glm53.planning import host as H


def facts(tmp_path, spec=HostSpec(), store=None) -> H.HostFacts:
    return H.read_host(write_host(tmp_path, spec), store=store)


def test_reference_box(tmp_path):
    f = facts(tmp_path)
    (gpu,) = f.gpus
    assert (gpu.index, gpu.name, gpu.total_mib, gpu.free_mib, gpu.pcie_gen, gpu.pcie_width) == \
        (0, "NVIDIA GeForce RTX 3090", 24576, 24135, 4, 16)
    assert gpu.pcie_gbps == 25.2
    assert f.cpu.model == "AMD EPYC 7443P 24-Core Processor"
    assert (f.cpu.physical_cores, f.cpu.logical, f.cpu.smt_siblings, f.cpu.sockets) == (24, 48, 2, 1)
    assert f.cpu.has("avx2", "fma", "f16c") and f.cpu.avx512 == []
    assert f.cpu.quota_cpus is None
    assert f.numa_nodes == 1
    m = f.memory
    assert m.total == int(251.5 * GIB) and m.available == 246 * GIB and m.swap_total == 8 * GIB
    assert (m.cgroup, m.limit, m.current, m.swap_limit) == ("v2", None, 180 << 20, None)
    assert m.memlock is None and m.thp == "madvise"
    assert f.store is None and f.notes == ()
    json.dumps(f.to_json())  # the plan's --json output embeds it


def test_nvidia_smi_rows_with_unknowns_and_commas():
    text = ("0, NVIDIA GeForce RTX 3090, 24576, 301, 4, 16\n"
            "1, Some, Odd GPU, 16384, 16000, [N/A], [Not Supported]\n"
            "garbage line\n")
    a, b = H.parse_nvidia_smi(text)
    assert a.free_mib == 301
    assert (b.index, b.name, b.total_mib, b.pcie_gen, b.pcie_width, b.pcie_gbps) == (1, "Some, Odd GPU", 16384,
                                                                                     None, None, None)


def test_no_gpu_file_means_no_gpu(tmp_path):
    assert facts(tmp_path, HostSpec(gpus=())).gpus == ()


def test_two_gpus(tmp_path):
    f = facts(tmp_path, HostSpec(gpus=(RTX3090, RTX3090)))
    assert [g.index for g in f.gpus] == [0, 1] and [g.cuda for g in f.gpus] == [0, 1]
    assert all((g.total_mib, g.pcie_gen, g.pcie_width) == (24576, 4, 16) for g in f.gpus)
    assert [g["cuda"] for g in f.to_json()["gpus"]] == [0, 1]


def test_cuda_visible_devices_hides_and_renumbers(tmp_path):
    spec = HostSpec(gpus=(RTX3090, RTX4080, RTX4090, RTX3090), cuda_visible="2,0")
    f = facts(tmp_path, spec)
    # CUDA sees GPU 2 as cuda:0 and GPU 0 as cuda:1; nvidia-smi's indices and facts stay as they are.
    assert [(g.index, g.cuda, g.name) for g in f.gpus] == [(2, 0, RTX4090[0]), (0, 1, RTX3090[0])]
    assert any("GPU 1, 3 hidden from CUDA" in n for n in f.notes)


def test_cuda_visible_devices_edge_cases(tmp_path):
    gpus = [H.Gpu(i, f"g{i}", 24576, 24000, 4, 16) for i in range(3)]
    notes: list[str] = []
    assert [g.cuda for g in H.visible_gpus(gpus, None, notes)] == [0, 1, 2] and not notes
    assert H.visible_gpus(gpus, "", notes) == [] and "hidden" in notes[-1]  # CUDA_VISIBLE_DEVICES= hides all
    # CUDA stops at the first index it does not know (and at a repeat).
    assert [g.index for g in H.visible_gpus(gpus, "1,7,0", [])] == [1]
    assert [g.index for g in H.visible_gpus(gpus, "2,2,0", [])] == [2]
    notes = []
    assert [g.cuda for g in H.visible_gpus(gpus, "GPU-8f2e1c", notes)] == [0, 1, 2]
    assert "UUID" in notes[0]


def test_dual_socket_broadwell(tmp_path):
    spec = HostSpec(cpu=BROADWELL_2S, numa_nodes=2, gpus=(("NVIDIA GeForce RTX 3090", 24576, 24135, 3, 16),))
    f = facts(tmp_path, spec)
    assert (f.cpu.physical_cores, f.cpu.logical, f.cpu.sockets, f.numa_nodes) == (44, 88, 2, 2)
    assert f.gpus[0].pcie_gen == 3 and f.gpus[0].pcie_gbps == 12.6


def test_topology_from_sys_when_cpuinfo_lacks_it(tmp_path):
    extra = {"/proc/cpuinfo": "".join(f"processor\t: {i}\nflags\t: avx2 fma f16c\n\n" for i in range(8))}
    for i in range(8):
        extra[f"/sys/devices/system/cpu/cpu{i}/topology/physical_package_id"] = "0\n"
        extra[f"/sys/devices/system/cpu/cpu{i}/topology/core_id"] = f"{i % 4}\n"
    f = facts(tmp_path, HostSpec(extra=extra))
    assert (f.cpu.logical, f.cpu.physical_cores, f.cpu.smt_siblings) == (8, 4, 2)


def test_unknown_topology_assumes_no_smt(tmp_path):
    extra = {"/proc/cpuinfo": "".join(f"processor\t: {i}\nflags\t: avx2\n\n" for i in range(6))}
    f = facts(tmp_path, HostSpec(extra=extra))
    assert f.cpu.physical_cores == 6 and any("topology unknown" in n for n in f.notes)


def test_avx512_flags_are_reported(tmp_path):
    from fakehost import EPYC_FLAGS, Cpu

    zen4 = Cpu("AMD EPYC 9354P 32-Core Processor", EPYC_FLAGS + " avx512f avx512bw avx512vl avx512_vnni", 1, 32, 2)
    f = facts(tmp_path, HostSpec(cpu=zen4))
    assert f.cpu.avx512 == ["avx512_vnni", "avx512bw", "avx512f", "avx512vl"]
    assert set(f.to_json()["cpu"]["flags"]) == {"avx2", "fma", "f16c", *f.cpu.avx512}
    assert (f.cpu.physical_cores, f.cpu.smt_siblings) == (32, 2)


def test_cpu_quota(tmp_path):
    f = facts(tmp_path, HostSpec(extra={"/sys/fs/cgroup/cpu.max": "400000 100000\n"}))
    assert f.cpu.quota_cpus == 4.0


def test_cgroup_v2_cap_and_swap_cap(tmp_path):
    m = facts(tmp_path, HostSpec(mem_cap_gib=55, swap_cap_gib=0, current_mib=512)).memory
    assert (m.cgroup, m.limit, m.current, m.swap_limit) == ("v2", 55 * GIB, 512 << 20, 0)


def test_cgroup_v2_nested_parent_cap_applies(tmp_path):
    # Outside a container our cgroup sits deep in the tree; a cap on a parent slice still binds us.
    extra = {"/proc/self/cgroup": "0::/system.slice/glm53.service\n",
             "/sys/fs/cgroup/system.slice/memory.max": f"{20 * GIB}\n",
             "/sys/fs/cgroup/system.slice/glm53.service/memory.max": "max\n",
             "/sys/fs/cgroup/system.slice/glm53.service/memory.current": f"{GIB}\n"}
    m = facts(tmp_path, HostSpec(extra=extra)).memory
    assert (m.limit, m.current) == (20 * GIB, GIB)


def test_cgroup_v1(tmp_path):
    m = facts(tmp_path, HostSpec(cgroup="v1", mem_cap_gib=16, swap_cap_gib=16)).memory
    assert (m.cgroup, m.limit, m.swap_limit) == ("v1", 16 * GIB, 16 * GIB)
    m = facts(tmp_path / "b", HostSpec(cgroup="v1")).memory
    assert (m.cgroup, m.limit, m.swap_limit) == ("v1", None, None)  # the 2^63 "unlimited" sentinel


def test_memlock_and_thp(tmp_path):
    m = facts(tmp_path, HostSpec(memlock=65536, thp="never")).memory
    assert (m.memlock, m.thp) == (65536, "never")


def test_mount_of_longest_prefix_and_escapes():
    info = ("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
            "2 1 0:5 / /nvx rw - tmpfs none rw\n"
            "3 1 259:1 / /nvx/fast\\040disk rw - xfs /dev/nvme0n1 rw\n")
    assert H.mount_of(info, "/nvx/a.glm53") == ("/nvx", "tmpfs")
    assert H.mount_of(info, "/nvx/fast disk/a.glm53") == ("/nvx/fast disk", "xfs")
    assert H.mount_of(info, "/nvxother/a") == ("/", "ext4")


def test_store_facts_by_fs_type(tmp_path):
    path = "/nvx/experts.glm53"
    ok = facts(tmp_path / "a", HostSpec(store=path, store_bytes=1 << 20), store=path).store
    assert (ok.exists, ok.size, ok.fstype, ok.mount_point, ok.odirect) == (True, 1 << 20, "ext4", "/nvx", True)
    tmpfs = HostSpec(store=path, mounts=(("/", "overlay"), ("/nvx", "tmpfs")))
    bad = facts(tmp_path / "b", tmpfs, store=path).store
    assert bad.odirect is False and "tmpfs" in bad.odirect_how
    missing = facts(tmp_path / "c", store=path).store
    assert (missing.exists, missing.size, missing.odirect) == (False, None, None)


def test_real_odirect_probe(tmp_path):
    # The probe really opens with O_DIRECT; whether this machine's /tmp supports it varies, the answer must not.
    f = tmp_path / "blob"
    f.write_bytes(b"x" * 8192)
    ok, how = H.probe_odirect(str(f))
    assert isinstance(ok, bool) and how.startswith("probe:")
    st = H.read_host("/", store=str(f)).store
    assert st.exists and st.odirect == ok and st.odirect_how.startswith("probe:")
    assert H.probe_odirect(str(tmp_path / "nope"))[0] is False
