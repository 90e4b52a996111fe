/* A bounded reader of the pickles DCP writes as `.metadata`: the summary dcp_summary.summarize gives, or None.

   Why native: CPython's C unpickler is unsafe on a hostile file in this process (a forged memo index makes it
   allocate and zero gigabytes, keys sharing one hash value make filling a dict quadratic), so dcp_metadata runs it
   in a limited child; that, and turning its records into the summary in Python, takes longer than DCP's own
   read_metadata. This reader runs a strict subset of the pickle machine and writes the summary in one pass.

   It either gives exactly what summarize would give from the records of the C unpickler, or declines (returns
   None), and the caller reads the file the general way, which also names whatever is wrong with it. It declines on
   any opcode, global, call, key or layout outside what DCP writes. Bounds, whatever the input:
   - every read is checked against the buffer's end;
   - the memo only grows by one (MEMOIZE, or PUT of the next index), and GET names a slot already set;
   - each opcode makes at most one value, and containers only gain values popped from the stack; the values' memory
     is counted against `memory`;
   - nothing is hashed here: dict keys are strings (hashed by Python, whose string hash is salted) or records
     (by identity, each a key once);
   - records hold at most MAX_FIELDS fields, the summary's walk is bounded by the budget (declining past half of
     it, where summarize would raise) and nests at most MAX_DEPTH deep. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_FIELDS 64
#define MAX_DEPTH 100
#define BLOCK_VALUES 4096
#define ARENA_BYTES (1 << 20)
#define SMALL_INTS 256

typedef enum { V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_PYSTR, V_TUPLE, V_LIST, V_DICT, V_RECORD, V_GLOBAL,
               V_DTYPE } Kind;
/* the allowlist's codes (dcp_metadata): G_PATH's argument is the Python function that joins a path's parts */
enum { G_RECORD, G_DTYPE, G_CONST, G_TUPLE, G_STR, G_INT, G_OTHER, G_PATH };

typedef struct Val Val;
typedef struct { Val **items; uint32_t len, cap; } Vec;  /* items in the reader's arena; fewer items than bytes */

struct Val {
    unsigned char kind;
    unsigned char keyed;         /* a record already used as a dict key */
    unsigned char state_record;  /* a record whose state may be other than a dict (STATE_RECORDS) */
    union {
        int64_t i;
        double f;
        struct { const char *p; Py_ssize_t n; PyObject *decoded; } s;  /* V_STR: UTF-8 bytes inside the pickle */
        PyObject *o;  /* V_PYSTR, V_DTYPE's torch name: borrowed from the allowlist, or held in Reader.owned */
        Vec v;                                      /* tuple, list; dict: key, value, key, value, ... */
        struct { PyObject *kind; Vec fields; } r;  /* fields: name, value, name, value, ... */
        struct { int code; PyObject *arg; } g;
    } u;
};

typedef struct Block { struct Block *next; Py_ssize_t used; Val vals[BLOCK_VALUES]; } Block;
typedef struct Chunk { struct Chunk *next; size_t used, size; char bytes[]; } Chunk;  /* the items' arena */

typedef struct {
    const unsigned char *p, *end;
    Block *blocks;
    Chunk *arena;
    Val **stack, **memo;
    Py_ssize_t nstack, capstack, nmemo, capmemo;
    Py_ssize_t *marks, nmarks, capmarks;
    Py_ssize_t memory, memory_limit;
    PyObject *allowlist, *state_kinds;
    PyObject *owned;      /* strings made here (joined paths), released with the reader */
    int64_t used, limit;  /* the walk's budget units */
    int depth;
    int declined;         /* set with no Python error: the caller reads the file the general way */
} Reader;

static Val NONE_VAL = {V_NONE, 0, 0, {0}};
static Val TRUE_VAL = {V_BOOL, 0, 0, {1}};
static Val FALSE_VAL = {V_BOOL, 0, 0, {0}};
static Val EMPTY_TUPLE = {V_TUPLE, 0, 0, {0}};  /* immutable, so shared: DCP pickles one per record */
static Val SMALL[SMALL_INTS];                   /* 0..255, set up at import */
static PyObject *STATE_NAME, *ARGS_NAME;  /* "state", "args": interned at import */

#define DECLINE(r) do { (r)->declined = 1; return NULL; } while (0)
#define DECLINE_INT(r) do { (r)->declined = 1; return -1; } while (0)

static int charge_memory(Reader *r, Py_ssize_t bytes) {
    r->memory += bytes;
    if (r->memory > r->memory_limit) DECLINE_INT(r);
    return 0;
}

static Val *new_val(Reader *r, int kind) {
    if (!r->blocks || r->blocks->used == BLOCK_VALUES) {
        if (charge_memory(r, sizeof(Block)) < 0) return NULL;
        Block *b = PyMem_Malloc(sizeof(Block));
        if (!b) { PyErr_NoMemory(); return NULL; }
        b->next = r->blocks;
        b->used = 0;
        r->blocks = b;
    }
    Val *v = &r->blocks->vals[r->blocks->used++];
    memset(v, 0, sizeof(Val));
    v->kind = (unsigned char)kind;
    return v;
}

