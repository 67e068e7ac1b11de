// The store library's C ABI (store/_native*.so, loaded with ctypes by store/native.py): the parallel pread
// (parallel_read.cpp), the read queue (read_queue.cpp) and the read hook. Nothing here depends on glm53.
#pragma once
#include <stddef.h>
#include <stdint.h>

#define GLM53_API extern "C" __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// A bench's hook on every part read (glm53_store_set_read_hook); not called for a part whose pread failed.
typedef void (*glm53_read_hook_fn)(int64_t bytes, int64_t began_ns);

#ifdef __cplusplus
}
#endif

// Installs `hook` (NULL: none) and returns the previous one. Called on the read thread after each part's
// pread loop finishes, with the bytes it read and the steady_clock time in ns at which that part's read began,
// before the part counts as done. The product never installs one; benches do.
GLM53_API glm53_read_hook_fn glm53_store_set_read_hook(glm53_read_hook_fn hook);

// Reads `length` bytes at `offset` into `buf` as `parts` pieces (parallel_read.cpp says more).
GLM53_API int64_t glm53_pread_parts(int fd, void* buf, int64_t length, int64_t offset, int32_t parts, int32_t align,
                                    int32_t* err, void* hash, uint64_t* hashes, int32_t* used);

// ABI version (store/native.py's ABI_VERSION) and the hash of the sources the library was built from.
GLM53_API int32_t glm53_store_abi_version();
GLM53_API const char* glm53_store_source_hash();
