/*
 * test_reduce.c - every dtype x op of mrc_reduce()/mrc_reduce_finish()
 * against an independent scalar reference: wide integer arithmetic taken
 * modulo 2^bits, gcc's _Float16 for float16, a nearest-candidate search for
 * bfloat16. Three sources reduced in order, like three ranks.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "mrc.h"

#define N 1037 /* not a multiple of any vector width */
#define NSRC 3

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float bf2f(uint16_t b) { return u2f((uint32_t)b << 16); }

/* The bfloat16 nearest to f (ties: even mantissa), by comparing the two
 * candidates around it in double precision. Finite inputs only. */
static uint16_t ref_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double dl = fabs((double)f - (double)bf2f(lo)), dh = fabs((double)f - (double)bf2f(hi));
    if ((u & 0xffff) == 0)
        return lo;
    if (dl < dh)
        return lo;
    if (dh < dl)
        return hi;
    return (lo & 1) ? hi : lo;
}

static double comb(double x, double y, int op)
{
    switch (op) {
    case MRC_PROD: return x * y;
    case MRC_MIN: return y < x ? y : x;
    case MRC_MAX: return y > x ? y : x;
    default: return x + y;
    }
}

/* Integer reference: in int64/uint64, then wrapped to `bits`. */
static int64_t wrap(uint64_t v, int bits, int is_signed)
{
    if (bits == 64)
        return (int64_t)v;
    uint64_t m = (1ull << bits) - 1;
    v &= m;
    if (is_signed && (v >> (bits - 1)))
        return (int64_t)(v | ~m);
    return (int64_t)v;
}

static int64_t icomb(int64_t x, int64_t y, int op, int bits, int sgn)
{
    switch (op) {
    case MRC_PROD: return wrap((uint64_t)x * (uint64_t)y, bits, sgn);
    case MRC_MIN: return y < x ? y : x;
    case MRC_MAX: return y > x ? y : x;
    default: return wrap((uint64_t)x + (uint64_t)y, bits, sgn);
    }
}

static void test_int(int dtype, int bits, int sgn)
{
    size_t es = mrc_dtype_size(dtype);
    for (int op = 0; op < MRC_NREDOPS; op++) {
        uint8_t src[NSRC][N * 8], acc[N * 8];
        for (int s = 0; s < NSRC; s++)
            for (size_t i = 0; i < N * es; i++)
                src[s][i] = (uint8_t)next();
        memcpy(acc, src[0], N * es);
        for (int s = 1; s < NSRC; s++)
            CHECK_RC(mrc_reduce(acc, src[s], N, dtype, op));
        CHECK_RC(mrc_reduce_finish(acc, N, dtype, op, NSRC));
        for (size_t i = 0; i < N; i++) {
            int64_t v[NSRC], got = 0;
            for (int s = 0; s < NSRC; s++) {
                uint64_t raw = 0;
                memcpy(&raw, src[s] + i * es, es);
                v[s] = wrap(raw, bits, sgn);
            }
            uint64_t graw = 0;
            memcpy(&graw, acc + i * es, es);
            got = wrap(graw, bits, sgn);
            int64_t r = v[0];
            for (int s = 1; s < NSRC; s++)
                r = icomb(r, v[s], op, bits, sgn);
            if (op == MRC_AVG)
                r = wrap((uint64_t)(r / NSRC), bits, sgn);
            if (got != r) {
                fprintf(stderr, "%s %s [%zu]: got %lld want %lld\n", mrc_dtype_str(dtype),
                        mrc_redop_str(op), i, (long long)got, (long long)r);
                CHECK(0);
            }
        }
    }
}

static float rnd_float(void) { return (float)((int64_t)(next() % 20001) - 10000) / 997.0f; }

static void test_f32_f64(void)
{
    for (int op = 0; op < MRC_NREDOPS; op++) {
        float a[N], b[N], c[N];
        double da[N], db[N], dc[N];
        for (int i = 0; i < N; i++) {
            a[i] = rnd_float(), b[i] = rnd_float(), c[i] = rnd_float();
            da[i] = a[i] * 1.000001, db[i] = b[i], dc[i] = c[i] / 3.0;
        }
        float ra[N];
        double rda[N];
        for (int i = 0; i < N; i++)
            rda[i] = comb(comb(da[i], db[i], op), dc[i], op);
        /* float32 in float32 (comb() would round through double) */
        for (int i = 0; i < N; i++) {
            float x = a[i];
            float ys[2] = {b[i], c[i]};
            for (int s = 0; s < 2; s++)
                x = op == MRC_PROD ? x * ys[s] : op == MRC_MIN ? (ys[s] < x ? ys[s] : x)
                    : op == MRC_MAX ? (ys[s] > x ? ys[s] : x) : x + ys[s];
            ra[i] = op == MRC_AVG ? x / 3 : x;
            if (op == MRC_AVG)
                rda[i] /= 3;
        }
        CHECK_RC(mrc_reduce(a, b, N, MRC_FLOAT32, op));
        CHECK_RC(mrc_reduce(a, c, N, MRC_FLOAT32, op));
        CHECK_RC(mrc_reduce_finish(a, N, MRC_FLOAT32, op, 3));
        CHECK_RC(mrc_reduce(da, db, N, MRC_FLOAT64, op));
        CHECK_RC(mrc_reduce(da, dc, N, MRC_FLOAT64, op));
        CHECK_RC(mrc_reduce_finish(da, N, MRC_FLOAT64, op, 3));
        CHECK(memcmp(a, ra, sizeof(a)) == 0);
        CHECK(memcmp(da, rda, sizeof(da)) == 0);
    }
}

