/* The block codecs of codecs.py on the CPU in one pass over the values, without the interpreter
 * lock. The payload and the decoded values are the torch path's, bit for bit
 * (tests/test_codecs.py): the same fp32 divisions, products and round-half-even, the same
 * scale rule. codecs.py falls back to its torch operations where this module is not built.
 *
 *   encode(kind, values, payload, block_size, threads=1) -> bool   every value finite
 *   decode(kind, payload, out, block_size, subtract, threads=1)     out = decoded, or out -= decoded
 *   compress_outer(kind, anchor, values, residual, payload, block_size, threads=1) -> bool
 *       error feedback's compression of the outer gradient in one pass: values = anchor - values
 *       + residual, encoded into payload, then values -= decoded (the new residual)
 *   compress_update(kind, update, residual, value, out, payload, block_size, threads=1) -> bool
 *       a shard's: residual += update, encoded into payload, then residual -= decoded (the new
 *       residual) and out = value + decoded (the new value)
 *
 * threads > 1 splits the values into that many ranges of whole blocks, each on its own thread
 * (a shard's close and a pull's decode are on the round trip a learner waits for). int4's decode,
 * the default codec's and on every round trip twice, has an AVX2 pass of its own (half the time
 * of unpacking and scaling in two loops); the other loops are vectorised by the compiler.
 *
 * kind: INT8, INT4 or FP4_E3M0. values and out: fp32 buffers; payload: the codec's layout
 * (block scales, then codes), of exactly the encoded size for len(values) or len(out).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define INT4_AVX2 1
#endif

enum { INT8 = 0, INT4 = 1, FP4_E3M0 = 2 };

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* One copy of a hot loop per instruction set, chosen when the module loads. */
#define VECTORISED __attribute__((target_clones("avx2", "default")))
#else
#define VECTORISED
#endif

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static int bits_of_kind(int kind) { return kind == INT8 ? 8 : 4; }
static double top_of_kind(int kind) { return kind == INT8 ? 127.0 : kind == INT4 ? 7.0 : 1.0; }

/* codecs._largest_scale: the largest fp32 scale whose top * scale is finite. */
static float largest_scale(double top) {
    float scale = (float)((double)FLT_MAX / top);
    if ((double)scale * top > (double)FLT_MAX) scale = nextafterf(scale, 0.0f);
    return scale;
}

/* codecs._block_scales: absmax / top rounded up to fp32, at most largest_scale(top). */
static float block_scale(float absmax, double top, float largest) {
    double exact = (double)absmax / top;
    float scale = (float)exact;
    if ((double)scale < exact) scale = nextafterf(scale, INFINITY);
    return scale > largest ? largest : scale;
}

/* The bits of |x| order as the magnitudes do, NaN above Inf: one integer maximum gives both
 * the block's absmax and whether any value is not finite. */
VECTORISED static uint32_t absmax_bits(const float *x, Py_ssize_t count) {
    uint32_t top = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t magnitude = bits_of(x[i]) & 0x7FFFFFFFu;
        top = magnitude > top ? magnitude : top;
    }
    return top;
}

/* Round half to even for |r| < 2^22 under the default rounding mode, as torch.round does,
 * in operations every vector unit has (the module is built without -ffast-math). */
static inline float round_even(float r) {
    const float shift = 12582912.0f; /* 1.5 * 2^23 */
    return (r + shift) - shift;
}

VECTORISED static void int_codes(const float *x, Py_ssize_t count, float divisor, uint8_t *codes, uint8_t mask) {
    for (Py_ssize_t i = 0; i < count; i++)
        codes[i] = (uint8_t)(int8_t)(int32_t)round_even(x[i] / divisor) & mask;
}

/* codecs.Fp4E3M0Codec._to_codes on the bits of x / divisor. */
VECTORISED static void fp4_codes(const float *x, Py_ssize_t count, float divisor, uint8_t *codes) {
    const int32_t one = 127 << 23, half_mantissa = 1 << 22, floor = one - (6 << 23);
    for (Py_ssize_t i = 0; i < count; i++) {
        int32_t bits = (int32_t)bits_of(x[i] / divisor);
        int32_t magnitude = bits & 0x7FFFFFFF;
        int32_t sign = (bits >> 28) & 8;
        int32_t exponent = (((magnitude > floor ? magnitude : floor) + half_mantissa) >> 23) - (127 - 7);
        exponent *= magnitude >= one - (7 << 23);
        codes[i] = (uint8_t)(exponent | sign);
    }
}