static void *arena_alloc(Reader *r, size_t bytes) {
    bytes = (bytes + 7) & ~(size_t)7;
    if (!r->arena || r->arena->size - r->arena->used < bytes) {
        size_t size = bytes > ARENA_BYTES ? bytes : ARENA_BYTES;
        if (charge_memory(r, (Py_ssize_t)size) < 0) return NULL;
        Chunk *c = PyMem_Malloc(sizeof(Chunk) + size);
        if (!c) { PyErr_NoMemory(); return NULL; }
        c->next = r->arena;
        c->used = 0;
        c->size = size;
        r->arena = c;
    }
    void *at = r->arena->bytes + r->arena->used;
    r->arena->used += bytes;
    return at;
}

static int vec_reserve(Reader *r, Vec *vec, uint32_t cap) {  /* room for `cap` items, in the arena */
    if (cap <= vec->cap) return 0;
    Val **items = arena_alloc(r, cap * sizeof(Val *));
    if (!items) return -1;
    if (vec->len) memcpy(items, vec->items, vec->len * sizeof(Val *));
    vec->items = items;
    vec->cap = cap;
    return 0;
}

static int vec_push(Reader *r, Vec *vec, Val *item) {  /* grows by doubling, into the arena (freed all at once) */
    if (vec->len == vec->cap && vec_reserve(r, vec, vec->cap ? vec->cap * 2 : 2) < 0) return -1;
    vec->items[vec->len++] = item;
    return 0;
}

static int grow(Reader *r, Val ***items, Py_ssize_t *cap) {  /* the stack and the memo: realloc'd */
    Py_ssize_t more = *cap ? *cap * 2 : 1024;
    if (charge_memory(r, (more - *cap) * (Py_ssize_t)sizeof(Val *)) < 0) return -1;
    Val **grown = PyMem_Realloc(*items, more * sizeof(Val *));
    if (!grown) { PyErr_NoMemory(); return -1; }
    *items = grown;
    *cap = more;
    return 0;
}

static void free_reader(Reader *r) {
    for (Block *b = r->blocks; b;) {
        for (Py_ssize_t i = 0; i < b->used; i++)
            if (b->vals[i].kind == V_STR) Py_XDECREF(b->vals[i].u.s.decoded);
        Block *next = b->next;
        PyMem_Free(b);
        b = next;
    }
    for (Chunk *c = r->arena; c;) {
        Chunk *next = c->next;
        PyMem_Free(c);
        c = next;
    }
    PyMem_Free(r->stack);
    PyMem_Free(r->memo);
    PyMem_Free(r->marks);
    Py_XDECREF(r->owned);
}

/* ------------------------------------------------------------------ reading the opcodes */

static const unsigned char *take(Reader *r, Py_ssize_t n) {
    if (n < 0 || r->end - r->p < n) DECLINE(r);
    const unsigned char *at = r->p;
    r->p += n;
    return at;
}

static uint64_t little_endian(const unsigned char *p, int n) {
    uint64_t value = 0;
    for (int i = n - 1; i >= 0; i--) value = (value << 8) | p[i];
    return value;
}

static Val *pop(Reader *r) {
    Py_ssize_t floor = r->nmarks ? r->marks[r->nmarks - 1] : 0;
    if (r->nstack <= floor) DECLINE(r);
    return r->stack[--r->nstack];
}

static Val *top(Reader *r) {
    Py_ssize_t floor = r->nmarks ? r->marks[r->nmarks - 1] : 0;
    if (r->nstack <= floor) DECLINE(r);
    return r->stack[r->nstack - 1];
}

static int push(Reader *r, Val *v) {
    if (!v || (r->nstack == r->capstack && grow(r, &r->stack, &r->capstack) < 0)) return -1;
    r->stack[r->nstack++] = v;
    return 0;
}

static Py_ssize_t pop_mark(Reader *r) {
    if (!r->nmarks) DECLINE_INT(r);
    return r->marks[--r->nmarks];
}

static int is_text(Val *v) { return v->kind == V_STR || v->kind == V_PYSTR; }

static PyObject *text(Reader *r, Val *v) {  /* a new reference, or NULL (declined on invalid UTF-8) */
    if (v->kind == V_PYSTR) return Py_NewRef(v->u.o);
    if (!v->u.s.decoded) {  /* once: a memoized string (a file's name) is one object wherever it is used */
        v->u.s.decoded = PyUnicode_DecodeUTF8(v->u.s.p, v->u.s.n, "surrogatepass");  /* as the C unpickler */
        if (!v->u.s.decoded && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); r->declined = 1; }
    }
    return Py_XNewRef(v->u.s.decoded);
}

