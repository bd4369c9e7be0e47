/*
 * reduce.c - element-wise reductions for the collectives: acc = acc op src.
 *
 * One kernel per (dtype, op), generated from the two lists below (NCCL's
 * generate.py, in macros). Every loop is a plain `for` over restrict pointers
 * with a branch-free body, so gcc -O3 vectorises it (built with -O3 on its
 * own: src_c/meson.build and src_c/Makefile; check with -fopt-info-vec).
 *
 * Determinism: float16 and bfloat16 are widened to float32 per element,
 * combined once, and rounded back to nearest-even at EVERY step, so
 * reducing a, b, c in that order gives the same bits on every machine and in
 * every schedule (the executor always reduces in rank order). Integers wrap
 * (two's complement, computed in the unsigned type: no undefined overflow).
 * AVG combines as SUM; mrc_reduce_finish() divides by n once at the end
 * (integers: C division, truncating toward zero).
 */
#include <stdint.h>
#include <string.h>

#include "mrc.h"

/* ---- float16 / bfloat16 <-> float32 -------------------------------------- */

static inline uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* All ones when c holds: selects without a branch, so the loops stay
 * straight-line and vectorise (a ?: here is "control flow" to gcc). */
static inline uint32_t mask(int c) { return 0u - (uint32_t)c; }

/* Exact. The exponent is rebiased by one multiply by 2^112, which also turns
 * half subnormals into normal floats; Inf/NaN keep an all-ones exponent. */
static inline float h2f(uint16_t h)
{
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13;
    float f = u2f(em) * 0x1p112f;
    uint32_t special = mask((h & 0x7fffu) >= 0x7c00u);
    uint32_t u = (f2u(f) & ~special) | ((em | 0x7f800000u) & special);
    return u2f(u | ((uint32_t)(h & 0x8000u) << 16));
}

/* Round to nearest, ties to even (IEEE default, as numpy's astype(float16)).
 * Overflow gives Inf, NaN a quiet NaN. Subnormal results: adding a magic
 * float whose ulp is the half subnormal step makes the FPU do the rounding. */
static inline uint16_t f2h(float f)
{
    uint32_t u = f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    const float magic = u2f((uint32_t)((127 - 15) + (23 - 10) + 1) << 23);
    uint32_t sub = f2u(u2f(u) + magic) - f2u(magic);
    uint32_t odd = (u >> 13) & 1u;
    uint32_t norm = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13;
    uint32_t big = 0x7c00u | (mask(u > 0x7f800000u) & 0x0200u); /* Inf, or quiet NaN */
    uint32_t m_big = mask(u >= ((uint32_t)(127 + 16) << 23));
    uint32_t m_sub = mask(u < (113u << 23)) & ~m_big;
    uint32_t o = (big & m_big) | (sub & m_sub) | (norm & ~(m_big | m_sub));
    return (uint16_t)(o | sign);
}

static inline float b2f(uint16_t b) { return u2f((uint32_t)b << 16); }

static inline uint16_t f2b(float f)
{
    uint32_t u = f2u(f);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? ((u >> 16) | 0x40u) : r);
}

/* ---- kernels ------------------------------------------------------------- */

#define K_SUM(x, y) ((x) + (y))
#define K_PROD(x, y) ((x) * (y))
#define K_MIN(x, y) ((y) < (x) ? (y) : (x))
#define K_MAX(x, y) ((y) > (x) ? (y) : (x))

/* Integers: combine in the unsigned type U (wraps, no UB), store as T. */
#define INT_KERNEL(name, T, U, K)                                                  \
    static void name(void *restrict acc_, const void *restrict src_, size_t n)     \
    {                                                                              \
        T *restrict acc = acc_;                                                    \
        const T *restrict src = src_;                                              \
        for (size_t i = 0; i < n; i++)                                             \
            acc[i] = (T)K((U)acc[i], (U)src[i]);                                   \
    }
/* min/max compare the signed values. */
#define CMP_KERNEL(name, T, K)                                                     \
    static void name(void *restrict acc_, const void *restrict src_, size_t n)     \
    {                                                                              \
        T *restrict acc = acc_;                                                    \
        const T *restrict src = src_;                                              \
        for (size_t i = 0; i < n; i++)                                             \
            acc[i] = K(acc[i], src[i]);                                            \
    }
/* 16-bit floats: widen, combine in float32, round back, every element. */
#define HALF_KERNEL(name, TOF, FROMF, K)                                           \
    static void name(void *restrict acc_, const void *restrict src_, size_t n)     \
    {                                                                              \
        uint16_t *restrict acc = acc_;                                             \
        const uint16_t *restrict src = src_;                                       \
        for (size_t i = 0; i < n; i++)                                             \
            acc[i] = FROMF(K(TOF(acc[i]), TOF(src[i])));                           \
    }