/* Two codes a byte, the first in the low nibble; an odd count leaves the last high nibble 0. */
VECTORISED static void pack_nibbles(const uint8_t *codes, Py_ssize_t count, uint8_t *packed) {
    for (Py_ssize_t j = 0; j < count / 2; j++) packed[j] = codes[2 * j] | (uint8_t)(codes[2 * j + 1] << 4);
    if (count % 2) packed[count / 2] = codes[count - 1];
}

enum { CHUNK = 4096 }; /* values worked on together, in the first level of cache */

/* Encodes values [first, last) of the numel in `values`; first is a multiple of 2 * block_size and
 * last one too or numel, so that a range holds whole blocks and whole bytes of 4-bit codes. */
static int encode_range(int kind, const float *values, Py_ssize_t numel, Py_ssize_t block_size, uint8_t *payload,
                        Py_ssize_t first, Py_ssize_t last) {
    Py_ssize_t blocks = (numel + block_size - 1) / block_size;
    uint8_t *codes = payload + 4 * blocks;
    double top = top_of_kind(kind);
    float largest = largest_scale(top), divisor = 1.0f;
    uint8_t chunk_codes[CHUNK];
    int finite = 1;
    for (Py_ssize_t start = first; start < last; start += CHUNK) {
        Py_ssize_t end = last - start < CHUNK ? last : start + CHUNK;
        for (Py_ssize_t at = start; at < end;) {
            Py_ssize_t block = at / block_size;
            if (at == block * block_size) { /* a block begins: its scale, from all of its values */
                Py_ssize_t count = numel - at < block_size ? numel - at : block_size;
                uint32_t absmax = absmax_bits(values + at, count);
                finite &= absmax < 0x7F800000u;
                float scale = block_scale(float_of(absmax), top, largest);
                memcpy(payload + 4 * block, &scale, 4);
                divisor = scale == 0.0f ? 1.0f : scale; /* an all-zero block stays zero */
            }
            Py_ssize_t stop = (block + 1) * block_size < end ? (block + 1) * block_size : end;
            if (kind == INT8) int_codes(values + at, stop - at, divisor, codes + at, 0xFF);
            else if (kind == INT4) int_codes(values + at, stop - at, divisor, chunk_codes + (at - start), 0x0F);
            else fp4_codes(values + at, stop - at, divisor, chunk_codes + (at - start));
            at = stop;
        }
        if (kind != INT8) pack_nibbles(chunk_codes, end - start, codes + start / 2);
    }
    return finite;
}

/* Each code's value before scaling, into out[0 .. count). */
VECTORISED static void int8_values(const uint8_t *codes, Py_ssize_t count, float *out) {
    for (Py_ssize_t i = 0; i < count; i++) out[i] = (float)(int8_t)codes[i];
}

static inline float int4_value(uint8_t code) { return (float)((int8_t)(code << 4) >> 4); }

static inline float fp4_value(uint8_t code) {
    uint32_t exponent = code & 7;
    uint32_t bits = ((uint32_t)(code & 8) << 28) | (exponent + 127 - 7) << 23;
    return exponent ? float_of(bits) : 0.0f;
}

VECTORISED static void int4_values(const uint8_t *packed, Py_ssize_t count, float *out) {
    for (Py_ssize_t j = 0; j < count / 2; j++) {
        out[2 * j] = int4_value(packed[j] & 0x0F);
        out[2 * j + 1] = int4_value(packed[j] >> 4);
    }
    if (count % 2) out[count - 1] = int4_value(packed[count / 2] & 0x0F);
}

VECTORISED static void fp4_values(const uint8_t *packed, Py_ssize_t count, float *out) {
    for (Py_ssize_t j = 0; j < count / 2; j++) {
        out[2 * j] = fp4_value(packed[j] & 0x0F);
        out[2 * j + 1] = fp4_value(packed[j] >> 4);
    }
    if (count % 2) out[count - 1] = fp4_value(packed[count / 2] & 0x0F);
}

/* out = unscaled * scale, or out -= that: the torch path's product, then its difference. */
VECTORISED static void scale_into(const float *unscaled, Py_ssize_t count, float scale, float *out, int subtract) {
    if (subtract)
        for (Py_ssize_t i = 0; i < count; i++) out[i] -= unscaled[i] * scale;
    else
        for (Py_ssize_t i = 0; i < count; i++) out[i] = unscaled[i] * scale;
}

