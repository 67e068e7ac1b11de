// The CPU expert kernel's generic part: decode tables, CPU feature detection, the pinned thread pool, the
// per-expert phase program, and the C ABI that glm53/cpu_lane/kernel.py loads with ctypes.
//
// Why our own kernel: exllamav3's CPU MoE code segfaults on the GPU machine (docs/results.md); this one needs
// no torch headers, builds with any C++17 compiler at `pip install`, and is tested on the CPU against the numpy
// reference decoder. One call runs a list of experts (one layer step's CPU picks) with T pinned threads:
//   per expert: prep (gate/up input transforms) | gate+up GEMV | mid (output transforms, SwiGLU, down input
//   transform) | down GEMV | out (output transform); between phases a wait until the units the next phase reads
//   are done, work units shared out by an atomic counter within each. Each output column is summed by one thread
//   in a fixed order, so results do not depend on the thread count or on which thread took which unit.
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "kernel_api.h"

#ifndef GLM53_SRC_HASH
#define GLM53_SRC_HASH "unknown"
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the EXL3 trellis is read as little-endian 32-bit words: a big-endian host needs byte swaps added"
#endif

namespace glm53 {

float g_mul1_by_bytesum[1024];

namespace {

thread_local std::string t_error;

int fail(int code, const std::string& msg) {
    t_error = msg;
    return code;
}

// ---------------------------------------------------------------------------------------------------------------
// Tables

float round_to_half(float v) {
    // fp32 -> nearest fp16 (ties to even) -> fp32, for values in fp16's normal range (all mul1 values are).
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits += 0xFFFu + ((bits >> 13) & 1u);
    bits &= 0xFFFFE000u;
    memcpy(&v, &bits, 4);
    return v;
}

struct Tables {
    DecodeTables k[9];
    std::string error;  // non-empty if some K's windows did not fit (a bug: checked by the tests)

    Tables() {
        for (int b = 0; b < 1024; ++b)
            g_mul1_by_bytesum[b] = b <= 1020 ? round_to_half((float)b * kMul1Inv + kMul1Bias) : 0.0f;
        for (int kb = 1; kb <= 8; ++kb) build(kb);
    }