static Py_ssize_t text_length(Val *v) {  /* bytes: at least the characters summarize counts */
    return v->kind == V_PYSTR ? PyUnicode_GET_LENGTH(v->u.o) : v->u.s.n;
}

static int collect(Reader *r, int kind, Py_ssize_t from) {  /* the values above `from` as one new container */
    if (kind == V_TUPLE && from == r->nstack) return push(r, &EMPTY_TUPLE);
    Val *c = new_val(r, kind);
    if (!c || vec_reserve(r, &c->u.v, (uint32_t)(r->nstack - from)) < 0) return -1;
    for (Py_ssize_t i = from; i < r->nstack; i++)
        if (vec_push(r, &c->u.v, r->stack[i]) < 0) return -1;
    r->nstack = from;
    return push(r, c);
}

static int string_op(Reader *r, int width) {
    const unsigned char *n = take(r, width);
    if (!n) return -1;
    uint64_t length = little_endian(n, width);
    if (length > (uint64_t)(r->end - r->p)) DECLINE_INT(r);
    Val *v = new_val(r, V_STR);
    if (!v) return -1;
    v->u.s.p = (const char *)take(r, (Py_ssize_t)length);
    v->u.s.n = (Py_ssize_t)length;
    return push(r, v);
}

static int push_int(Reader *r, int64_t value) {
    if (value >= 0 && value < SMALL_INTS) return push(r, &SMALL[value]);
    Val *v = new_val(r, V_INT);
    if (!v) return -1;
    v->u.i = value;
    return push(r, v);
}

static int int_op(Reader *r, int width, int is_signed) {
    const unsigned char *p = take(r, width);
    if (!p) return -1;
    uint64_t raw = little_endian(p, width);
    return push_int(r, is_signed && width == 4 ? (int64_t)(int32_t)(uint32_t)raw : (int64_t)raw);
}

static int long1(Reader *r) {
    const unsigned char *n = take(r, 1);
    if (!n) return -1;
    if (*n > 8) DECLINE_INT(r);
    const unsigned char *p = take(r, *n);
    if (!p) return -1;
    uint64_t raw = little_endian(p, *n);
    if (*n && *n < 8 && (p[*n - 1] & 0x80)) raw |= ~(uint64_t)0 << (8 * *n);  /* two's complement, sign-extended */
    return push_int(r, (int64_t)raw);
}

static int binfloat(Reader *r) {
    const unsigned char *p = take(r, 8);
    if (!p) return -1;
    uint64_t bits = 0;
    for (int i = 0; i < 8; i++) bits = (bits << 8) | p[i];  /* big-endian IEEE 754 */
    Val *v = new_val(r, V_FLOAT);
    if (!v) return -1;
    memcpy(&v->u.f, &bits, 8);
    return push(r, v);
}

static int stack_global(Reader *r) {
    Val *name = pop(r), *module = name ? pop(r) : NULL;
    if (!module) return -1;
    if (!is_text(name) || !is_text(module)) DECLINE_INT(r);
    PyObject *m = text(r, module), *n = m ? text(r, name) : NULL;
    PyObject *key = n ? PyTuple_Pack(2, m, n) : NULL;
    Py_XDECREF(m);
    Py_XDECREF(n);
    if (!key) return -1;
    PyObject *found = PyDict_GetItemWithError(r->allowlist, key);  /* borrowed */
    Py_DECREF(key);
    if (!found) { if (!PyErr_Occurred()) r->declined = 1; return -1; }  /* off the allowlist: refused there */
    Val *g = new_val(r, V_GLOBAL);
    if (!g) return -1;
    g->u.g.code = (int)PyLong_AsLong(PyTuple_GET_ITEM(found, 0));
    g->u.g.arg = PyTuple_GET_ITEM(found, 1);
    if (g->u.g.code == G_DTYPE) { g->kind = V_DTYPE; g->u.o = g->u.g.arg; }
    else if (g->u.g.code == G_CONST) { g->kind = V_PYSTR; g->u.o = g->u.g.arg; }
    return push(r, g);
}

static Val *new_record(Reader *r, Val *cls) {
    Val *record = new_val(r, V_RECORD);
    if (!record) return NULL;
    record->u.r.kind = cls->u.g.arg;
    int contained = PySequence_Contains(r->state_kinds, record->u.r.kind);
    if (contained < 0) return NULL;
    record->state_record = (unsigned char)contained;
    return record;
}

static int newobj(Reader *r) {  /* cls.__new__(cls): a record with no fields */
    Val *args = pop(r), *cls = args ? pop(r) : NULL;
    if (!cls) return -1;
    if (cls->kind != V_GLOBAL || cls->u.g.code != G_RECORD || args->kind != V_TUPLE || args->u.v.len) DECLINE_INT(r);
    return push(r, new_record(r, cls));
}