#ifdef INT4_AVX2
/* int4's decode of values [from, to) of one block, one at a time. */
static void int4_scaled(const uint8_t *codes, Py_ssize_t from, Py_ssize_t to, float scale, float *out, int subtract) {
    for (Py_ssize_t i = from; i < to; i++) {
        float value = int4_value((uint8_t)(codes[i / 2] >> (4 * (i % 2))) & 0x0F) * scale;
        if (subtract) out[i] -= value;
        else out[i] = value;
    }
}

/* int4's decode of one block's values in one pass, 32 at a time from 16 bytes of codes (the
 * first value in a low nibble): out = code * scale, or out -= that; the same products and
 * differences as int4_values and scale_into, so the same bits. Returns how many it did (count
 * rounded down to 32); the caller does the rest. */
__attribute__((target("avx2"))) static Py_ssize_t int4_block_avx2(const uint8_t *packed, Py_ssize_t count,
                                                                   float scale, float *out, int subtract) {
    const __m128i low_nibbles = _mm_set1_epi8(0x0F), sign = _mm_set1_epi8(8);
    const __m256 scales = _mm256_set1_ps(scale);
    Py_ssize_t done = 0;
    for (; done + 32 <= count; done += 32) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + done / 2));
        __m128i low = _mm_and_si128(bytes, low_nibbles);
        __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
        /* in value order, each nibble sign-extended: (x ^ 8) - 8 */
        __m128i halves[2] = {_mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(low, high), sign), sign),
                             _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(low, high), sign), sign)};
        for (int h = 0; h < 2; h++) {
            __m128i eights[2] = {halves[h], _mm_srli_si128(halves[h], 8)};
            for (int e = 0; e < 2; e++) {
                float *at = out + done + 16 * h + 8 * e;
                __m256 product = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eights[e])), scales);
                _mm256_storeu_ps(at, subtract ? _mm256_sub_ps(_mm256_loadu_ps(at), product) : product);
            }
        }
    }
    return done;
}

#endif

/* Decodes values [first, last), bounded as encode_range's. */
static void decode_range(int kind, const uint8_t *payload, float *out, Py_ssize_t numel, Py_ssize_t block_size,
                         int subtract, Py_ssize_t first, Py_ssize_t last) {
    Py_ssize_t blocks = (numel + block_size - 1) / block_size;
    const uint8_t *codes = payload + 4 * blocks;
    float unscaled[CHUNK];
#ifdef INT4_AVX2
    if (kind == INT4 && __builtin_cpu_supports("avx2")) { /* block by block, in one pass; each block's odd start and tail as below */
        for (Py_ssize_t at = first; at < last;) {
            Py_ssize_t block = at / block_size;
            Py_ssize_t stop = (block + 1) * block_size < last ? (block + 1) * block_size : last;
            float scale;
            memcpy(&scale, payload + 4 * block, 4);
            Py_ssize_t lead = at % 2; /* a value in a high nibble: the vector loop starts at a byte */
            Py_ssize_t done = lead + int4_block_avx2(codes + (at + lead) / 2, stop - at - lead, scale, out + at + lead,
                                                     subtract);
            int4_scaled(codes, at, at + lead, scale, out, subtract);
            int4_scaled(codes, at + done, stop, scale, out, subtract);
            at = stop;
        }
        return;
    }
#endif
    for (Py_ssize_t start = first; start < last; start += CHUNK) {
        Py_ssize_t end = last - start < CHUNK ? last : start + CHUNK;
        if (kind == INT8) int8_values(codes + start, end - start, unscaled);
        else if (kind == INT4) int4_values(codes + start / 2, end - start, unscaled);
        else fp4_values(codes + start / 2, end - start, unscaled);
        for (Py_ssize_t at = start; at < end;) {
            Py_ssize_t block = at / block_size;
            Py_ssize_t stop = (block + 1) * block_size < end ? (block + 1) * block_size : end;
            float scale;
            memcpy(&scale, payload + 4 * block, 4);
            scale_into(unscaled + (at - start), stop - at, scale, out + at, subtract);
            at = stop;
        }
    }
}

/* One thread's share of an encode or a decode. */
typedef struct {
    int kind, subtract, finite;
    const float *values, *anchor, *residual;
    float *out, *carry; /* carry: compress_update's residual, advanced in place */
    const uint8_t *source;
    uint8_t *payload;
    Py_ssize_t numel, block_size, first, last;
} Range;

static void *encode_thread(void *arg) {
    Range *r = arg;
    r->finite = encode_range(r->kind, r->values, r->numel, r->block_size, r->payload, r->first, r->last);
    return NULL;
}