#define INT_TYPE(tname, T, U)                                                      \
    INT_KERNEL(tname##_sum, T, U, K_SUM)                                           \
    INT_KERNEL(tname##_prod, T, U, K_PROD)                                         \
    CMP_KERNEL(tname##_min, T, K_MIN)                                              \
    CMP_KERNEL(tname##_max, T, K_MAX)
#define FLOAT_TYPE(tname, T)                                                       \
    CMP_KERNEL(tname##_sum, T, K_SUM)                                              \
    CMP_KERNEL(tname##_prod, T, K_PROD)                                            \
    CMP_KERNEL(tname##_min, T, K_MIN)                                              \
    CMP_KERNEL(tname##_max, T, K_MAX)
#define HALF_TYPE(tname, TOF, FROMF)                                               \
    HALF_KERNEL(tname##_sum, TOF, FROMF, K_SUM)                                    \
    HALF_KERNEL(tname##_prod, TOF, FROMF, K_PROD)                                  \
    HALF_KERNEL(tname##_min, TOF, FROMF, K_MIN)                                    \
    HALF_KERNEL(tname##_max, TOF, FROMF, K_MAX)

INT_TYPE(i8, int8_t, uint8_t)
INT_TYPE(u8, uint8_t, uint8_t)
INT_TYPE(i32, int32_t, uint32_t)
INT_TYPE(i64, int64_t, uint64_t)
HALF_TYPE(f16, h2f, f2h)
HALF_TYPE(bf16, b2f, f2b)
FLOAT_TYPE(f32, float)
FLOAT_TYPE(f64, double)

typedef void (*reduce_fn)(void *restrict, const void *restrict, size_t);

/* Indexed [dtype][op]; AVG combines as SUM. Order: enum mrc_dtype, mrc_redop. */
#define ROW(t) {t##_sum, t##_prod, t##_min, t##_max, t##_sum}
static const reduce_fn kernels[MRC_NDTYPES][MRC_NREDOPS] = {
    ROW(i8), ROW(u8), ROW(i32), ROW(i64), ROW(f16), ROW(bf16), ROW(f32), ROW(f64),
};

static const struct {
    const char *name;
    size_t size;
} dtypes[MRC_NDTYPES] = {
    {"int8", 1}, {"uint8", 1}, {"int32", 4}, {"int64", 8},
    {"float16", 2}, {"bfloat16", 2}, {"float32", 4}, {"float64", 8},
};

static const char *const redops[MRC_NREDOPS] = {"sum", "prod", "min", "max", "avg"};

size_t mrc_dtype_size(int dtype)
{
    return dtype >= 0 && dtype < MRC_NDTYPES ? dtypes[dtype].size : 0;
}

const char *mrc_dtype_str(int dtype)
{
    return dtype >= 0 && dtype < MRC_NDTYPES ? dtypes[dtype].name : "?";
}

const char *mrc_redop_str(int op) { return op >= 0 && op < MRC_NREDOPS ? redops[op] : "?"; }

int mrc_reduce(void *acc, const void *src, size_t count, int dtype, int op)
{
    if (dtype < 0 || dtype >= MRC_NDTYPES || op < 0 || op >= MRC_NREDOPS)
        return MRC_EUSAGE;
    if (count)
        kernels[dtype][op](acc, src, count);
    return 0;
}

/* ---- AVG: divide once, after the sum in rank order ----------------------- */

/* a / n with n an int: integer promotion keeps n exact for the 8-bit types. */
#define DIV(T, acc, count, n)                                                      \
    do {                                                                           \
        T *a_ = (acc);                                                             \
        for (size_t i = 0; i < (count); i++)                                       \
            a_[i] = (T)(a_[i] / (n));                                              \
    } while (0)

int mrc_reduce_finish(void *acc, size_t count, int dtype, int op, int n)
{
    if (dtype < 0 || dtype >= MRC_NDTYPES || op < 0 || op >= MRC_NREDOPS || n < 1)
        return MRC_EUSAGE;
    if (op != MRC_AVG || n == 1)
        return 0;
    switch (dtype) {
    case MRC_INT8: DIV(int8_t, acc, count, n); break;
    case MRC_UINT8: DIV(uint8_t, acc, count, n); break;
    case MRC_INT32: DIV(int32_t, acc, count, n); break;
    case MRC_INT64: DIV(int64_t, acc, count, n); break;
    case MRC_FLOAT32: DIV(float, acc, count, n); break;
    case MRC_FLOAT64: DIV(double, acc, count, n); break;
    case MRC_FLOAT16: {
        uint16_t *a = acc;
        for (size_t i = 0; i < count; i++)
            a[i] = f2h(h2f(a[i]) / (float)n);
        break;
    }
    case MRC_BFLOAT16: {
        uint16_t *a = acc;
        for (size_t i = 0; i < count; i++)
            a[i] = f2b(b2f(a[i]) / (float)n);
        break;
    }
    }
    return 0;
}