static int call_record(Reader *r, Val *cls, Val *args) {  /* cls(*args), an enum in a save plan: `.args` kept */
    Val *record = new_record(r, cls), *name = record ? new_val(r, V_PYSTR) : NULL;
    if (!name) return -1;
    name->u.o = ARGS_NAME;
    if (vec_push(r, &record->u.r.fields, name) < 0 || vec_push(r, &record->u.r.fields, args) < 0) return -1;
    return push(r, record);
}

static int join_path(Reader *r, Val *function, Val *args) {  /* pathlib.PosixPath(*parts): checkpoint_id */
    PyObject *parts = PyTuple_New(args->u.v.len);
    for (Py_ssize_t i = 0; parts && i < args->u.v.len; i++) {
        PyObject *part = is_text(args->u.v.items[i]) ? text(r, args->u.v.items[i]) : NULL;
        if (!part) { Py_CLEAR(parts); if (!PyErr_Occurred()) r->declined = 1; }
        else PyTuple_SET_ITEM(parts, i, part);
    }
    PyObject *joined = parts ? PyObject_CallObject(function->u.g.arg, parts) : NULL;
    Py_XDECREF(parts);
    if (!joined) return -1;
    if (!r->owned && !(r->owned = PyList_New(0))) { Py_DECREF(joined); return -1; }
    int failed = !PyUnicode_CheckExact(joined) || PyList_Append(r->owned, joined) < 0;
    Py_DECREF(joined);  /* held by r->owned */
    if (failed) { if (!PyErr_Occurred()) r->declined = 1; return -1; }
    Val *v = new_val(r, V_PYSTR);
    if (!v) return -1;
    v->u.o = joined;
    return push(r, v);
}

static int reduce(Reader *r) {  /* the calls DCP pickles: torch.Size(tuple), _get_layout(str), the format enum(int) */
    Val *args = pop(r), *call = args ? pop(r) : NULL;
    if (!call) return -1;
    if (call->kind == V_GLOBAL && call->u.g.code == G_PATH && args->kind == V_TUPLE) return join_path(r, call, args);
    if (call->kind == V_GLOBAL && call->u.g.code == G_RECORD && args->kind == V_TUPLE) return call_record(r, call, args);
    if (call->kind != V_GLOBAL || args->kind != V_TUPLE || args->u.v.len != 1) DECLINE_INT(r);
    Val *arg = args->u.v.items[0];
    int code = call->u.g.code;
    if ((code == G_TUPLE && arg->kind == V_TUPLE) || (code == G_STR && is_text(arg)) ||
        (code == G_INT && arg->kind == V_INT))
        return push(r, arg);
    DECLINE_INT(r);
}

static int set_fields(Reader *r, Val *record, Val *state) {
    Vec *fields = &record->u.r.fields;
    if (fields->len + state->u.v.len > 2 * MAX_FIELDS) DECLINE_INT(r);
    if (vec_reserve(r, fields, fields->len + state->u.v.len) < 0) return -1;
    for (Py_ssize_t i = 0; i < state->u.v.len; i += 2) {
        if (!is_text(state->u.v.items[i])) DECLINE_INT(r);
        if (vec_push(r, fields, state->u.v.items[i]) < 0 || vec_push(r, fields, state->u.v.items[i + 1]) < 0)
            return -1;
    }
    return 0;
}

static int build(Reader *r) {
    Val *state = pop(r), *record = state ? top(r) : NULL;
    if (!record) return -1;
    if (record->kind != V_RECORD) DECLINE_INT(r);
    if (state->kind == V_DICT) return set_fields(r, record, state);
    if (!record->state_record || record->u.r.fields.len >= 2 * MAX_FIELDS) DECLINE_INT(r);
    Val *name = new_val(r, V_PYSTR);  /* __setstate__ keeps a state that is not a dict as `.state` */
    if (!name) return -1;
    name->u.o = STATE_NAME;
    if (vec_push(r, &record->u.r.fields, name) < 0) return -1;
    return vec_push(r, &record->u.r.fields, state);
}

static int add_items(Reader *r, Py_ssize_t from, int dict) {  /* APPEND(S), SETITEM(S): the values from `from` */
    Py_ssize_t floor = r->nmarks ? r->marks[r->nmarks - 1] : 0;
    if (from < 0 || from - 1 < floor || from > r->nstack) DECLINE_INT(r);
    Val *target = r->stack[from - 1];
    if (target->kind != (dict ? V_DICT : V_LIST) || (dict && (r->nstack - from) % 2)) DECLINE_INT(r);
    for (Py_ssize_t i = from; i < r->nstack; i++) {
        Val *item = r->stack[i];
        if (dict && (i - from) % 2 == 0) {
            if (item->kind == V_RECORD) { if (item->keyed) DECLINE_INT(r); item->keyed = 1; }
            else if (!is_text(item)) DECLINE_INT(r);
        }
        if (vec_push(r, &target->u.v, item) < 0) return -1;
    }
    r->nstack = from;
    return 0;
}

