// The bench's emulated disk: a read hook for the store's native reads (glm53_store_set_read_hook), so store read
// scheduling can be studied on a machine whose store reads come from a fast disk or the page cache as on a disk
// that is the bottleneck (a virtual disk whose rate stays the same whatever the reads in flight). The product never
// installs it.
//
// Each part read, once its real pread is in, books its bytes on one timeline shared by the whole process, from when
// the read began (so the real read's own time counts towards its booking, not on top of it), and sleeps until its
// booking ends: reads in flight share one fixed rate (two records read at once take about twice one alone), and a
// read books behind those that booked before it. The timeline is one atomic (a compare-and-swap loop, not a mutex:
// a lock inherited held across a fork would hang the child).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#define GLM53_API extern "C" __attribute__((visibility("default")))

namespace {

std::atomic<double> disk_seconds_per_byte{0.0};
std::atomic<int64_t> disk_free_at{0};  // steady_clock ns when the last booking ends

}  // namespace

// The hook: called on the read thread after each part's pread loop with the bytes read and the steady_clock ns at
// which that part's read began.
GLM53_API void glm53_bench_disk_hook(int64_t bytes, int64_t began) {
    double spb = disk_seconds_per_byte.load(std::memory_order_relaxed);
    if (spb <= 0.0 || bytes <= 0) return;
    int64_t took = static_cast<int64_t>(static_cast<double>(bytes) * spb * 1e9);
    int64_t free_at = disk_free_at.load(std::memory_order_relaxed), end;
    do {
        end = std::max(began, free_at) + took;  // start = max(began, free_at)
    } while (!disk_free_at.compare_exchange_weak(free_at, end, std::memory_order_relaxed));
    using Clock = std::chrono::steady_clock;
    std::this_thread::sleep_until(Clock::time_point(std::chrono::duration_cast<Clock::duration>(
        std::chrono::nanoseconds(end))));
}

// Sets the rate (0, or anything not above 0: every read passes unpaced); returns the rate before.
GLM53_API double glm53_bench_set_disk_rate(double seconds_per_byte) {
    return disk_seconds_per_byte.exchange(seconds_per_byte > 0.0 ? seconds_per_byte : 0.0);
}

// steady_clock now, in ns: the clock the hook's `began` is read on (for callers that pace reads of their own).
GLM53_API int64_t glm53_bench_steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}