    static int floordiv(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

    void build(int kb) {
        DecodeTables& T = k[kb];
        memset(&T, 0, sizeof T);
        T.k = kb;
        T.words = 8 * kb;
        const int total = 256 * kb;
        for (int t = 0; t < kTileElems; ++t) {
            // Element t's 16-bit window ends at bit (t+1)K of the tile's MSB-first bitstream, wrapping around.
            const int start = (((t + 1) * kb - 16) % total + total) % total;
            T.i0[t] = (uint16_t)(start / 32);
            T.i1[t] = (uint16_t)((start / 32 + 1) % T.words);
            T.sh[t] = (uint8_t)(48 - start % 32);
        }
        T.nwrap = 0;
        for (int g = 0; g < kGroups; ++g) {
            const int s_first = (8 * g + 1) * kb - 16;  // negative: the window wraps to the end of the tile
            const bool wrap = s_first < 0;
            if (wrap) {
                if (T.nwrap != g || g >= 2) error = "wrapping groups are not groups 0 and 1";
                T.nwrap = g + 1;
            }
            T.base[g] = wrap ? -2 : std::min(s_first / 32, T.words - 4);
            for (int j = 0; j < 8; ++j) {
                const int s = (8 * g + j + 1) * kb - 16;
                if (!fill_lane(s, T.base[g], &T.ctrl[g][4 * j]))
                    error = "K=" + std::to_string(kb) + ": a trellis window does not fit its 16-byte load";
                T.shift[g][j] = (uint32_t)(16 - (s - 8 * floordiv(s, 8)));
            }
        }
        for (int g = 1; g < kGroups; ++g)  // the integer kernel holds one group's shifts for all (kernel_impl.h)
            if (memcmp(T.shift[g], T.shift[0], sizeof T.shift[0]) != 0)
                error = "K=" + std::to_string(kb) + ": groups with different shifts";
        T.pair_ok = 1;
        T.pair_nwrap = 0;
        for (int p = 0; p < kGroups / 2; ++p) {
            const int s_first = (16 * p + 1) * kb - 16;
            const bool wrap = s_first < 0;
            if (wrap) T.pair_nwrap = p + 1;
            if (wrap && p > 0) T.pair_ok = 0;  // the SIMD code assumes only pair 0 wraps
            T.pair_base[p] = wrap ? -2 : std::min(s_first / 32, T.words - 4);
            for (int j = 0; j < 16; ++j)
                T.pair_ok &= fill_lane((16 * p + j + 1) * kb - 16, T.pair_base[p], &T.pair_ctrl[p][4 * j]);
        }
    }

    // pshufb control for one element whose window starts at stream bit s, reading the 16-byte window of 4 words
    // from word `base`: stream byte q0 + d goes to byte 3 - d of the lane's dword (most significant first).
    // False if a byte the window needs lies outside the load.
    static bool fill_lane(int s, int base, uint8_t* ctrl) {
        const int q0 = floordiv(s, 8), last_needed = floordiv(s + 15, 8);
        bool ok = true;
        for (int d = 0; d < 4; ++d) {
            const int q = q0 + d, word = floordiv(q, 4);
            uint8_t idx = 0x80;  // pshufb: zero
            if (word >= base && word < base + 4)
                idx = (uint8_t)(4 * (word - base) + 3 - (q - 4 * word));
            else if (q <= last_needed)
                ok = false;
            ctrl[3 - d] = idx;
        }
        return ok;
    }
};

const Tables& tables() {
    static const Tables t;  // thread-safe one-time init
    return t;
}

// ---------------------------------------------------------------------------------------------------------------
// CPU features: cpuid + xgetbv only. No instruction is executed to probe (exllamav3's probe crashed in a VM), and
// XCR0 says whether the OS saves the vector state (a hypervisor may advertise AVX-512 and not enable it).

bool cpu_has(int isa) {
    if (isa == GLM53_ISA_SCALAR) return true;
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    if (!(fma && osxsave && avx && f16c)) return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x6u) != 0x6u) return false;  // SSE and AVX state
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    const bool avx2 = b & (1u << 5);
    if (isa == GLM53_ISA_AVX2) return avx2;
    if (isa == GLM53_ISA_AVX2VNNI) {
        unsigned a1, b1, c1, d1;
        __cpuid_count(7, 1, a1, b1, c1, d1);
        return avx2 && (a1 & (1u << 4));  // AVX-VNNI (VEX-encoded vpdpbusd)
    }
    const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
    const bool avx512 = avx2 && f && dq && bw && vl && (lo & 0xE0u) == 0xE0u;  // opmask, ZMM_Hi256, Hi16_ZMM state
    if (isa == GLM53_ISA_AVX512) return avx512;
    if (isa == GLM53_ISA_AVX512VNNI) return avx512 && (c & (1u << 11));
#endif
    return false;
}

const IsaOps* isa_ops(int isa) {
    if (!cpu_has(isa)) return nullptr;
    switch (isa) {
        case GLM53_ISA_SCALAR: return &kScalarOps;
#if defined(__x86_64__)
        case GLM53_ISA_AVX2: return &kAvx2Ops;
        case GLM53_ISA_AVX2VNNI: return &kAvx2VnniOps;
        case GLM53_ISA_AVX512: return &kAvx512Ops;
        case GLM53_ISA_AVX512VNNI: return &kAvx512VnniOps;
#endif
        default: return nullptr;
    }
}

// An ISA code, with GLM53_KERNEL_INT or not: that ISA's ops if this CPU runs them and, for the integer kernel,
// the ISA has one.
const IsaOps* ops_for(int code) {
    if (code & ~(GLM53_ISA_MASK | GLM53_KERNEL_INT)) return nullptr;
    const IsaOps* ops = isa_ops(code & GLM53_ISA_MASK);
    if (ops && (code & GLM53_KERNEL_INT) && !ops->gemv_cols_q) return nullptr;
    return ops;
}

// ---------------------------------------------------------------------------------------------------------------
// Buffers

struct Buf {
    float* p = nullptr;
    size_t n = 0;
    Buf() = default;
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    ~Buf() { free(p); }
    void reserve(size_t m) {
        if (m <= n) return;
        free(p);
        p = nullptr;
        n = 0;
        void* q = nullptr;
        if (posix_memalign(&q, 64, m * sizeof(float)) != 0) throw std::bad_alloc();
        p = static_cast<float*>(q);
        n = m;
    }
};

inline void cpu_relax() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

// Sleep while *word == expected / wake up to n sleepers: the kernel's futex on a 32-bit atomic, so that one call wakes
// every idle worker at once, each running as soon as its core is free (a condition variable would make each woken
// worker take the same mutex in turn).
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word, int n) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, n, nullptr, nullptr, 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Per-job geometry, computed and checked before the threads start

