"""The store library's read hook (glm53_store_set_read_hook, store.native.set_read_hook): a C function a bench
installs, called on the read thread once per part read with its bytes and its start time; none is installed by
default, and uninstalling stops the calls. The hook here is a tiny C library compiled by the test, as a bench
compiles its own."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from nvme_support import reference, small_store

from store import native
from store.directio import alloc_aligned
from store.format import ALIGN
from store.reader import Priority, StoreReader

HOOK_C = r"""
#include <stdint.h>
#include <time.h>
#define MAX_CALLS 4096
static int64_t bytes_seen[MAX_CALLS], began_seen[MAX_CALLS], ended_seen[MAX_CALLS];
static int calls;  /* claimed with an atomic add: parts call from several threads at once */
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
void hook(int64_t bytes, int64_t began_ns) {
    int i = __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED);
    if (i < MAX_CALLS) { bytes_seen[i] = bytes; began_seen[i] = began_ns; ended_seen[i] = now_ns(); }
}
int hook_calls(void) { return __atomic_load_n(&calls, __ATOMIC_ACQUIRE); }
int64_t hook_bytes(int i) { return bytes_seen[i]; }
int64_t hook_began(int i) { return began_seen[i]; }
int64_t hook_ended(int i) { return ended_seen[i]; }
void hook_reset(void) { __atomic_store_n(&calls, 0, __ATOMIC_RELEASE); }
"""


@pytest.fixture(scope="module")
def hooklib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the test's hook")
    d = tmp_path_factory.mktemp("hook")
    (d / "hook.c").write_text(HOOK_C)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(d / "hook.so"), str(d / "hook.c")], check=True)
    lib = ctypes.CDLL(str(d / "hook.so"))
    for name, res, args in (("hook_calls", ctypes.c_int, []), ("hook_bytes", ctypes.c_int64, [ctypes.c_int]),
                            ("hook_began", ctypes.c_int64, [ctypes.c_int]),
                            ("hook_ended", ctypes.c_int64, [ctypes.c_int]), ("hook_reset", None, [])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
    return lib


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_store(tmp_path_factory.mktemp("hook-store"))


@pytest.fixture
def hook(hooklib):
    """The test's hook installed (and the calls so far forgotten); none installed before or after."""
    address = ctypes.cast(hooklib.hook, ctypes.c_void_p).value
    assert native.set_read_hook(address) == 0, "a hook was installed before the test (the product installs none)"
    hooklib.hook_reset()
    yield hooklib
    assert native.set_read_hook(0) == address


def calls(lib) -> list[tuple[int, int, int]]:
    return [(lib.hook_bytes(i), lib.hook_began(i), lib.hook_ended(i)) for i in range(lib.hook_calls())]


@pytest.mark.parametrize("parts", [1, 2, 4, 7])
def test_the_hook_is_called_once_per_part_with_its_bytes(tmp_path, hook, parts):
    data = os.urandom(5 * ALIGN + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = np.zeros(len(data), np.uint8)
        t0 = time.monotonic_ns()
        got, used = native.pread_parts(fd, buf, 0, parts, ALIGN)
        t1 = time.monotonic_ns()
    finally:
        os.close(fd)
    assert got == len(data) and buf.tobytes() == data
    size = len(data) // parts // ALIGN * ALIGN if parts > 1 else 0
    want = [size] * (used - 1) + [len(data) - size * (used - 1)] if size else [len(data)]
    seen = calls(hook)
    assert sorted(b for b, _, _ in seen) == sorted(want) and used == len(want)
    # began_ns: steady_clock (CLOCK_MONOTONIC, as time.monotonic_ns) when the part's read began, before its end
    assert all(t0 <= began <= ended <= t1 for _, began, ended in seen)


def test_the_hook_sees_every_part_a_reader_reads_and_none_after_it_is_uninstalled(store, hooklib):
    address = ctypes.cast(hooklib.hook, ctypes.c_void_p).value
    with StoreReader(store, threads=2, verify=True, pieces=4, min_piece=4096) as r:
        buf = alloc_aligned(r.max_extent)
        e = r.header.entry(1, 2)
        assert native.set_read_hook(address) == 0
        hooklib.hook_reset()
        try:
            done = r.read(1, 2, buf, priority=Priority.DEMAND).result(10)
        finally:
            previous = native.set_read_hook(0)
        assert previous == address and done.data.tobytes() == reference(store, 1, 2)
        seen = calls(hooklib)
        assert len(seen) == 4 and sum(b for b, _, _ in seen) == e.extent  # the record's four parts, once each
        hooklib.hook_reset()
        assert r.read(1, 3, buf).result(10).data.tobytes() == reference(store, 1, 3)
        assert hooklib.hook_calls() == 0, "an uninstalled hook was still called"


def test_a_failed_part_is_not_reported_and_a_short_one_reports_what_it_read(tmp_path, hook):
    data = os.urandom(3 * ALIGN)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        tail = np.zeros(4 * ALIGN, np.uint8)  # past the end: one part, the bytes there are
        assert native.pread_parts(fd, tail, ALIGN, 1, ALIGN) == (2 * ALIGN, 1)
    finally:
        os.close(fd)
    assert [b for b, _, _ in calls(hook)] == [2 * ALIGN]
    hook.hook_reset()
    with pytest.raises(OSError):
        native.pread_parts(fd, np.zeros(ALIGN, np.uint8), 0, 1, ALIGN)  # closed fd: the pread fails
    assert hook.hook_calls() == 0


def test_the_library_path_can_be_bound_by_a_bench_and_set_read_hook_names_why_without_it(monkeypatch):
    lib = ctypes.CDLL(str(native.library_path()))  # as a bench binds it: the same library, the same hook
    lib.glm53_store_set_read_hook.restype = ctypes.c_void_p
    lib.glm53_store_set_read_hook.argtypes = [ctypes.c_void_p]
    assert lib.glm53_store_set_read_hook(None) is None  # none installed
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_WHY", "not built (test)")
    with pytest.raises(native.NativeUnavailable, match="not built .test.") as ei:
        native.set_read_hook(0)
    assert "pip install -e ." in str(ei.value)


def test_a_stale_or_missing_store_library_is_explained_and_refused(monkeypatch, store):
    monkeypatch.setattr(native.native_build, "source_hash", lambda directory=None: "0" * 16)
    lib, why = native._load()
    assert lib is None and "stale build" in why and "_native" in why
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_WHY", why)
    assert not native.available() and "pip install -e ." in native.unavailable_reason()
    with pytest.raises(native.NativeUnavailable, match="stale build") as ei:
        StoreReader(store)
    assert "pip install -e ." in ei.value.fix