static int memo_put(Reader *r, uint64_t index) {
    Val *v = top(r);
    if (!v) return -1;
    if (index > (uint64_t)r->nmemo) DECLINE_INT(r);  /* only the next slot, or one already set */
    if (index == (uint64_t)r->nmemo) {
        if (r->nmemo == r->capmemo && grow(r, &r->memo, &r->capmemo) < 0) return -1;
        r->nmemo++;
    }
    r->memo[index] = v;
    return 0;
}

static int memo_get(Reader *r, uint64_t index) {
    if (index >= (uint64_t)r->nmemo) DECLINE_INT(r);
    return push(r, r->memo[index]);
}

static int step(Reader *r, unsigned char op) {
    const unsigned char *a;
    switch (op) {
    case 0x80: a = take(r, 1); return a ? (*a >= 2 && *a <= 5 ? 0 : (r->declined = 1, -1)) : -1;  /* PROTO */
    case 0x95: a = take(r, 8); if (!a) return -1;                                                /* FRAME */
        return little_endian(a, 8) <= (uint64_t)(r->end - r->p) ? 0 : (r->declined = 1, -1);
    case 0x94: return memo_put(r, (uint64_t)r->nmemo);                                        /* MEMOIZE */
    case 'q': a = take(r, 1); return a ? memo_put(r, *a) : -1;                                 /* BINPUT */
    case 'r': a = take(r, 4); return a ? memo_put(r, little_endian(a, 4)) : -1;                /* LONG_BINPUT */
    case 'h': a = take(r, 1); return a ? memo_get(r, *a) : -1;                                 /* BINGET */
    case 'j': a = take(r, 4); return a ? memo_get(r, little_endian(a, 4)) : -1;                /* LONG_BINGET */
    case '(':                                                                                   /* MARK */
        if (r->nmarks == r->capmarks) {
            Py_ssize_t cap = r->capmarks ? r->capmarks * 2 : 16;
            if (charge_memory(r, (cap - r->capmarks) * (Py_ssize_t)sizeof(Py_ssize_t)) < 0) return -1;
            Py_ssize_t *marks = PyMem_Realloc(r->marks, cap * sizeof(Py_ssize_t));
            if (!marks) { PyErr_NoMemory(); return -1; }
            r->marks = marks;
            r->capmarks = cap;
        }
        r->marks[r->nmarks++] = r->nstack;
        return 0;
    case '}': return push(r, new_val(r, V_DICT));                                              /* EMPTY_DICT */
    case ']': return push(r, new_val(r, V_LIST));                                              /* EMPTY_LIST */
    case ')': return push(r, &EMPTY_TUPLE);                                                    /* EMPTY_TUPLE */
    case 't': { Py_ssize_t from = pop_mark(r); return from < 0 ? -1 : collect(r, V_TUPLE, from); }  /* TUPLE */
    case 'l': { Py_ssize_t from = pop_mark(r); return from < 0 ? -1 : collect(r, V_LIST, from); }   /* LIST */
    case 0x85: case 0x86: case 0x87: {                                                          /* TUPLE1-3 */
        Py_ssize_t n = op - 0x84, floor = r->nmarks ? r->marks[r->nmarks - 1] : 0;
        if (r->nstack - n < floor) DECLINE_INT(r);
        return collect(r, V_TUPLE, r->nstack - n);
    }
    case 'a': return add_items(r, r->nstack - 1, 0);                                         /* APPEND */
    case 'e': { Py_ssize_t from = pop_mark(r); return from < 0 ? -1 : add_items(r, from, 0); }  /* APPENDS */
    case 's': return add_items(r, r->nstack - 2, 1);                                         /* SETITEM */
    case 'u': { Py_ssize_t from = pop_mark(r); return from < 0 ? -1 : add_items(r, from, 1); }  /* SETITEMS */
    case 'N': return push(r, &NONE_VAL);
    case 0x88: return push(r, &TRUE_VAL);
    case 0x89: return push(r, &FALSE_VAL);
    case 'K': return int_op(r, 1, 0);                                                           /* BININT1 */
    case 'M': return int_op(r, 2, 0);                                                           /* BININT2 */
    case 'J': return int_op(r, 4, 1);                                                           /* BININT */
    case 0x8a: return long1(r);                                                                 /* LONG1 */
    case 'G': return binfloat(r);                                                               /* BINFLOAT */
    case 0x8c: return string_op(r, 1);                                                          /* SHORT_BINUNICODE */
    case 'X': return string_op(r, 4);                                                           /* BINUNICODE */
    case 0x8d: return string_op(r, 8);                                                          /* BINUNICODE8 */
    case 0x93: return stack_global(r);                                                          /* STACK_GLOBAL */
    case 0x81: return newobj(r);                                                                /* NEWOBJ */
    case 'R': return reduce(r);                                                                 /* REDUCE */
    case 'b': return build(r);                                                                  /* BUILD */
    default: DECLINE_INT(r);  /* anything else DCP does not write */
    }
}

