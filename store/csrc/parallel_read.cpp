// One store record read as several parallel preads on native threads, for store.reader (through read_queue.cpp)
// and its calibration.
//
// A Python thread that reads a record's parts itself takes the GIL back after every pread and for its
// bookkeeping between them; each of those hand-offs can stall the engine's main thread, which plans every MoE
// layer step while the GPU waits (on a small host the main thread's step-like work takes longer with records read as
// Python-level parts than with one native call per record: docs/results.md). Here the caller makes one
// call per record, with the GIL released (ctypes).
//
// The parts run on a process-wide pool of persistent threads, not on threads made per call: a record read from RAM
// takes a fraction of a millisecond, and creating 3-7 threads, one after another on the caller, would be a large
// part of it (docs/results.md). The
// caller reads parts too, claiming them from the same counter as the workers, so a call never waits for a worker
// that is busy elsewhere (or absent: a pool whose threads could not be made).
//
// Each part may also be hashed by the thread that read it, while its bytes are still in that core's cache: a
// record checked as one 9 MiB hash after the read costs a demand read about as much again on a fast store
// (docs/results.md). The hash function is the caller's (the xxhash
// library Python already loaded), so this file carries no hash of its own.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <pthread.h>
#include <sched.h>
#include <thread>
#include <vector>

#include <unistd.h>

#include "store_api.h"

namespace {

// The read hook: null unless a bench installed one (glm53_store_set_read_hook). One relaxed load per part when
// none is; the clock is read only when one is.
std::atomic<glm53_read_hook_fn> read_hook{nullptr};

int64_t steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Reads until `len` bytes are in or EOF; returns the bytes read, or -1 with *err set.
int64_t read_all(int fd, char* buf, int64_t len, int64_t offset, int32_t* err) {
    int64_t done = 0;
    glm53_read_hook_fn hook = read_hook.load(std::memory_order_relaxed);
    int64_t began = hook != nullptr ? steady_ns() : 0;
    while (done < len) {
        ssize_t n = pread(fd, buf + done, static_cast<size_t>(len - done), offset + done);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (n == 0) break;
        done += n;
    }
    if (hook != nullptr) hook(done, began);
    return done;
}

using HashFn = uint64_t (*)(const void*, size_t);

// read_all, then the part's hash into *hash when asked and the part came in whole.
int64_t read_part(int fd, char* buf, int64_t len, int64_t offset, int32_t* err, HashFn hash, uint64_t* out) {
    int64_t got = read_all(fd, buf, len, offset, err);
    if (hash != nullptr && out != nullptr && got == len) *out = hash(buf, static_cast<size_t>(len));
    return got;
}

// One call's parts, on the caller's stack. Whoever takes a number from `next` reads that part, so each part is
// read exactly once however the caller and the workers race.
struct Job {
    int fd;
    char* base;
    int64_t length, offset, size;
    int32_t parts;
    HashFn hash;
    uint64_t* hashes;
    std::vector<int64_t> got;
    std::vector<int32_t> errs;
    std::atomic<int32_t> next{0};
    int32_t busy = 0;  // workers inside run(), under Pool::mu: the caller may not return (and free this) before 0

    void run() {
        for (int32_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
            int64_t start = i * size, n = i < parts - 1 ? size : length - start;
            got[i] = read_part(fd, base + start, n, offset + start, &errs[i], hash,
                               hashes == nullptr ? nullptr : hashes + i);
        }
    }
};

// Never destroyed: its threads outlive every static destructor at exit, so they must never find it gone.
struct Pool {
    std::mutex mu;
    std::condition_variable work, idle;  // work: the queue has a job; idle: some job's busy fell to 0
    std::deque<Job*> queue;              // a job once for each worker it could use
    int threads = 0;

