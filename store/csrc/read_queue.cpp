// A store read queue served entirely by native threads, for store.reader.
//
// A read that lands on a Python thread takes the GIL for its bookkeeping and to resolve the read's future; each
// such hand-off can hold up the engine's main thread, which plans every decode step while the GPU waits. Here a read is queued, taken, read (glm53_pread_parts: parts on the shared pool,
// each hashed by the thread that read it), hashed whole when asked and marked finished without Python; Python
// submits, polls the task's state from a numpy view, or waits here with the GIL released, and checks the result
// itself when it looks.
//
// A task is an int64 array owned by Python (kept alive there until the task is finished or cancelled while
// queued), its fields at the indices below, then one uint64 per part for the parts' hashes. The worker writes
// the results first and the state last, with release semantics, and never touches the task after that.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#include "store_api.h"  // glm53_pread_parts: parallel_read.cpp, in this same library

namespace {

// Field indices: store/reader.py mirrors them.
enum : int {
    STATE, FD, BUF, LEN, OFF, PARTS, ALIGN, HASH, WANT_WHOLE, DELAY_NS, LEVEL, RESULT, ERRNO, USED, WHOLE, T_START,
    T_END, FIELDS
};
enum : int64_t { IDLE, QUEUED, RUNNING, DONE, CANCELLED };

using HashFn = uint64_t (*)(const void*, size_t);

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t state_of(const int64_t* t) { return __atomic_load_n(&t[STATE], __ATOMIC_ACQUIRE); }
void set_state(int64_t* t, int64_t s) { __atomic_store_n(&t[STATE], s, __ATOMIC_RELEASE); }
bool finished(const int64_t* t) {
    int64_t s = state_of(t);
    return s == DONE || s == CANCELLED || s == IDLE;  // IDLE: never submitted, so nothing to wait for
}

struct Queue {
    // A child of fork() inherits the queue without its worker threads, and with its mutex and condition variables
    // as the parent's threads left them (destroying one the parent's workers wait on blocks forever): every call
    // in another process answers at once as for a closed queue, and free leaks the copy.
    const pid_t owner = getpid();
    std::mutex mu;
    std::condition_variable work, done;  // work: a task is queued (or closing); done: some task finished
    std::deque<int64_t*> level[2];       // 0: demand, 1: prefetch; FIFO within each
    std::vector<std::thread> threads;
    bool closed = false;
    int active = 0;                      // tasks being read: the busy clock runs while > 0
    // Prefetch tasks being read, and how many may be at once. On a disk that one record's parts already keep
    // busy, every guess read beside a demand read takes a share of the disk's rate from it; capped, a demand read
    // that arrives finds a free worker and few guesses to share the disk with.
    int active_prefetch = 0;
    int prefetch_cap = 1 << 30;
    int64_t busy_ns = 0, busy_from = 0;

    bool may_take() const { return !level[0].empty() || (!level[1].empty() && active_prefetch < prefetch_cap); }

    void serve() {
        std::unique_lock<std::mutex> lock(mu);
        for (;;) {
            work.wait(lock, [this] { return closed || may_take(); });
            if (closed) return;  // close() cancelled whatever was queued
            // The level it was taken from, not the task's LEVEL: a running prefetch may be promoted meanwhile.
            const bool prefetch = level[0].empty();
            std::deque<int64_t*>& from = prefetch ? level[1] : level[0];
            int64_t* t = from.front();
            from.pop_front();
            if (t[T_START] == 0) t[T_START] = now_ns();  // a retry keeps its first start
            set_state(t, RUNNING);
            if (active++ == 0) busy_from = now_ns();
            active_prefetch += prefetch;
            lock.unlock();
            read(t);
            lock.lock();
            if (--active == 0) busy_ns += now_ns() - busy_from;
            active_prefetch -= prefetch;
            set_state(t, DONE);  // under the lock: wait() checks the state under it too, so misses no wake-up
            done.notify_all();  // and round again: this worker takes the next prefetch a cap held back
        }
    }

    static void read(int64_t* t) {
        if (t[DELAY_NS] > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(t[DELAY_NS]));
        int32_t err = 0, used = 1;
        char* buf = reinterpret_cast<char*>(t[BUF]);
        HashFn hash = reinterpret_cast<HashFn>(t[HASH]);
        uint64_t* hashes = hash != nullptr ? reinterpret_cast<uint64_t*>(t + FIELDS) : nullptr;
        int64_t got = glm53_pread_parts(static_cast<int>(t[FD]), buf, t[LEN], t[OFF], static_cast<int32_t>(t[PARTS]),
                                        static_cast<int32_t>(t[ALIGN]), &err, reinterpret_cast<void*>(hash), hashes,
                                        &used);
        // The whole record's hash, for a first read: here, on this thread, rather than in Python after the read.
        if (hash != nullptr && t[WANT_WHOLE] && got == t[LEN])
            t[WHOLE] = static_cast<int64_t>(used == 1 ? hashes[0] : hash(buf, static_cast<size_t>(got)));
        t[RESULT] = got;
        t[ERRNO] = err;
        t[USED] = used;
        t[T_END] = now_ns();
    }
};

}  // namespace