static Val *run(Reader *r) {
    while (r->p < r->end) {
        unsigned char op = *r->p++;
        if (op == '.') {  /* STOP: one value and no open mark, as DCP leaves it */
            if (r->nstack != 1 || r->nmarks) DECLINE(r);
            return r->stack[0];
        }
        if (step(r, op) < 0) return NULL;
    }
    DECLINE(r);  /* no STOP */
}

/* ------------------------------------------------------------------ writing the summary (dcp_summary.summarize) */

static int charge(Reader *r, int64_t units) {
    r->used += units;
    if (r->used > r->limit / 2) DECLINE_INT(r);  /* well before summarize's limit: it then gives the error */
    return 0;
}

static int64_t text_units(Val *v) { return 1 + text_length(v) / 64; }

static Val *field(Val *record, const char *name) {  /* the last value set, as attribute assignment keeps */
    const Vec *fields = &record->u.r.fields;
    for (Py_ssize_t i = (Py_ssize_t)fields->len - 2; i >= 0; i -= 2) {
        Val *key = fields->items[i];
        int same = key->kind == V_PYSTR ? PyUnicode_CompareWithASCIIString(key->u.o, name) == 0
                                        : (strlen(name) == (size_t)key->u.s.n && !memcmp(key->u.s.p, name, key->u.s.n));
        if (same) return fields->items[i + 1];
    }
    return NULL;
}

static int is_kind(Val *v, const char *kind) {
    return v->kind == V_RECORD && PyUnicode_CompareWithASCIIString(v->u.r.kind, kind) == 0;
}

static PyObject *plain(Reader *r, Val *v);

static PyObject *plain_pairs(Reader *r, const Vec *pairs, int skip_args) {  /* a dict of string keys, in order */
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out && i < pairs->len; i += 2) {
        if (!is_text(pairs->items[i])) { Py_DECREF(out); DECLINE(r); }
        PyObject *key = text(r, pairs->items[i]);
        int skipped = key && skip_args ? PyUnicode_Compare(key, ARGS_NAME) == 0 : 0;
        PyObject *value = key && !skipped ? plain(r, pairs->items[i + 1]) : NULL;
        if (!key || (!skipped && (!value || PyDict_SetItem(out, key, value) < 0))) Py_CLEAR(out);
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    return out;
}

static PyObject *plain(Reader *r, Val *v) {
    if (charge(r, 1) < 0) return NULL;
    if (++r->depth > MAX_DEPTH) { r->depth--; DECLINE(r); }
    PyObject *out = NULL;
    switch (v->kind) {
    case V_NONE: out = Py_NewRef(Py_None); break;
    case V_BOOL: out = PyBool_FromLong((long)v->u.i); break;
    case V_INT: out = PyLong_FromLongLong(v->u.i); break;
    case V_FLOAT: out = PyFloat_FromDouble(v->u.f); break;
    case V_STR: case V_PYSTR: out = charge(r, text_length(v) / 64) < 0 ? NULL : text(r, v); break;
    case V_RECORD: out = plain_pairs(r, &v->u.r.fields, 1); break;
    case V_DICT: out = plain_pairs(r, &v->u.v, 0); break;
    case V_TUPLE: case V_LIST:
        out = PyList_New(v->u.v.len);
        for (Py_ssize_t i = 0; out && i < v->u.v.len; i++) {
            PyObject *item = plain(r, v->u.v.items[i]);
            if (!item) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, item);
        }
        break;
    case V_DTYPE:
        out = PyUnicode_FromFormat("torch.%U", v->u.o);
        if (out && charge(r, 1 + PyUnicode_GET_LENGTH(out) / 64) < 0) Py_CLEAR(out);
        break;
    default: r->declined = 1;  /* a global as a value */
    }
    r->depth--;
    return out;
}

static PyObject *numbers(Reader *r, Val *v) {  /* a size or offsets: ints as a list */
    if (!v) return plain(r, &NONE_VAL);
    if (v->kind != V_TUPLE && v->kind != V_LIST) return plain(r, v);
    if (charge(r, 1 + v->u.v.len) < 0) return NULL;
    PyObject *out = PyList_New(v->u.v.len);
    for (Py_ssize_t i = 0; out && i < v->u.v.len; i++) {
        Val *item = v->u.v.items[i];
        if (item->kind != V_INT) { Py_DECREF(out); DECLINE(r); }
        PyObject *n = PyLong_FromLongLong(item->u.i);
        if (!n) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, n);
    }
    return out;
}

static PyObject *dtype_name(Reader *r, Val *properties) {
    if (!properties || properties->kind == V_NONE) return Py_NewRef(Py_None);
    if (properties->kind != V_RECORD) DECLINE(r);
    Val *dtype = field(properties, "dtype"), *state = field(properties, "state");
    if ((!dtype || dtype->kind == V_NONE) && state && state->kind == V_TUPLE && state->u.v.len)
        dtype = state->u.v.items[0];
    if (!dtype || dtype->kind != V_DTYPE) return Py_NewRef(Py_None);
    if (charge(r, 1 + PyUnicode_GET_LENGTH(dtype->u.o) / 64) < 0) return NULL;
    return Py_NewRef(dtype->u.o);
}