static void *decode_thread(void *arg) {
    Range *r = arg;
    decode_range(r->kind, r->source, r->out, r->numel, r->block_size, r->subtract, r->first, r->last);
    return NULL;
}

/* compress_outer's share: a group of whole pairs of blocks at a time, so that the sum, the
 * encode and the decode work on values still in cache, with the same arithmetic as the torch
 * path's three passes (anchor - values, + residual, then encode and decode's difference). */
static void *compress_outer_thread(void *arg) {
    Range *r = arg;
    Py_ssize_t unit = 2 * r->block_size, group = unit * (CHUNK / unit > 1 ? CHUNK / unit : 1);
    float *values = r->out;
    r->finite = 1;
    for (Py_ssize_t start = r->first; start < r->last; start += group) {
        Py_ssize_t end = r->last - start < group ? r->last : start + group;
        for (Py_ssize_t i = start; i < end; i++) values[i] = (r->anchor[i] - values[i]) + r->residual[i];
        r->finite &= encode_range(r->kind, values, r->numel, r->block_size, r->payload, start, end);
        decode_range(r->kind, r->payload, values, r->numel, r->block_size, 1, start, end);
    }
    return NULL;
}

/* compress_update's share, grouped as compress_outer's: the torch path's arithmetic of
 * ErrorFeedback.compress and apply_update (residual + update, encode, residual - decoded,
 * value + decoded) on values still in cache. */
static void *compress_update_thread(void *arg) {
    Range *r = arg;
    Py_ssize_t unit = 2 * r->block_size, group = unit * (CHUNK / unit > 1 ? CHUNK / unit : 1);
    float *residual = r->carry, *out = r->out;
    r->finite = 1;
    for (Py_ssize_t start = r->first; start < r->last; start += group) {
        Py_ssize_t end = r->last - start < group ? r->last : start + group;
        for (Py_ssize_t i = start; i < end; i++) residual[i] = residual[i] + r->values[i];
        r->finite &= encode_range(r->kind, residual, r->numel, r->block_size, r->payload, start, end);
        decode_range(r->kind, r->payload, out, r->numel, r->block_size, 0, start, end);
        for (Py_ssize_t i = start; i < end; i++) {
            residual[i] = residual[i] - out[i];
            out[i] = r->anchor[i] + out[i];
        }
    }
    return NULL;
}

enum { MAX_THREADS = 64 };

/* Splits [0, numel) into `threads` ranges of whole pairs of blocks and runs `work` on each, the
 * last on the calling thread; a thread that cannot start leaves its range to the caller. */
static void run_ranges(Range *ranges, int threads, void *(*work)(void *)) {
    Range *first = &ranges[0];
    Py_ssize_t unit = 2 * first->block_size, units = (first->numel + unit - 1) / unit;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = (int)units;
    if (threads < 1) threads = 1;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        ranges[t] = *first;
        ranges[t].first = units * t / threads * unit;
        Py_ssize_t last = units * (t + 1) / threads * unit;
        ranges[t].last = last < first->numel ? last : first->numel;
    }
    for (int t = 0; t < threads - 1; t++) started[t] = pthread_create(&ids[t], NULL, work, &ranges[t]) == 0;
    work(&ranges[threads - 1]);
    for (int t = 0; t < threads - 1; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else work(&ranges[t]);
    }
    for (int t = threads; t < MAX_THREADS; t++) ranges[t].finite = 1;
}

static Py_ssize_t encoded_size(int kind, Py_ssize_t numel, Py_ssize_t block_size) {
    return 4 * ((numel + block_size - 1) / block_size) + (numel * bits_of_kind(kind) + 7) / 8;
}