    void serve() {
        for (;;) {
            Job* job;
            {
                std::unique_lock<std::mutex> lock(mu);
                work.wait(lock, [this] { return !queue.empty(); });
                job = queue.front();
                queue.pop_front();
                ++job->busy;  // with the pop, under one lock: the caller cannot miss this worker when it waits
            }
            job->run();
            std::lock_guard<std::mutex> lock(mu);
            if (--job->busy == 0) idle.notify_all();  // the last touch of the job: its caller may return after 0
        }
    }
};

Pool* make_pool() {
    Pool* p;
    try {
        p = new Pool;
    } catch (...) {  // std::bad_alloc: the deque allocates as it is made, not only `new`
        return nullptr;
    }
    // The CPUs this process may run on (a container's cpuset), not the machine's: threads beyond them only queue.
    cpu_set_t allowed;
    unsigned n = sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? static_cast<unsigned>(CPU_COUNT(&allowed))
                                                                     : std::thread::hardware_concurrency();
    n = n == 0 ? 4 : std::min(std::max(n, 2u), 32u);
    try {
        for (; p->threads < static_cast<int>(n); ++p->threads) std::thread(&Pool::serve, p).detach();
    } catch (...) {  // std::system_error (no thread to be had) or std::bad_alloc (its state)
    }
    return p;
}

std::atomic<Pool*> made{nullptr};
std::atomic<int> state{0};  // 0: no pool yet, 1: one is being made, 2: made (`made` may still be null)
std::atomic<bool> fork_handler{false};

// A child of fork() has none of the pool's threads, and may have its mutex held by one of them: it forgets the
// pool (leaked, never touched again) and makes its own on its first call. Only atomics here: the child runs this
// in its one thread, right after the fork.
void forget_pool_after_fork() {
    made.store(nullptr, std::memory_order_relaxed);
    state.store(0, std::memory_order_relaxed);
}

// The pool, made on first use (the first caller makes it, any other waits); null when not even its bookkeeping
// could be had. Threads that could not be made leave it smaller (or with none: then every caller reads all its
// parts itself). No lock of its own: a lock inherited held across a fork would hang the child here.
Pool* pool() {
    if (state.load(std::memory_order_acquire) == 2) return made.load(std::memory_order_acquire);
    int none = 0;
    if (state.compare_exchange_strong(none, 1, std::memory_order_acq_rel)) {
        if (!fork_handler.exchange(true)) pthread_atfork(nullptr, nullptr, forget_pool_after_fork);
        made.store(make_pool(), std::memory_order_release);
        state.store(2, std::memory_order_release);
    } else {
        while (state.load(std::memory_order_acquire) != 2) std::this_thread::yield();
    }
    return made.load(std::memory_order_acquire);
}

}  // namespace

// Reads `length` bytes at `offset` into `buf` as `parts` pieces: parts-1 of an `align`-multiple size, the last
// takes the remainder (store.reader splits records the same way). Returns the bytes read (fewer only at EOF), or
// -1 with *err the first failing part's errno. Every part has finished before it returns, so no write into
// `buf` outlives the call. hash (may be null): called on each part that came in whole, by the thread that read it,
// its result in hashes[i]; the parts actually used (1 when the split would make none) are returned in *used.
GLM53_API int64_t glm53_pread_parts(int fd, void* buf, int64_t length, int64_t offset, int32_t parts, int32_t align,
                                    int32_t* err, void* hash, uint64_t* hashes, int32_t* used) {
    *err = 0;
    char* base = static_cast<char*>(buf);
    HashFn h = reinterpret_cast<HashFn>(hash);
    int64_t size = parts > 1 && align > 0 ? length / parts / align * align : 0;
    if (used != nullptr) *used = size <= 0 ? 1 : parts;
    if (size <= 0) return read_part(fd, base, length, offset, err, h, hashes);
    // No exception may leave this function (it is called from C through ctypes: one would abort the process), and
    // it may not return while a worker can still reach its job.
    Job job{fd, base, length, offset, size, parts, h, hashes, {}, {}};
    try {
        job.got.assign(parts, 0);
        job.errs.assign(parts, 0);
    } catch (...) {  // no memory for the bookkeeping: one plain read
        if (used != nullptr) *used = 1;
        return read_part(fd, base, length, offset, err, h, hashes);
    }
    Pool* p = pool();
    int32_t offered = 0;
    if (p != nullptr && p->threads > 0) {
        try {  // a push that fails offers fewer parts: the caller reads what no worker takes
            std::lock_guard<std::mutex> lock(p->mu);
            // One entry per worker that could help: a worker reads parts until none is left, not just one.
            for (; offered < std::min(parts - 1, p->threads); ++offered) p->queue.push_back(&job);
        } catch (...) {
        }
        for (int32_t i = 0; i < offered; ++i) p->work.notify_one();
    }
    job.run();
    if (offered > 0) {
        std::unique_lock<std::mutex> lock(p->mu);
        p->queue.erase(std::remove(p->queue.begin(), p->queue.end(), &job), p->queue.end());
        p->idle.wait(lock, [&job] { return job.busy == 0; });
    }
    int64_t total = 0;
    for (int32_t i = 0; i < parts; ++i) {
        if (job.got[i] < 0) {
            *err = job.errs[i];
            return -1;
        }
        total += job.got[i];
    }
    return total;
}

GLM53_API glm53_read_hook_fn glm53_store_set_read_hook(glm53_read_hook_fn hook) {
    return read_hook.exchange(hook);
}

// The library's identity, for store/native.py: it refuses a build of other sources (GLM53_STORE_SRC_HASH, compiled
// in by setup.py) or of another ABI.
#ifndef GLM53_STORE_SRC_HASH
#define GLM53_STORE_SRC_HASH "unknown"
#endif
GLM53_API int32_t glm53_store_abi_version() { return 1; }
GLM53_API const char* glm53_store_source_hash() { return GLM53_STORE_SRC_HASH; }