static PyObject *entry(Reader *r, Val *fqn, Val *value) {
    if (!is_text(fqn) || value->kind != V_RECORD) DECLINE(r);
    PyObject *name = text(r, fqn);
    if (!name) return NULL;
    if (!is_kind(value, "TensorStorageMetadata")) {
        if (charge(r, text_units(fqn)) < 0) { Py_DECREF(name); return NULL; }
        return Py_BuildValue("[NO]", name, value->u.r.kind);
    }
    Val *chunks = field(value, "chunks");
    Py_ssize_t count = chunks && (chunks->kind == V_LIST || chunks->kind == V_TUPLE) ? chunks->u.v.len : 0;
    if (chunks && chunks->kind != V_NONE && chunks->kind != V_LIST && chunks->kind != V_TUPLE) {
        Py_DECREF(name);
        DECLINE(r);
    }
    PyObject *boxes = charge(r, text_units(fqn) + count) < 0 ? NULL : PyList_New(count);
    for (Py_ssize_t i = 0; boxes && i < count; i++) {
        Val *c = chunks->u.v.items[i];
        if (c->kind != V_RECORD) { Py_CLEAR(boxes); r->declined = 1; break; }
        PyObject *offsets = numbers(r, field(c, "offsets"));
        PyObject *sizes = offsets ? numbers(r, field(c, "sizes")) : NULL;
        PyObject *box = sizes ? PyList_New(2) : NULL;
        if (!box) { Py_XDECREF(offsets); Py_XDECREF(sizes); Py_CLEAR(boxes); break; }
        PyList_SET_ITEM(box, 0, offsets);
        PyList_SET_ITEM(box, 1, sizes);
        PyList_SET_ITEM(boxes, i, box);
    }
    PyObject *dtype = boxes ? dtype_name(r, field(value, "properties")) : NULL;
    PyObject *size = dtype ? numbers(r, field(value, "size")) : NULL;
    if (!size) { Py_DECREF(name); Py_XDECREF(boxes); Py_XDECREF(dtype); return NULL; }
    return Py_BuildValue("[NONNN]", name, value->u.r.kind, dtype, size, boxes);
}

static PyObject *storage_item(Reader *r, Val *index, Val *info) {
    Val *fqn = is_kind(index, "MetadataIndex") ? field(index, "fqn") : NULL;
    if (!fqn || !is_text(fqn) || info->kind != V_RECORD) DECLINE(r);
    Val *relative = field(info, "relative_path"), *begin = field(info, "offset");
    Val *length = field(info, "length"), *transforms = field(info, "transform_descriptors");
    Val *offset = field(index, "offset");
    if (!relative || !is_text(relative) || !begin || begin->kind != V_INT || !length || length->kind != V_INT)
        DECLINE(r);
    Py_ssize_t count = 0;
    if (transforms && transforms->kind != V_NONE) {
        if (transforms->kind != V_LIST && transforms->kind != V_TUPLE) DECLINE(r);
        count = transforms->u.v.len;
        for (Py_ssize_t i = 0; i < count; i++)
            if (!is_text(transforms->u.v.items[i])) DECLINE(r);
        if (charge(r, count) < 0) return NULL;
    }
    if (charge(r, text_units(fqn) + text_units(relative)) < 0) return NULL;
    PyObject *names = PyList_New(count);
    for (Py_ssize_t i = 0; names && i < count; i++) {
        PyObject *t = text(r, transforms->u.v.items[i]);
        if (!t) Py_CLEAR(names);
        else PyList_SET_ITEM(names, i, t);
    }
    PyObject *key = names ? text(r, fqn) : NULL;
    PyObject *at = !key ? NULL : (!offset || offset->kind == V_NONE) ? Py_NewRef(Py_None) : numbers(r, offset);
    PyObject *file = at ? text(r, relative) : NULL;
    if (!file) { Py_XDECREF(names); Py_XDECREF(key); Py_XDECREF(at); return NULL; }
    return Py_BuildValue("[NNNLLN]", key, at, file, (long long)begin->u.i, (long long)length->u.i, names);
}

