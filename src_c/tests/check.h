/* check.h - the smallest test harness: CHECK aborts with the location. */
#ifndef MRC_CHECK_H
#define MRC_CHECK_H
#include <stdio.h>
#include <stdlib.h>

static int check_count;
#define CHECK(cond)                                                                  \
    do {                                                                             \
        check_count++;                                                               \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)
#define CHECK_RC(expr)                                                                     \
    do {                                                                                   \
        int rc_ = (expr);                                                                  \
        check_count++;                                                                     \
        if (rc_) {                                                                         \
            fprintf(stderr, "%s:%d: %s -> %d (%s)\n", __FILE__, __LINE__, #expr, rc_,      \
                    mrc_strerror(rc_));                                                    \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)
#define DONE(name) printf("%s: %d checks passed\n", name, check_count)
#endif