struct Shape {
    int hidden, inter, rows;
    int chunk_gu, nchunk_gu;   // tile columns per gate/up unit (a power of two), units per linear
    int chunk_d, nchunk_d;
    size_t counters;           // this job's first counter in Pool::counters_
};

// A job's counters: three work-unit dispensers, the prep and gate/up units finished, then per 128-column block of
// the intermediate the gate/up units still to finish before its mid step, per 128-column block of the output the
// down units still to finish before its output transform, and the output blocks still to finish before the job is
// done.
enum { kCtrPrep, kCtrGateUp, kCtrDown, kCtrPrepDone, kCtrGateUpDone, kCtrOutDone, kCtrBlocks };

int check_linear(const Glm53Linear& l, const char* name, int in, int out) {
    if (!l.trellis || !l.suh || !l.svh) return fail(-2, std::string(name) + ": null pointer");
    if (l.in_features != in || l.out_features != out)
        return fail(-2, std::string(name) + ": shape " + std::to_string(l.in_features) + "x" +
                            std::to_string(l.out_features) + " does not chain (expected " + std::to_string(in) +
                            "x" + std::to_string(out) + ")");
    if (l.k_bits < 1 || l.k_bits > 8) return fail(-2, std::string(name) + ": K must be an integer 1..8");
    return 0;
}

int chunk_for(int cols_total, int threads, int rows) {
    // About eight units per thread, so the last units of a phase leave little idle time; a power of two, so a unit
    // never straddles a 128-column (8-tile) block; an accumulator block (rows x chunk x 512 B) that stays in L2.
    int want = (cols_total + 8 * threads - 1) / (8 * threads);
    want = std::max(1, std::min({want, 32, 512 / std::max(1, rows)}));
    int c = 1;
    while (2 * c <= want) c *= 2;
    return c;
}

// ---------------------------------------------------------------------------------------------------------------
// The pool

// Where a worker's time goes in one call (nanoseconds, summed over the call's experts): from the caller's start to
// the worker's, then each phase's own work and each wait between phases. `glm53 bench cpu-lane` prints them: the
// clock reads cost ~25 ns each, 5 a worker per expert, against the hundreds of microseconds an expert takes.
enum Phase { kPhWake, kPhPrep, kPhWait1, kPhGateUp, kPhWait2, kPhDown, kPhases };

inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

class Pool {
public:
    Pool(int threads, const int32_t* cpus, int ncpus, int spin_us)
        : n_(threads), spin_us_(std::max(0, spin_us)), workers_(threads) {
        finished_.store((uint32_t)threads);  // no call running
        cpus_.assign(cpus, cpus + std::max(0, ncpus));
        threads_.reserve(threads);
        for (int i = 0; i < threads; ++i) threads_.emplace_back(&Pool::loop, this, i);
        while (started_.load(std::memory_order_acquire) < n_) std::this_thread::yield();
    }

    ~Pool() {
        stop_.store(true, std::memory_order_seq_cst);
        gen_.fetch_add(1, std::memory_order_seq_cst);
        futex_wake(gen_, INT_MAX);
        for (auto& t : threads_) t.join();
    }

    int threads() const { return n_; }
    int pinned() const { return pinned_.load(); }

