/* murmur3's 64-bit finalizer, shared by kvstrata's C fast paths: the slot index's hash
 * (logical/_slots.c) and the device checksum (_tokenhash.c, the function the GPU copy kernel
 * computes in physical/_triton_copy.py). */
#ifndef KVSTRATA_MIX64_H
#define KVSTRATA_MIX64_H

#include <stdint.h>

static inline uint64_t kvstrata_mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDULL;
    k ^= k >> 33;
    k *= 0xC4CEB9FE1A85EC53ULL;
    k ^= k >> 33;
    return k;
}

#endif