static _Float16 h(uint16_t u)
{
    _Float16 f;
    memcpy(&f, &u, 2);
    return f;
}

static uint16_t hu(_Float16 f)
{
    uint16_t u;
    memcpy(&u, &f, 2);
    return u;
}

/* float16 through gcc's _Float16 (its own conversions), bfloat16 through
 * ref_f2bf: each step widened to float, combined, rounded. */
static void test_half(void)
{
    for (int op = 0; op < MRC_NREDOPS; op++) {
        uint16_t hs[NSRC][N], bs[NSRC][N], ha[N], ba[N];
        for (int s = 0; s < NSRC; s++)
            for (int i = 0; i < N; i++) {
                hs[s][i] = hu((_Float16)rnd_float());
                bs[s][i] = ref_f2bf(rnd_float() * 1000.0f);
            }
        memcpy(ha, hs[0], sizeof(ha));
        memcpy(ba, bs[0], sizeof(ba));
        for (int s = 1; s < NSRC; s++) {
            CHECK_RC(mrc_reduce(ha, hs[s], N, MRC_FLOAT16, op));
            CHECK_RC(mrc_reduce(ba, bs[s], N, MRC_BFLOAT16, op));
        }
        CHECK_RC(mrc_reduce_finish(ha, N, MRC_FLOAT16, op, NSRC));
        CHECK_RC(mrc_reduce_finish(ba, N, MRC_BFLOAT16, op, NSRC));
        for (int i = 0; i < N; i++) {
            _Float16 x = h(hs[0][i]);
            uint16_t y = bs[0][i];
            for (int s = 1; s < NSRC; s++) {
                x = (_Float16)(float)comb((float)x, (float)h(hs[s][i]), op);
                y = ref_f2bf((float)comb(bf2f(y), bf2f(bs[s][i]), op));
            }
            if (op == MRC_AVG) {
                x = (_Float16)((float)x / (float)NSRC);
                y = ref_f2bf(bf2f(y) / (float)NSRC);
            }
            if (ha[i] != hu(x) || ba[i] != y) {
                fprintf(stderr, "%s [%d]: f16 %04x want %04x, bf16 %04x want %04x\n",
                        mrc_redop_str(op), i, ha[i], hu(x), ba[i], y);
                CHECK(0);
            }
        }
    }
}

/* Every float16 value through widen/round (x * 1, x + -0): subnormals,
 * Inf and NaN included; and rounding at the edges (overflow to Inf,
 * underflow to subnormals and zero). */
static void test_f16_all(void)
{
    static uint16_t a[65536], one[65536];
    for (int i = 0; i < 65536; i++) {
        a[i] = (uint16_t)i;
        one[i] = 0x3c00; /* 1.0 */
    }
    CHECK_RC(mrc_reduce(a, one, 65536, MRC_FLOAT16, MRC_PROD));
    for (int i = 0; i < 65536; i++) {
        int nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff);
        if (nan)
            CHECK((a[i] & 0x7c00) == 0x7c00 && (a[i] & 0x3ff));
        else
            CHECK(a[i] == i);
    }
    uint16_t x[4] = {0x7bff, 0x0001, 0x0400, 0xfbff}; /* max, min subnormal, min normal, -max */
    uint16_t y[4] = {0x7bff, 0x3800, 0x3800, 0xfbff}; /* max, 0.5, 0.5, -max */
    CHECK_RC(mrc_reduce(x, y, 2, MRC_FLOAT16, MRC_SUM));
    CHECK(x[0] == 0x7c00);                     /* max + max = Inf */
    CHECK(x[1] == hu(h(0x0001) + h(0x3800)));  /* 0.5 + tiny rounds to 0.5 */
    CHECK_RC(mrc_reduce(x + 2, y + 2, 2, MRC_FLOAT16, MRC_PROD));
    CHECK(x[2] == 0x0200);                     /* min normal / 2: subnormal */
    CHECK(x[3] == 0x7c00);                     /* -max * -max = +Inf */
}

int main(void)
{
    CHECK(mrc_dtype_size(MRC_BFLOAT16) == 2 && mrc_dtype_size(MRC_INT64) == 8);
    CHECK(mrc_dtype_size(MRC_NDTYPES) == 0);
    CHECK(mrc_reduce(NULL, NULL, 1, MRC_NDTYPES, MRC_SUM) == MRC_EUSAGE);
    CHECK(mrc_reduce(NULL, NULL, 1, MRC_INT8, MRC_NREDOPS) == MRC_EUSAGE);
    CHECK(mrc_reduce_finish(NULL, 1, MRC_INT8, MRC_AVG, 0) == MRC_EUSAGE);
    CHECK_RC(mrc_reduce(NULL, NULL, 0, MRC_FLOAT32, MRC_SUM));
    test_int(MRC_INT8, 8, 1);
    test_int(MRC_UINT8, 8, 0);
    test_int(MRC_INT32, 32, 1);
    test_int(MRC_INT64, 64, 1);
    test_f32_f64();
    test_half();
    test_f16_all();
    /* AVG of 8-bit values over more ranks than an int8 holds. */
    int8_t s8[1] = {-100}, z8[1] = {0};
    CHECK_RC(mrc_reduce(s8, z8, 1, MRC_INT8, MRC_AVG));
    CHECK_RC(mrc_reduce_finish(s8, 1, MRC_INT8, MRC_AVG, 200));
    CHECK(s8[0] == 0);
    DONE("test_reduce");
    return 0;
}