    int run(const Glm53Job* jobs, int njobs, const IsaOps* ops, bool integer, const volatile int32_t* cancel,
            volatile int32_t* done) {
        std::lock_guard<std::mutex> one_call(call_m_);
        static const volatile int32_t never = 0;
        drain();
        call_.jobs.assign(jobs, jobs + njobs);  // a late worker of this call reads the pool's copy, not the caller's
        call_.njobs = njobs;
        call_.ops = ops;
        call_.integer = integer;
        call_.cancel = cancel ? cancel : &never;
        call_.done = done;
        call_.shapes.resize(njobs);
        size_t xv_gu = 0, raw = 0, xv_d = 0, yraw = 0, acc = 0, qs_gu = 0, qs_d = 0, ncounters = 0;
        for (int j = 0; j < njobs; ++j) {
            const Glm53Job& job = jobs[j];
            const int h = job.gate.in_features, in = job.gate.out_features, r = job.rows;
            if (r < 1) return fail(-2, "job " + std::to_string(j) + ": rows must be >= 1");
            if (!job.x || !job.out) return fail(-2, "job " + std::to_string(j) + ": null x or out");
            if (h <= 0 || in <= 0 || h % kHad || in % kHad)
                return fail(-2, "job " + std::to_string(j) + ": hidden and intermediate must be multiples of 128");
            int rc;
            if ((rc = check_linear(job.gate, "gate", h, in)) || (rc = check_linear(job.up, "up", h, in)) ||
                (rc = check_linear(job.down, "down", in, h)))
                return rc;
            Shape& s = call_.shapes[j];
            s.hidden = h;
            s.inter = in;
            s.rows = r;
            s.chunk_gu = chunk_for(2 * (in / 16), n_, r);
            s.nchunk_gu = (in / 16 + s.chunk_gu - 1) / s.chunk_gu;
            s.chunk_d = chunk_for(h / 16, n_, r);
            s.nchunk_d = (h / 16 + s.chunk_d - 1) / s.chunk_d;
            s.counters = ncounters;
            ncounters += kCtrBlocks + in / kHad + h / kHad;
            xv_gu = std::max(xv_gu, (size_t)r * (h / 16) * (integer ? kXq : 32));
            raw = std::max(raw, (size_t)r * in);
            xv_d = std::max(xv_d, (size_t)r * (in / 16) * (integer ? kXq : 32));
            yraw = std::max(yraw, (size_t)r * h);
            qs_gu = std::max(qs_gu, (size_t)r * 2 * (h / kHad));
            qs_d = std::max(qs_d, (size_t)r * 2 * (in / kHad));
            acc = std::max(acc, (size_t)r * std::max(s.chunk_gu, s.chunk_d) * kAccFloats);
        }
        const Tables& tab = tables();
        if (!tab.error.empty()) return fail(-3, "decode tables: " + tab.error);
        try {
            xv_[0].reserve(xv_gu);
            xv_[1].reserve(xv_gu);
            raw_[0].reserve(raw);
            raw_[1].reserve(raw);
            xv_[2].reserve(xv_d);
            yraw_.reserve(yraw);
            if (integer) {
                qs_[0].reserve(qs_gu);
                qs_[1].reserve(qs_gu);
                qs_[2].reserve(qs_d);
            }
            for (auto& w : workers_) {
                w.acc.reserve(acc);
                w.wbuf.reserve(kTileBlock * kTileElems);
            }
            counters_ = std::vector<std::atomic<int>>(std::max<size_t>(1, ncounters));
            for (int j = 0; j < njobs; ++j) {
                const Shape& s = call_.shapes[j];
                std::atomic<int>* ctr = &counters_[s.counters];
                ctr[kCtrOutDone].store(s.hidden / kHad, std::memory_order_relaxed);
                for (int b = 0; b < s.inter / kHad; ++b)
                    ctr[kCtrBlocks + b].store(2 * std::max(1, 8 / s.chunk_gu), std::memory_order_relaxed);
                for (int b = 0; b < s.hidden / kHad; ++b)
                    ctr[kCtrBlocks + s.inter / kHad + b].store(std::max(1, 8 / s.chunk_d), std::memory_order_relaxed);
            }
        } catch (const std::bad_alloc&) {
            return fail(-4, "out of memory for the kernel's scratch buffers");
        }
        finished_.store(0, std::memory_order_relaxed);
        left_.store(0, std::memory_order_relaxed);
        complete_.store(0, std::memory_order_relaxed);
        call_t0_ = now_ns();
        // Workers about to sleep count themselves in sleepers_ and check gen_ again; the caller bumps gen_ and then
        // checks sleepers_: both seq_cst, so a worker either sees the new call or gets woken.
        gen_.fetch_add(1, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(gen_, INT_MAX);
        // The call returns once its last output is written (or, cancelled, once every worker has stopped): a worker
        // that wakes late finds no work left and leaves on its own, and the next call waits for it (drain).
        while (!complete_.load(std::memory_order_acquire)) {
            caller_waits_.store(1, std::memory_order_seq_cst);
            if (!complete_.load(std::memory_order_seq_cst)) futex_wait(complete_, 0);
            caller_waits_.store(0, std::memory_order_relaxed);
        }
        const int64_t t1 = now_ns();
        call_ns_ = t1 - call_t0_;
        return_ns_ = t1 - complete_ns_.load(std::memory_order_relaxed);
        return *call_.cancel ? 1 : 0;
    }

    // The last call's profile: {wall ns, ns from its outputs' completion to the caller's return, kPhases, then
    // kPhases values per worker}. Returns how many values that is (written only if cap allows).
    int profile(int64_t* out, int cap) {
        std::lock_guard<std::mutex> one_call(call_m_);
        drain();
        const int need = 3 + n_ * kPhases;
        if (!out || cap < need) return need;
        out[0] = call_ns_;
        out[1] = return_ns_;
        out[2] = kPhases;
        for (int t = 0; t < n_; ++t)
            for (int p = 0; p < kPhases; ++p) out[3 + t * kPhases + p] = workers_[t].phase_ns[p];
        return need;
    }

private:
    struct Worker {
        Buf acc, wbuf;
        int64_t phase_ns[kPhases] = {};  // the last call's (Phase)
    };
    struct Call {
        std::vector<Glm53Job> jobs;
        int njobs = 0;
        const IsaOps* ops = nullptr;
        bool integer = false;  // the integer kernel (GLM53_KERNEL_INT)
        const volatile int32_t* cancel = nullptr;
        volatile int32_t* done = nullptr;
        std::vector<Shape> shapes;
    };

    void loop(int tid) {
        if (!cpus_.empty()) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus_[tid % cpus_.size()], &set);
            // A container may forbid some CPUs: then this thread runs unpinned, which is only slower.
            if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) pinned_.fetch_add(1);
        }
        started_.fetch_add(1, std::memory_order_release);
        uint32_t seen = 0;
        for (;;) {
            // Spin briefly for the next call (a layer's experts come back to back), then sleep.
            const auto t0 = std::chrono::steady_clock::now();
            while (gen_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_acquire)) {
                if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_)) {
                    sleepers_.fetch_add(1, std::memory_order_seq_cst);
                    if (gen_.load(std::memory_order_seq_cst) == seen) futex_wait(gen_, seen);
                    sleepers_.fetch_sub(1, std::memory_order_relaxed);
                    continue;  // woken (or spuriously): look again
                }
                for (int i = 0; i < 64; ++i) cpu_relax();
            }
            if (stop_.load(std::memory_order_acquire)) return;
            seen = gen_.load(std::memory_order_acquire);
            execute(tid);
            if (left_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) complete();  // a cancelled call ends here
            finished_.fetch_add(1, std::memory_order_release);  // from here on this worker touches nothing of the call
        }
    }

    // The call's outputs are all written, or every worker has left it: let the caller return.
    void complete() {
        complete_ns_.store(now_ns(), std::memory_order_relaxed);
        complete_.store(1, std::memory_order_seq_cst);
        if (caller_waits_.load(std::memory_order_seq_cst)) futex_wake(complete_, 1);
    }

    // Until every worker has left the previous call (they leave soon after its outputs are done), nothing it reads
    // may change.
    void drain() {
        spin_until([&] { return finished_.load(std::memory_order_acquire) == (uint32_t)n_; });
    }

    // Spin until done() holds or the call is cancelled (a cancelled call's units stop counting).
    template <class F>
    void wait_until(F&& done) {
        spin_until([&] { return done() || *call_.cancel; });
    }

    template <class F>
    static void spin_until(F&& done) {
        for (long spins = 0; !done(); ++spins) {
            if (spins < 20000)
                cpu_relax();
            else
                std::this_thread::yield();  // more threads than free cores: let the others finish their units
        }
    }

    // Units from `counter` until none are left; each finished one counts in `finished` (if given).
    template <class F>
    void share(std::atomic<int>& counter, int units, std::atomic<int>* finished, F&& work) {
        for (int u; (u = counter.fetch_add(1, std::memory_order_relaxed)) < units;) {
            if (*call_.cancel) return;
            work(u);
            if (finished) finished->fetch_add(1, std::memory_order_release);
        }
    }

    // Two waits per expert, each for units done rather than for threads arriving, so a worker that wakes late or
    // is descheduled holds up only the units it took: before the gate/up units, the input transforms (every
    // gate/up unit reads all of them) and the previous expert's down units and output transforms (this expert's
    // mid steps and down units overwrite what they read); before the down units, the gate/up units with their mid
    // steps (every down unit reads all of the intermediate). The mid step of a 128-block and the output transform of
    // a 128-block run on whichever thread finishes the block's last GEMV unit (a counter per block), and the next
    // expert's input transforms follow at once (they write buffers no unit still running reads).
    void execute(int tid) {
        const Call& c = call_;
        const IsaOps& ops = *c.ops;
        const Tables& tab = tables();
        Worker& w = workers_[tid];
        int64_t* ph = w.phase_ns;
        int64_t t = now_ns();
        for (int p = 0; p < kPhases; ++p) ph[p] = 0;
        ph[kPhWake] = t - call_t0_;
        const auto lap = [&](int phase) {
            const int64_t now = now_ns();
            ph[phase] += now - t;
            t = now;
        };
        const std::atomic<int>* prev_out = nullptr;  // the previous expert's output blocks still to finish
        for (int j = 0; j < c.njobs; ++j) {
            const Glm53Job& job = c.jobs[j];
            const Shape& s = c.shapes[j];
            std::atomic<int>* ctr = &counters_[s.counters];
            std::atomic<int>* mid_left = ctr + kCtrBlocks;
            std::atomic<int>* out_left = mid_left + s.inter / kHad;
            const int h = s.hidden, in = s.inter, r = s.rows, hb = h / kHad;
            const Glm53Linear* gu[2] = {&job.gate, &job.up};

            const int nprep = 2 * r * hb, ngu = 2 * s.nchunk_gu;
            share(ctr[kCtrPrep], nprep, &ctr[kCtrPrepDone], [&](int u) {
                const int lin = u / (r * hb), row = u / hb % r, b = u % hb;
                float* xv = xv_[lin].p + ((size_t)row * (h / 16) + 8 * b) * (c.integer ? kXq : 32);
                if (c.integer)
                    ops.prep_block_q(job.x + (size_t)row * h + kHad * b, gu[lin]->suh + kHad * b,
                                     reinterpret_cast<int32_t*>(xv), qs_[lin].p + ((size_t)row * hb + b) * 2);
                else
                    ops.prep_block(job.x + (size_t)row * h + kHad * b, gu[lin]->suh + kHad * b, xv);
            });
            lap(kPhPrep);
            wait_until([&] {
                return ctr[kCtrPrepDone].load(std::memory_order_acquire) == nprep &&
                       (!prev_out || prev_out->load(std::memory_order_acquire) == 0);
            });
            lap(kPhWait1);
            share(ctr[kCtrGateUp], ngu, &ctr[kCtrGateUpDone], [&](int u) {
                const int lin = u / s.nchunk_gu, tn0 = u % s.nchunk_gu * s.chunk_gu;
                const int tn1 = std::min(in / 16, tn0 + s.chunk_gu);
                gemv(*gu[lin], tab, xv_[lin].p, qs_[lin].p, r, tn0, tn1, w, raw_[lin].p, in);
                for (int b = tn0 / 8; b * 8 < tn1; ++b)
                    if (mid_left[b].fetch_sub(1, std::memory_order_acq_rel) == 1 && !*c.cancel)
                        for (int row = 0; row < r; ++row) {
                            const size_t off = (size_t)row * in + kHad * b;
                            float* xv = xv_[2].p + ((size_t)row * (in / 16) + 8 * b) * (c.integer ? kXq : 32);
                            if (c.integer)
                                ops.mid_block_q(raw_[0].p + off, raw_[1].p + off, job.gate.svh + kHad * b,
                                                job.up.svh + kHad * b, job.down.suh + kHad * b, job.swiglu_limit,
                                                reinterpret_cast<int32_t*>(xv),
                                                qs_[2].p + ((size_t)row * (in / kHad) + b) * 2);
                            else
                                ops.mid_block(raw_[0].p + off, raw_[1].p + off, job.gate.svh + kHad * b,
                                              job.up.svh + kHad * b, job.down.suh + kHad * b, job.swiglu_limit, xv);
                        }
            });
            lap(kPhGateUp);
            wait_until([&] { return ctr[kCtrGateUpDone].load(std::memory_order_acquire) == ngu; });
            lap(kPhWait2);
            share(ctr[kCtrDown], s.nchunk_d, nullptr, [&](int u) {
                const int tn0 = u * s.chunk_d, tn1 = std::min(h / 16, tn0 + s.chunk_d);
                gemv(job.down, tab, xv_[2].p, qs_[2].p, r, tn0, tn1, w, yraw_.p, h);
                for (int b = tn0 / 8; b * 8 < tn1; ++b) {
                    if (out_left[b].fetch_sub(1, std::memory_order_acq_rel) != 1 || *c.cancel) continue;
                    for (int row = 0; row < r; ++row) {
                        const size_t off = (size_t)row * h + kHad * b;
                        ops.out_block(yraw_.p + off, job.down.svh + kHad * b, job.out + off);
                    }
                    // Done only if no unit of the job was skipped: cancellation only ever goes 0 -> 1, and a
                    // skipped unit never counts down, so then this is not reached for every block.
                    if (ctr[kCtrOutDone].fetch_sub(1, std::memory_order_acq_rel) != 1 || *c.cancel) continue;
                    if (c.done) __atomic_store_n(&c.done[j], 1, __ATOMIC_RELEASE);
                    if (j == c.njobs - 1) complete();  // every earlier expert finished before this one's mid steps
                }
            });
            lap(kPhDown);
            prev_out = &ctr[kCtrOutDone];
        }
    }

    void gemv(const Glm53Linear& l, const Tables& tab, const float* xv, const float* qs, int rows, int tn0, int tn1,
              Worker& w, float* yraw, int ystride) {
        GemvArgs a;
        a.tab = &tab.k[l.k_bits];
        a.trellis = reinterpret_cast<const uint8_t*>(l.trellis);
        a.tiles_k = l.in_features / 16;
        a.tiles_n = l.out_features / 16;
        a.tile_bytes = 32 * l.k_bits;
        a.xv = xv;
        a.rows = rows;
        a.tn0 = tn0;
        a.tn1 = tn1;
        a.acc = w.acc.p;
        a.wbuf = w.wbuf.p;
        a.yraw = yraw;
        a.ystride = ystride;
        a.cancel = call_.cancel;
        a.qs = qs;
        if (call_.integer)
            call_.ops->gemv_cols_q(a);
        else
            call_.ops->gemv_cols(a);
    }

    const int n_;
    const int spin_us_;
    std::vector<int> cpus_;
    std::vector<Worker> workers_;
    std::vector<std::thread> threads_;
    std::atomic<int> started_{0}, pinned_{0};

    std::atomic<uint32_t> gen_{0};     // the call's number (a futex word: idle workers sleep on it)
    std::atomic<int> sleepers_{0};     // workers asleep or about to sleep on gen_
    std::atomic<bool> stop_{false};
    std::atomic<int> left_{0};           // workers out of the call's work
    std::atomic<uint32_t> finished_{0};  // workers done with the last call (n_ when none is running)
    std::atomic<uint32_t> complete_{0};  // the call's outputs are written (a futex word: the caller sleeps on it)
    std::atomic<int64_t> complete_ns_{0};
    std::atomic<int> caller_waits_{0};

    std::mutex call_m_;  // one call at a time
    Call call_;
    int64_t call_t0_ = 0, call_ns_ = 0, return_ns_ = 0;  // the last call's start, wall time, caller's wake-up
    std::vector<std::atomic<int>> counters_;
    Buf xv_[3], raw_[2], yraw_, qs_[3];  // qs_: the integer kernel's block scales (gate, up, down)

};

}  // namespace
}  // namespace glm53

