// One store record read as several parallel preads on native threads, for store.reader.
//
// A Python reader thread that reads a record's parts itself takes the GIL back after every pread and for its
// bookkeeping between them; each of those hand-offs can stall the engine's main thread, which plans every MoE
// layer step while the GPU waits (measured on a 2-core host: the main thread's step-like work took 1.9x as long
// with records read as 4 Python-level parts, 1.35x with one native call per record). Here the caller makes one
// call per record, with the GIL released (ctypes), and the parts run on short-lived threads.
//
// Each part may also be hashed by the thread that read it, while its bytes are still in that core's cache: a
// record checked as one 9 MiB hash after the read costs a demand read about as much again on a fast store
// (0.27 ms on the H200 host against 0.58 ms for the read from RAM). The hash function is the caller's (the xxhash
// library Python already loaded), so this file carries no hash of its own.
#include <cerrno>
#include <cstdint>
#include <thread>
#include <vector>

#include <unistd.h>

#define GLM53_API extern "C" __attribute__((visibility("default")))

namespace {

// Reads until `len` bytes are in or EOF; returns the bytes read, or -1 with *err set.
int64_t read_all(int fd, char* buf, int64_t len, int64_t offset, int32_t* err) {
    int64_t done = 0;
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
    return done;
}

using HashFn = uint64_t (*)(const void*, size_t);

// read_all, then the part's hash into *hash when asked and the part came in whole.
int64_t read_part(int fd, char* buf, int64_t len, int64_t offset, int32_t* err, HashFn hash, uint64_t* out) {
    int64_t got = read_all(fd, buf, len, offset, err);
    if (hash != nullptr && out != nullptr && got == len) *out = hash(buf, static_cast<size_t>(len));
    return got;
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
    // none may leave it with a thread still joinable (std::terminate).
    std::vector<int64_t> got;
    std::vector<int32_t> errs;
    std::vector<std::thread> threads;
    try {
        got.assign(parts, 0);
        errs.assign(parts, 0);
        threads.reserve(parts - 1);
    } catch (...) {  // no memory for the bookkeeping: one plain read
        if (used != nullptr) *used = 1;
        return read_part(fd, base, length, offset, err, h, hashes);
    }
    for (int32_t i = 1; i < parts; ++i) {
        int64_t start = i * size, n = i < parts - 1 ? size : length - start;
        try {  // after reserve() a failed emplace_back leaves `threads` as it was
            threads.emplace_back([=, &got, &errs] {
                got[i] = read_part(fd, base + start, n, offset + start, &errs[i], h, hashes == nullptr ? nullptr : hashes + i);
            });
        } catch (...) {  // no thread to be had (std::system_error, or std::bad_alloc for its state): this one reads it
            got[i] = read_part(fd, base + start, n, offset + start, &errs[i], h, hashes == nullptr ? nullptr : hashes + i);
        }
    }
    got[0] = read_part(fd, base, size, offset, &errs[0], h, hashes);
    for (auto& t : threads) t.join();
    int64_t total = 0;
    for (int32_t i = 0; i < parts; ++i) {
        if (got[i] < 0) {
            *err = errs[i];
            return -1;
        }
        total += got[i];
    }
    return total;
}