static int check(int kind, Py_ssize_t block_size, Py_ssize_t float_bytes, Py_ssize_t payload_bytes) {
    if (kind != INT8 && kind != INT4 && kind != FP4_E3M0) {
        PyErr_Format(PyExc_ValueError, "unknown codec kind %d", kind);
        return 0;
    }
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", block_size);
        return 0;
    }
    if (float_bytes % 4) {
        PyErr_SetString(PyExc_ValueError, "the fp32 buffer's length is not a multiple of 4");
        return 0;
    }
    Py_ssize_t expected = encoded_size(kind, float_bytes / 4, block_size);
    if (payload_bytes != expected) {
        PyErr_Format(PyExc_ValueError, "payload of %zd bytes for %zd values: expected %zd",
                     payload_bytes, float_bytes / 4, expected);
        return 0;
    }
    return 1;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    int kind, threads = 1, finite = 1;
    Py_ssize_t block_size;
    Py_buffer values, payload;
    if (!PyArg_ParseTuple(args, "iy*w*n|i", &kind, &values, &payload, &block_size, &threads)) return NULL;
    int ok = check(kind, block_size, values.len, payload.len);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        Range ranges[MAX_THREADS] = {{.kind = kind, .values = values.buf, .payload = payload.buf,
                                      .numel = values.len / 4, .block_size = block_size}};
        run_ranges(ranges, threads, encode_thread);
        for (int t = 0; t < MAX_THREADS; t++) finite &= ranges[t].finite;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&payload);
    return ok ? PyBool_FromLong(finite) : NULL;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    int kind, subtract, threads = 1;
    Py_ssize_t block_size;
    Py_buffer payload, out;
    if (!PyArg_ParseTuple(args, "iy*w*np|i", &kind, &payload, &out, &block_size, &subtract, &threads)) return NULL;
    int ok = check(kind, block_size, out.len, payload.len);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        Range ranges[MAX_THREADS] = {{.kind = kind, .subtract = subtract, .source = payload.buf, .out = out.buf,
                                      .numel = out.len / 4, .block_size = block_size}};
        run_ranges(ranges, threads, decode_thread);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&out);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *compress_outer(PyObject *self, PyObject *args) {
    int kind, threads = 1, finite = 1;
    Py_ssize_t block_size;
    Py_buffer anchor, values, residual, payload;
    if (!PyArg_ParseTuple(args, "iy*w*y*w*n|i", &kind, &anchor, &values, &residual, &payload, &block_size, &threads))
        return NULL;
    int ok = check(kind, block_size, values.len, payload.len);
    if (ok && (anchor.len != values.len || residual.len != values.len)) {
        PyErr_Format(PyExc_ValueError, "anchor (%zd bytes), values (%zd) and residual (%zd) differ in length",
                     anchor.len, values.len, residual.len);
        ok = 0;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        Range ranges[MAX_THREADS] = {{.kind = kind, .anchor = anchor.buf, .out = values.buf, .residual = residual.buf,
                                      .payload = payload.buf, .numel = values.len / 4, .block_size = block_size}};
        run_ranges(ranges, threads, compress_outer_thread);
        for (int t = 0; t < MAX_THREADS; t++) finite &= ranges[t].finite;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&anchor);
    PyBuffer_Release(&values);
    PyBuffer_Release(&residual);
    PyBuffer_Release(&payload);
    return ok ? PyBool_FromLong(finite) : NULL;
}

static PyObject *compress_update(PyObject *self, PyObject *args) {
    int kind, threads = 1, finite = 1;
    Py_ssize_t block_size;
    Py_buffer update, residual, value, out, payload;
    if (!PyArg_ParseTuple(args, "iy*w*y*w*w*n|i", &kind, &update, &residual, &value, &out, &payload, &block_size,
                          &threads))
        return NULL;
    int ok = check(kind, block_size, update.len, payload.len);
    if (ok && (residual.len != update.len || value.len != update.len || out.len != update.len)) {
        PyErr_Format(PyExc_ValueError, "update (%zd bytes), residual (%zd), value (%zd) and out (%zd) differ in length",
                     update.len, residual.len, value.len, out.len);
        ok = 0;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        Range ranges[MAX_THREADS] = {{.kind = kind, .values = update.buf, .carry = residual.buf, .anchor = value.buf,
                                      .out = out.buf, .payload = payload.buf, .numel = update.len / 4,
                                      .block_size = block_size}};
        run_ranges(ranges, threads, compress_update_thread);
        for (int t = 0; t < MAX_THREADS; t++) finite &= ranges[t].finite;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&update);
    PyBuffer_Release(&residual);
    PyBuffer_Release(&value);
    PyBuffer_Release(&out);
    PyBuffer_Release(&payload);
    return ok ? PyBool_FromLong(finite) : NULL;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "encode(kind, values, payload, block_size, threads=1) -> every value finite"},
    {"decode", decode, METH_VARARGS, "decode(kind, payload, out, block_size, subtract, threads=1)"},
    {"compress_outer", compress_outer, METH_VARARGS,
     "compress_outer(kind, anchor, values, residual, payload, block_size, threads=1) -> every value finite"},
    {"compress_update", compress_update, METH_VARARGS,
     "compress_update(kind, update, residual, value, out, payload, block_size, threads=1) -> every value finite"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__codec_kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "INT8", INT8) || PyModule_AddIntConstant(m, "INT4", INT4)
              || PyModule_AddIntConstant(m, "FP4_E3M0", FP4_E3M0))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