// ---------------------------------------------------------------------------------------------------------------
// C ABI

using glm53::Pool;

#define GLM53_API extern "C" __attribute__((visibility("default")))

GLM53_API int glm53_abi_version(void) { return 1; }

GLM53_API const char* glm53_source_hash(void) { return GLM53_SRC_HASH; }

GLM53_API const char* glm53_last_error(void) { return glm53::t_error.c_str(); }

GLM53_API int glm53_isa_supported(int isa) { return glm53::ops_for(isa) != nullptr; }

GLM53_API const char* glm53_isa_name(int isa) {
    const glm53::IsaOps* ops = glm53::ops_for(isa);
    return ops ? ops->name : "";
}

GLM53_API void* glm53_pool_new(int threads, const int32_t* cpus, int ncpus, int spin_us) {
    if (threads < 1 || threads > 4096) {
        glm53::fail(-2, "threads must be 1..4096");
        return nullptr;
    }
    try {
        return new Pool(threads, cpus, ncpus, spin_us);
    } catch (const std::exception& e) {
        glm53::fail(-4, std::string("cannot start the thread pool: ") + e.what());
        return nullptr;
    }
}

GLM53_API void glm53_pool_free(void* pool) { delete static_cast<Pool*>(pool); }

GLM53_API int glm53_pool_threads(void* pool) { return static_cast<Pool*>(pool)->threads(); }

