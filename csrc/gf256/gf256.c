/* Products in GF(2^8) over whole buffers: the bulk work of Reed-Solomon parity, with SIMD where the CPU has it.

   Why native: zfec encodes and decodes at about 1 GB/s per core, so a save with `rs(k,m)` parity, a rebuild and a
   degraded load spend as much CPU as disk time. Every code zfec computes is linear: each output block is a sum of
   the input blocks, each multiplied by a coefficient of GF(2^8) (the field zfec uses: x^8+x^4+x^3+x^2+1). The
   caller (tmformat/parity.py) takes those coefficients from zfec itself, by coding unit blocks, and this module
   applies them to whole segments: with AVX2 each product of 32 bytes is two table lookups (PSHUFB on the low and
   high nibbles), as ISA-L does. The result is the same bytes zfec gives; tests compare them.

   mul_add(matrix, inputs, outputs): outputs[r][p] = XOR over i of matrix[r * k + i] * inputs[i][p], for k inputs
   and len(outputs) rows, all buffers of one length. The GIL is released while it runs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_KERNEL 1
#endif

#define POLYNOMIAL 0x11D        /* zfec's field: x^8 + x^4 + x^3 + x^2 + 1 */
#define MAX_INPUTS 256          /* k + m <= 256 in GF(2^8) */
#define CHUNK 4096              /* positions coded at once: each output's chunk stays in the L1 cache */

static uint8_t MUL[256][256];   /* MUL[a][b] = a * b */

static void make_tables(void) {
    uint8_t exp[512], log[256];
    unsigned x = 1;
    for (int i = 0; i < 255; i++) {
        exp[i] = (uint8_t)x;
        log[x] = (uint8_t)i;
        x <<= 1;
        if (x & 0x100) x ^= POLYNOMIAL;
    }
    for (int i = 255; i < 512; i++) exp[i] = exp[i - 255];
    for (int a = 0; a < 256; a++)
        for (int b = 0; b < 256; b++)
            MUL[a][b] = a && b ? exp[log[a] + log[b]] : 0;
}

static void scalar_mul_add(uint8_t c, const uint8_t *in, uint8_t *out, Py_ssize_t n) {
    const uint8_t *row = MUL[c];
    for (Py_ssize_t p = 0; p < n; p++) out[p] ^= row[in[p]];
}

#ifdef HAVE_AVX2_KERNEL
__attribute__((target("avx2")))
static Py_ssize_t avx2_mul_add(uint8_t c, const uint8_t *in, uint8_t *out, Py_ssize_t n) {
    uint8_t low[16], high[16];  /* c * x and c * (x << 4) for each nibble x */
    for (int x = 0; x < 16; x++) {
        low[x] = MUL[c][x];
        high[x] = MUL[c][x << 4];
    }
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)low));
    const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)high));
    const __m256i mask = _mm256_set1_epi8(0x0f);
    Py_ssize_t p = 0;
    for (; p + 32 <= n; p += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + p));
        __m256i product = _mm256_xor_si256(_mm256_shuffle_epi8(lo, _mm256_and_si256(v, mask)),
                                           _mm256_shuffle_epi8(hi, _mm256_and_si256(_mm256_srli_epi64(v, 4), mask)));
        __m256i acc = _mm256_loadu_si256((const __m256i *)(out + p));
        _mm256_storeu_si256((__m256i *)(out + p), _mm256_xor_si256(acc, product));
    }
    return p;  /* the positions done; the caller does the rest */
}
#endif

static int use_avx2;

static void mul_add_chunk(const uint8_t *matrix, Py_ssize_t k, Py_ssize_t rows, const uint8_t **in, uint8_t **out,
                          Py_ssize_t begin, Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint8_t *target = out[r] + begin;
        memset(target, 0, (size_t)n);
        for (Py_ssize_t i = 0; i < k; i++) {
            uint8_t c = matrix[r * k + i];
            const uint8_t *source = in[i] + begin;
            if (c == 0) continue;
            Py_ssize_t done = 0;
#ifdef HAVE_AVX2_KERNEL
            if (use_avx2) done = avx2_mul_add(c, source, target, n);
#endif
            scalar_mul_add(c, source + done, target + done, n - done);
        }
    }
}

static PyObject *mul_add(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer matrix;
    PyObject *inputs, *outputs;
    if (!PyArg_ParseTuple(args, "y*OO", &matrix, &inputs, &outputs)) return NULL;
    PyObject *in_seq = PySequence_Fast(inputs, "inputs must be a sequence of buffers");
    PyObject *out_seq = in_seq ? PySequence_Fast(outputs, "outputs must be a sequence of buffers") : NULL;
    Py_ssize_t k = in_seq ? PySequence_Fast_GET_SIZE(in_seq) : 0, rows = out_seq ? PySequence_Fast_GET_SIZE(out_seq) : 0;
    Py_buffer views[2 * MAX_INPUTS];
    const uint8_t *in[MAX_INPUTS];
    uint8_t *out[MAX_INPUTS];
    Py_ssize_t held = 0, length = -1;
    PyObject *result = NULL;
    if (!out_seq) goto done;
    if (k < 1 || rows < 1 || k > MAX_INPUTS || rows > MAX_INPUTS || matrix.len != k * rows) {
        PyErr_Format(PyExc_ValueError, "%zd inputs and %zd outputs need a matrix of %zd bytes, found %zd", k, rows,
                     k * rows, matrix.len);
        goto done;
    }
    for (Py_ssize_t j = 0; j < k + rows; j++) {
        int writable = j >= k;
        PyObject *item = writable ? PySequence_Fast_GET_ITEM(out_seq, j - k) : PySequence_Fast_GET_ITEM(in_seq, j);
        if (PyObject_GetBuffer(item, &views[j], writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        held++;
        if (length < 0) length = views[j].len;
        if (views[j].len != length) {
            PyErr_Format(PyExc_ValueError, "buffers must be of one length: %zd and %zd", length, views[j].len);
            goto done;
        }
        if (writable) out[j - k] = views[j].buf;
        else in[j] = views[j].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t begin = 0; begin < length; begin += CHUNK)
        mul_add_chunk(matrix.buf, k, rows, in, out, begin, length - begin < CHUNK ? length - begin : CHUNK);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t j = 0; j < held; j++) PyBuffer_Release(&views[j]);
    Py_XDECREF(in_seq);
    Py_XDECREF(out_seq);
    PyBuffer_Release(&matrix);
    return result;
}

static PyObject *kernel(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(use_avx2 ? "avx2" : "scalar");
}

static PyMethodDef methods[] = {
    {"mul_add", mul_add, METH_VARARGS,
     "mul_add(matrix, inputs, outputs): outputs[r] = sum over i of matrix[r * k + i] * inputs[i] in GF(2^8)"},
    {"kernel", kernel, METH_NOARGS, "the kernel this CPU runs: 'avx2' or 'scalar'"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gf256", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gf256(void) {
    make_tables();
#ifdef HAVE_AVX2_KERNEL
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
