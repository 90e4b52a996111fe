/* summary.c: the summary dcp_summary.summarize gives, written from the values machine.c read; the module. */

#include "reader.h"

static int charge(Reader *r, int64_t units) {
    if (charge_memory(r, (Py_ssize_t)units * UNIT_BYTES) < 0) return -1;  /* the Python objects the walk makes */
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
    if (!values) { Py_XDECREF(rows); Py_XDECREF(version); Py_XDECREF(meta); Py_XDECREF(planner); }  /* else the
                                                                   failed Py_BuildValue released its N arguments */
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
    if (data.len >= MAX_PICKLE_BYTES) {  /* dcp_metadata reads at most 1 GB: this one is for other callers */
        PyBuffer_Release(&data);
        Py_RETURN_NONE;
    }
    r.p = data.buf;
    r.end = r.p + data.len;
    r.limit = limit;
    r.memory_limit = (Py_ssize_t)memory_limit;
    Val *root = run(&r);
    PyObject *out = root ? summarize(&r, root) : NULL;
    free_reader(&r);
    PyBuffer_Release(&data);
    if (!out && r.declined && !PyErr_Occurred()) Py_RETURN_NONE;
    return out;
}

static PyMethodDef methods[] = {
    {"summarize", summarize_pickle, METH_VARARGS,
     "summarize(data, allowlist, budget, memory, state_kinds) -> the summary of a DCP .metadata pickle, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dcp_pickle", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dcp_pickle(void) {
    return machine_init() < 0 ? NULL : PyModule_Create(&module);
}