GLM53_API int glm53_pool_pinned(void* pool) { return static_cast<Pool*>(pool)->pinned(); }

// The last call's time profile (Pool::profile); returns the number of values, writing them if cap allows.
GLM53_API int glm53_pool_profile(void* pool, int64_t* out, int cap) {
    return static_cast<Pool*>(pool)->profile(out, cap);
}

// Run njobs experts in order, with the ISA's exact kernel or, with GLM53_KERNEL_INT in `isa`, its integer one.
// done[j] (optional) becomes 1 once job j's output is complete; *cancel (optional)
// going non-zero stops the call at the next work unit. Returns 0, 1 (cancelled) or < 0 (see glm53_last_error).
GLM53_API int glm53_run(void* pool, const Glm53Job* jobs, int njobs, int isa, const volatile int32_t* cancel,
                        volatile int32_t* done) {
    if (!pool) return glm53::fail(-2, "no pool");
    if (njobs < 0 || (njobs > 0 && !jobs)) return glm53::fail(-2, "bad job list");
    const glm53::IsaOps* ops = glm53::ops_for(isa);
    if (!ops) return glm53::fail(-2, "ISA " + std::to_string(isa) + " is not supported by this CPU");
    if (njobs == 0) return 0;
    try {
        return static_cast<Pool*>(pool)->run(jobs, njobs, ops, (isa & GLM53_KERNEL_INT) != 0, cancel, done);
    } catch (const std::exception& e) {
        return glm53::fail(-4, std::string("kernel failed: ") + e.what());
    }
}

