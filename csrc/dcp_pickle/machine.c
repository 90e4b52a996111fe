/* machine.c: the subset of the pickle machine that DCP's `.metadata` uses, into the values of reader.h. */

#include "reader.h"

Val NONE_VAL = {V_NONE, 0, 0, {0}};
static Val TRUE_VAL = {V_BOOL, 0, 0, {1}};
static Val FALSE_VAL = {V_BOOL, 0, 0, {0}};
static Val EMPTY_TUPLE = {V_TUPLE, 0, 0, {0}};  /* immutable, so shared: DCP pickles one per record */
static Val SMALL[SMALL_INTS];                   /* 0..255, set up at import */
PyObject *STATE_NAME, *ARGS_NAME;


int charge_memory(Reader *r, Py_ssize_t bytes) {
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

void free_reader(Reader *r) {
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
    if (r->frame_end && r->p < r->frame_end && r->frame_end - r->p < n) DECLINE(r);  /* across a frame's end */
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

int is_text(Val *v) { return v->kind == V_STR || v->kind == V_PYSTR; }

PyObject *text(Reader *r, Val *v) {  /* a new reference, or NULL (declined on invalid UTF-8) */
    if (v->kind == V_PYSTR) return Py_NewRef(v->u.o);
    if (!v->u.s.decoded) {  /* once: a memoized string (a file's name) is one object wherever it is used */
        if (charge_memory(r, 64 + 4 * v->u.s.n) < 0) return NULL;
        v->u.s.decoded = PyUnicode_DecodeUTF8(v->u.s.p, v->u.s.n, "surrogatepass");  /* as the C unpickler */
        if (!v->u.s.decoded && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); r->declined = 1; }
    }
    return Py_XNewRef(v->u.s.decoded);
}

Py_ssize_t text_length(Val *v) {  /* bytes: at least the characters summarize counts */
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

static int valid_utf8(const unsigned char *p, Py_ssize_t n) {  /* as decoding with "surrogatepass" accepts */
    const unsigned char *end = p + n;
    while (p < end) {
        unsigned char c = *p;
        if (c < 0x80) { p++; continue; }
        int more = c >= 0xC2 && c <= 0xDF ? 1 : c >= 0xE0 && c <= 0xEF ? 2 : c >= 0xF0 && c <= 0xF4 ? 3 : -1;
        if (more < 0 || end - p <= more) return 0;
        unsigned char low = 0x80, high = 0xBF;  /* the second byte's range */
        if (c == 0xE0) low = 0xA0;
        else if (c == 0xF0) low = 0x90;
        else if (c == 0xF4) high = 0x8F;  /* 0xED's A0-BF (surrogates) are kept, as surrogatepass keeps them */
        if (p[1] < low || p[1] > high) return 0;
        for (int i = 2; i <= more; i++)
            if ((p[i] & 0xC0) != 0x80) return 0;
        p += more + 1;
    }
    return 1;
}

static int string_op(Reader *r, int width) {
    const unsigned char *n = take(r, width);
    if (!n) return -1;
    uint64_t length = little_endian(n, width);
    if (length > (uint64_t)(r->end - r->p)) DECLINE_INT(r);
    Val *v = new_val(r, V_STR);
    if (!v) return -1;
    const unsigned char *bytes = take(r, (Py_ssize_t)length);
    if (!bytes) return -1;
    if (!valid_utf8(bytes, (Py_ssize_t)length)) DECLINE_INT(r);  /* the C unpickler decodes every string */
    v->u.s.p = (const char *)bytes;
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
    if (++r->paths > MAX_PATHS || args->u.v.len > MAX_PATH_PARTS) DECLINE_INT(r);
    Py_ssize_t length = 0;
    for (Py_ssize_t i = 0; i < args->u.v.len; i++)
        length += is_text(args->u.v.items[i]) ? 1 + text_length(args->u.v.items[i]) : 0;
    if (charge_memory(r, 64 + 4 * length) < 0) return -1;
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
        Val *name = state->u.v.items[i];
        if (!is_text(name)) DECLINE_INT(r);
        /* a name such as __setstate__ would change how the C unpickler applies a later BUILD: DCP sets none */
        if (name->kind == V_STR ? name->u.s.n >= 2 && !memcmp(name->u.s.p, "__", 2)
                                : PyUnicode_GET_LENGTH(name->u.o) >= 2 && PyUnicode_READ_CHAR(name->u.o, 0) == '_' &&
                                  PyUnicode_READ_CHAR(name->u.o, 1) == '_')
            DECLINE_INT(r);
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
    case 0x95:                                                                                  /* FRAME */
        if (r->frame_end && r->p < r->frame_end) DECLINE_INT(r);  /* inside another frame */
        a = take(r, 8);
        if (!a) return -1;
        if (little_endian(a, 8) > (uint64_t)(r->end - r->p)) DECLINE_INT(r);
        r->frame_end = r->p + little_endian(a, 8);
        return 0;
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

Val *run(Reader *r) {
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

int machine_init(void) {
    for (int i = 0; i < SMALL_INTS; i++) {
        SMALL[i].kind = V_INT;
        SMALL[i].u.i = i;
    }
    STATE_NAME = PyUnicode_InternFromString("state");
    ARGS_NAME = PyUnicode_InternFromString("args");
    return STATE_NAME && ARGS_NAME ? 0 : -1;
}
