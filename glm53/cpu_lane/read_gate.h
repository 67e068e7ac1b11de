// A guess read's gate, shared by parallel_read.cpp (which calls it) and read_queue.cpp (which makes it): called
// before each chunk of a part, it may block (while a read a step waits for is under way) and says false when the
// read was called off.
#pragma once
#include <cstdint>

struct Glm53ReadGate {
    bool (*pass)(void* ctx);
    void* ctx;
    int64_t chunk;  // bytes read between two calls (a multiple of the store's alignment)
};

extern "C" int64_t glm53_pread_parts_gated(int fd, void* buf, int64_t length, int64_t offset, int32_t parts,
                                           int32_t align, int32_t* err, void* hash, uint64_t* hashes, int32_t* used,
                                           const Glm53ReadGate* gate);
