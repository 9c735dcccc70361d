/* dcp_hash: per-block XXH3-64 checksums for dcp_datastates, called through ctypes.
 *
 * The Python binding of xxHash holds the GIL while it hashes, so checksum threads contend with
 * the training loop and with each other; ctypes releases the GIL around this call, so blocks are
 * hashed on all I/O threads at once. xxHash itself comes from its header (XXH_INLINE_ALL), so the
 * library needs only libc at run time. The digests equal xxhash.xxh3_64_intdigest's.
 */
#define XXH_INLINE_ALL
#include <stddef.h>
#include <stdint.h>
#include <xxhash.h>

#define DSH_API __attribute__((visibility("default")))

/* XXH3-64 of each `block`-byte block of `nbytes` at `data` into `out` (one digest, of the empty
 * input, when nbytes is 0); `out` holds ceil(nbytes / block) digests, at least one. */
DSH_API void dsh_xxh3_blocks(const void *data, size_t nbytes, size_t block, uint64_t *out) {
    const unsigned char *p = data;
    if (nbytes == 0) {
        out[0] = XXH3_64bits(p, 0);
        return;
    }
    for (size_t off = 0; off < nbytes; off += block) {
        size_t n = nbytes - off < block ? nbytes - off : block;
        *out++ = XXH3_64bits(p + off, n);
    }
}

/* The block digests of `count` regions (addrs[i], sizes[i]), one region after the other, into
 * `out` (ceil(sizes[i] / block) digests for each region, one for an empty one): a task of many
 * items is one call, so its thread takes the GIL back once, not once per item. */
DSH_API void dsh_xxh3_regions(size_t count, const uint64_t *addrs, const size_t *sizes,
                              size_t block, uint64_t *out) {
    for (size_t i = 0; i < count; i++) {
        dsh_xxh3_blocks((const void *)(uintptr_t)addrs[i], sizes[i], block, out);
        out += sizes[i] ? (sizes[i] + block - 1) / block : 1;
    }
}