// Decode a whole trellis (in/16, out/16, 16K) into the inner weight W^ (in x out, fp32 of the fp16 values), with
// the given ISA's tile decoder: the tests compare it bit for bit with the numpy reference and exllamav3's output.
GLM53_API int glm53_decode_linear(const int16_t* trellis, int in, int out, int k, int isa, float* w) {
    const glm53::IsaOps* ops = glm53::ops_for(isa);
    if (!ops) return glm53::fail(-2, "ISA not supported by this CPU");
    if (k < 1 || k > 8 || in % 16 || out % 16 || in <= 0 || out <= 0) return glm53::fail(-2, "bad trellis shape");
    const glm53::Tables& tab = glm53::tables();
    if (!tab.error.empty()) return glm53::fail(-3, "decode tables: " + tab.error);
    alignas(64) float tile[glm53::kTileElems];
    const int tn_count = out / 16;
    for (int tk = 0; tk < in / 16; ++tk)
        for (int tn = 0; tn < tn_count; ++tn) {
            ops->decode_tile(tab.k[k], reinterpret_cast<const uint8_t*>(trellis) + ((size_t)tk * tn_count + tn) * 32 * k,
                             tile);
            for (int t = 0; t < glm53::kTileElems; ++t) {
                const int g = t / 8, j = t % 8;
                const int row = 2 * (g % 4) + (j & 1) + 8 * ((j >> 1) & 1), col = g / 4 + 8 * (j >> 2);
                w[(size_t)(16 * tk + row) * out + 16 * tn + col] = tile[t];
            }
        }
    return 0;
}
