/* exp(x) for x <= 0, shared by the CPU kernels (siesta/c_kernels.py gives every build this
 * header): the decode softmax asks for a score minus the running max (-inf for the first
 * block's rescale), SiLU for -|x|. Plain arithmetic, so gcc vectorizes the loops that call
 * it (expf is a scalar libm call). exp(x) = 2^n exp(r), n = round(x / ln2),
 * r = x - n ln2 in [-ln2/2, ln2/2]; ln2 is split in two (the high part has few bits, so
 * n * EXP_LN2_HI is exact) and exp(r) is its Taylor series to r^7 (truncation < 1e-8
 * relative): within 1 ulp of exp. The split is written with fmaf: as plain products,
 * -fassociative-math (which the dot products need to vectorize) folds it back into
 * n * (EXP_LN2_HI + EXP_LN2_LO), off by tens of ulp. Below EXP_MIN the result (< 2^-126)
 * is 0: subnormal weights next to the max key's weight of 1 change nothing. */
#ifndef SIESTA_EXP_NONPOSITIVE_H
#define SIESTA_EXP_NONPOSITIVE_H
#include <math.h>
#include <stdint.h>

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440054690583e-4f
#define EXP_MIN -87.33654475f /* ln(2^-126): 2^n stays a normal float */
#define FLOAT_EXP_BIAS 127
#define FLOAT_MANT_BITS 23

static inline float exp_nonpositive(float x)
{
    const float c = x > EXP_MIN ? x : EXP_MIN; /* also maps -inf and NaN into range */
    const float n = rintf(c * EXP_LOG2E);
    const float r = fmaf(-n, EXP_LN2_LO, fmaf(-n, EXP_LN2_HI, c));
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const union { int32_t i; float f; } two_n = {.i = ((int32_t)n + FLOAT_EXP_BIAS) << FLOAT_MANT_BITS};
    return x > EXP_MIN ? p * two_n.f : 0.0f;
}

#endif