// A queue with `threads` workers; null when not one could be started.
GLM53_API void* glm53_rq_new(int32_t threads) {
    Queue* q;
    try {
        q = new Queue;
    } catch (...) {
        return nullptr;
    }
    try {
        for (int32_t i = 0; i < std::max(1, threads); ++i) q->threads.emplace_back(&Queue::serve, q);
    } catch (...) {  // fewer threads than asked: still a queue, unless there are none
    }
    if (q->threads.empty()) {
        delete q;
        return nullptr;
    }
    return q;
}

// Queue a task at its LEVEL (0 demand, 1 prefetch); -1 once the queue is closed, or without memory to queue it.
GLM53_API int32_t glm53_rq_submit(void* queue, int64_t* t) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return -1;
    {
        std::lock_guard<std::mutex> lock(q->mu);
        if (q->closed) return -1;
        try {
            q->level[t[LEVEL] == 0 ? 0 : 1].push_back(t);
        } catch (...) {
            return -1;
        }
        set_state(t, QUEUED);
    }
    q->work.notify_one();
    return 0;
}

namespace {
bool unqueue(Queue* q, int64_t* t) {  // under q->mu
    for (auto& d : q->level) {
        auto it = std::find(d.begin(), d.end(), t);
        if (it != d.end()) {
            d.erase(it);
            return true;
        }
    }
    return false;
}
}  // namespace

// Drop a task that is still queued (1); 0 when it is under way, finished or never queued.
GLM53_API int32_t glm53_rq_cancel(void* queue, int64_t* t) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return 0;
    {
        std::lock_guard<std::mutex> lock(q->mu);
        if (state_of(t) != QUEUED || !unqueue(q, t)) return 0;
        set_state(t, CANCELLED);
    }
    q->done.notify_all();
    return 1;
}

// A queued task goes to the back of the demand level (a prefetch), or stays where it is (a demand read); 1 when
// it was queued, 0 when it is under way, finished or never queued.
GLM53_API int32_t glm53_rq_promote(void* queue, int64_t* t) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return 0;
    {
        std::lock_guard<std::mutex> lock(q->mu);
        if (state_of(t) != QUEUED) return 0;
        if (t[LEVEL] == 0) return 1;
        auto& pre = q->level[1];
        auto it = std::find(pre.begin(), pre.end(), t);
        if (it == pre.end()) return 0;
        try {
            q->level[0].push_back(t);
        } catch (...) {
            return 1;  // still queued, as a prefetch
        }
        pre.erase(it);
        t[LEVEL] = 0;
    }
    q->work.notify_one();  // a worker idle under the prefetch cap takes it now
    return 1;
}

// Block (call it with the GIL released) until the task is finished or cancelled, or timeout_ns passed (< 0: no
// limit); returns its state.
GLM53_API int64_t glm53_rq_wait(void* queue, int64_t* t, int64_t timeout_ns) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return state_of(t);  // nothing here will ever finish it
    std::unique_lock<std::mutex> lock(q->mu);
    auto over = [t] { return finished(t); };
    if (timeout_ns < 0)
        q->done.wait(lock, over);
    else
        q->done.wait_for(lock, std::chrono::nanoseconds(timeout_ns), over);
    return state_of(t);
}

// At most `cap` (>= 1) prefetch tasks read at once; demand tasks are never held back. Returns the cap set.
GLM53_API int32_t glm53_rq_set_prefetch_cap(void* queue, int32_t cap) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return 0;
    {
        std::lock_guard<std::mutex> lock(q->mu);
        q->prefetch_cap = std::max(1, cap);
    }
    q->work.notify_all();  // a raised cap may free held-back workers
    return std::max(1, cap);
}

// Seconds so far with at least one read under way (overlapping reads count once).
GLM53_API double glm53_rq_busy(void* queue) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return 0.0;
    std::lock_guard<std::mutex> lock(q->mu);
    return static_cast<double>(q->busy_ns + (q->active ? now_ns() - q->busy_from : 0)) * 1e-9;
}

// The task's state with acquire semantics: Python reads the result fields only after this says DONE, so those
// reads see what the worker wrote before it (a plain numpy read is enough on x86, not on every CPU).
GLM53_API int64_t glm53_rq_state(const int64_t* t) { return state_of(t); }

GLM53_API int64_t glm53_rq_queued(void* queue) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return 0;
    std::lock_guard<std::mutex> lock(q->mu);
    return static_cast<int64_t>(q->level[0].size() + q->level[1].size());
}

// Cancel every queued task, let the running ones finish, stop the workers; returns the tasks cancelled. The
// queue itself stays valid (submit refuses, wait returns at once) until glm53_rq_free.
GLM53_API int64_t glm53_rq_close(void* queue) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return 0;
    int64_t cancelled = 0;
    {
        std::lock_guard<std::mutex> lock(q->mu);
        if (q->closed) return 0;
        q->closed = true;
        for (auto& d : q->level) {
            for (int64_t* t : d) set_state(t, CANCELLED);
            cancelled += static_cast<int64_t>(d.size());
            d.clear();
        }
    }
    q->work.notify_all();
    q->done.notify_all();
    for (auto& th : q->threads) th.join();
    q->threads.clear();
    return cancelled;
}

// Close (if not yet) and free; no call may name the queue after this.
GLM53_API void glm53_rq_free(void* queue) {
    Queue* q = static_cast<Queue*>(queue);
    if (q->owner != getpid()) return;  // a fork()'s copy: leaked, never destroyed
    glm53_rq_close(queue);
    delete q;
}