static PyObject *planner_data(Reader *r, Val *v) {
    if (!v || v->kind != V_DICT) return plain(r, v ? v : &NONE_VAL);
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out && i < v->u.v.len; i += 2) {
        Val *key = v->u.v.items[i], *path = v->u.v.items[i + 1];
        if (!is_text(key)) { Py_DECREF(out); DECLINE(r); }
        PyObject *value = NULL;
        int all_text = path->kind == V_TUPLE;
        int64_t length = text_length(key);
        for (Py_ssize_t j = 0; all_text && j < path->u.v.len; j++) {
            all_text = is_text(path->u.v.items[j]);
            if (all_text) length += text_length(path->u.v.items[j]);
        }
        if (all_text) {  /* a list of its strings, charged as summarize charges it */
            value = charge(r, 2 + path->u.v.len + length / 64) < 0 ? NULL : PyList_New(path->u.v.len);
            for (Py_ssize_t j = 0; value && j < path->u.v.len; j++) {
                PyObject *part = text(r, path->u.v.items[j]);
                if (!part) Py_CLEAR(value);
                else PyList_SET_ITEM(value, j, part);
            }
        } else if (charge(r, 1) == 0) {
            value = plain(r, path);
        }
        PyObject *name = value ? text(r, key) : NULL;
        if (!name || PyDict_SetItem(out, name, value) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
        Py_XDECREF(value);
    }
    return out;
}

static Val *field_or_none(Val *record, const char *name) {
    Val *v = field(record, name);
    return v ? v : &NONE_VAL;
}

static PyObject *summarize(Reader *r, Val *root) {
    if (!is_kind(root, "Metadata")) DECLINE(r);
    Val *state = field(root, "state_dict_metadata"), *storage = field(root, "storage_data");
    if (!state || !storage || (state->kind != V_DICT && state->kind != V_NONE) ||
        (storage->kind != V_DICT && storage->kind != V_NONE))
        DECLINE(r);
    Py_ssize_t n_state = state->kind == V_DICT ? state->u.v.len : 0;
    Py_ssize_t n_storage = storage->kind == V_DICT ? storage->u.v.len : 0;
    if (charge(r, (n_state + n_storage) / 2) < 0) return NULL;
    /* a dict's key set again keeps its first place and takes the last value, as in the dict summarize walks */
    PyObject *entries = PyDict_New();
    for (Py_ssize_t i = 0; entries && i < n_state; i += 2) {
        PyObject *row = entry(r, state->u.v.items[i], state->u.v.items[i + 1]);
        if (!row || PyDict_SetItem(entries, PyList_GET_ITEM(row, 0), row) < 0) Py_CLEAR(entries);
        Py_XDECREF(row);
    }
    PyObject *rows = entries ? PyList_New(n_storage / 2) : NULL;
    for (Py_ssize_t i = 0; rows && i < n_storage; i += 2) {
        PyObject *row = storage_item(r, storage->u.v.items[i], storage->u.v.items[i + 1]);
        if (!row) Py_CLEAR(rows);
        else PyList_SET_ITEM(rows, i / 2, row);
    }
    PyObject *version = rows ? plain(r, field_or_none(root, "version")) : NULL;
    PyObject *meta = version ? plain(r, field_or_none(root, "storage_meta")) : NULL;
    PyObject *planner = meta ? planner_data(r, field(root, "planner_data")) : NULL;
    PyObject *values = planner ? PyDict_Values(entries) : NULL;
    PyObject *out = values ? Py_BuildValue("{sNsNsNsNsN}", "entries", values, "storage", rows, "version", version,
                                           "storage_meta", meta, "planner_data", planner) : NULL;
    if (!out) { Py_XDECREF(rows); Py_XDECREF(version); Py_XDECREF(meta); Py_XDECREF(planner); }
    Py_XDECREF(entries);
    return out;
}

static PyObject *summarize_pickle(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    Reader r;
    memset(&r, 0, sizeof r);
    long long limit, memory_limit;
    if (!PyArg_ParseTuple(args, "y*O!LLO", &data, &PyDict_Type, &r.allowlist, &limit, &memory_limit,
                          &r.state_kinds))
        return NULL;
    r.p = data.buf;
    r.end = r.p + data.len;
    r.limit = limit;
    r.memory_limit = (Py_ssize_t)memory_limit;
    Val *root = run(&r);
    PyObject *out = root ? summarize(&r, root) : NULL;
    free_reader(&r);
    PyBuffer_Release(&data);
    if (!out && r.declined && !PyErr_Occurred()) Py_RETURN_NONE;
    if (!out && r.declined && PyErr_ExceptionMatches(PyExc_RecursionError)) { PyErr_Clear(); Py_RETURN_NONE; }
    return out;
}

static PyMethodDef methods[] = {
    {"summarize", summarize_pickle, METH_VARARGS,
     "summarize(data, allowlist, budget, memory, state_kinds) -> the summary of a DCP .metadata pickle, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dcp_pickle", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dcp_pickle(void) {
    for (int i = 0; i < SMALL_INTS; i++) {
        SMALL[i].kind = V_INT;
        SMALL[i].u.i = i;
    }
    STATE_NAME = PyUnicode_InternFromString("state");
    ARGS_NAME = PyUnicode_InternFromString("args");
    if (!STATE_NAME || !ARGS_NAME) return NULL;
    return PyModule_Create(&module);
}
