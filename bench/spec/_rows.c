/* The one loop's per-row work in C: the simulator's recorded verdicts and the scheduler's settle.
 *
 * bench/spec/compiled_rows.py says why it exists and how it is checked; the Python functions it
 * mirrors (bench.spec.recorded.recorded_verdicts_python, bench.spec.scheduler.Scheduler.
 * _settle_all_python with bench.core.drafting.settle_many) stay the reference, and tests/test_compiled_rows.py checks that
 * both give equal verdicts, equal rows and equal counters on random passes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_tokens, *s_logprobs, *s_token_ids, *s_parents, *s_emitted, *s_path, *s_margins,
    *s_counters, *s_cached, *s_pending, *s_output, *s_limit, *s_first_t, *s_last_t, *s_finish_reason,
    *s_final_reason, *s_passes, *s_drafts, *s_draft_tokens, *s_accepted_tokens, *s_per_pos, *s_stop,
    *s_length, *s_empty;

static PyObject *no_args;  /* () */

/* An int (or anything with __index__, such as a numpy integer) as a Py_ssize_t; -1 with an
 * exception set on failure, as PyLong_AsSsize_t. */
static Py_ssize_t as_ssize(PyObject *x) {
    return PyLong_CheckExact(x) ? PyLong_AsSsize_t(x) : PyNumber_AsSsize_t(x, PyExc_OverflowError);
}

/* The chain paths (0, 1, ..., a), shared for a < CHAIN_PATHS as the Python reference's tuples are
 * equal to them: a verdict's path is read, never changed. */
#define CHAIN_PATHS 1024
static PyObject *chain_paths[CHAIN_PATHS];

static PyObject *chain_path(Py_ssize_t a) {
    if (a < CHAIN_PATHS && chain_paths[a] != NULL) {
        Py_INCREF(chain_paths[a]);
        return chain_paths[a];
    }
    PyObject *out = PyTuple_New(a + 1);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i <= a; i++) {
        PyObject *x = PyLong_FromSsize_t(i);
        if (x == NULL) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, x);
    }
    if (a < CHAIN_PATHS) {
        Py_INCREF(out);
        chain_paths[a] = out;
    }
    return out;
}

/* A new Verdict (a slots dataclass) with its four fields set, without running its Python __init__
 * (Verdict has no __post_init__ to skip); its margins are the shared () (recordings have none). */
static PyObject *new_verdict(PyTypeObject *type, PyObject *emitted, PyObject *path, PyObject *logprobs) {
    if (type->tp_new == NULL) {
        PyErr_Format(PyExc_TypeError, "recorded_verdicts: %s cannot be instantiated", type->tp_name);
        return NULL;
    }
    PyObject *v = type->tp_new(type, no_args, NULL);
    if (v == NULL) return NULL;
    if (PyObject_SetAttr(v, s_emitted, emitted) < 0 || PyObject_SetAttr(v, s_path, path) < 0 ||
        PyObject_SetAttr(v, s_logprobs, logprobs) < 0 || PyObject_SetAttr(v, s_margins, no_args) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

/* The accepted local nodes of a tree draft against the recorded tokens from position t: from the
 * root, the first node (in index order) whose parent is the current node and whose token is the
 * recorded one at its depth (bench.core.verdicts.descend: the first node wins on duplicate
 * siblings). Fills path[0..] and returns its length, or -1 with an exception set. */
static Py_ssize_t tree_path(PyObject *toks, Py_ssize_t t, PyObject *ids, PyObject *parents, Py_ssize_t *path) {
    Py_ssize_t k = PyList_GET_SIZE(ids), n = PyList_GET_SIZE(toks), len = 1, node = 0, depth = 0;
    path[0] = 0;
    for (;;) {
        if (t + depth >= n) return len;
        PyObject *want = PyList_GET_ITEM(toks, t + depth);
        Py_ssize_t child = -1;
        for (Py_ssize_t i = node; i < k; i++) {  /* a child's index is past its parent's */
            Py_ssize_t p = as_ssize(PyList_GET_ITEM(parents, i));
            if (p == -1 && PyErr_Occurred()) return -1;
            if (p + 1 != node) continue;
            int eq = PyObject_RichCompareBool(PyList_GET_ITEM(ids, i), want, Py_EQ);
            if (eq < 0) return -1;
            if (eq) { child = i + 1; break; }
        }
        if (child < 0) return len;
        node = child;
        path[len++] = node;
        depth++;
    }
}

/* *x as a list (a tuple or other sequence is copied into one; a list is kept). */
static int as_list(PyObject **x) {
    if (PyList_Check(*x)) return 0;
    PyObject *copy = PySequence_List(*x);
    Py_DECREF(*x);
    *x = copy;
    return copy == NULL ? -1 : 0;
}

/* recorded_verdicts(Verdict, recs, out_lens, drafts) -> [Verdict, ...]: bench.spec.recorded's. */
static PyObject *py_recorded_verdicts(PyObject *self, PyObject *args) {
    PyObject *vtype, *recs, *out_lens, *drafts;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyType_Type, &vtype, &PyList_Type, &recs, &PyList_Type, &out_lens,
                          &PyList_Type, &drafts))
        return NULL;
    Py_ssize_t rows = PyList_GET_SIZE(recs);
    if (PyList_GET_SIZE(out_lens) != rows || PyList_GET_SIZE(drafts) != rows) {
        PyErr_SetString(PyExc_ValueError, "recorded_verdicts: recs, out_lens and drafts differ in length");
        return NULL;
    }
    PyObject *out = PyList_New(rows);
    if (out == NULL) return NULL;
    Py_ssize_t *path = NULL, path_cap = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        PyObject *rec = PyList_GET_ITEM(recs, r), *draft = PyList_GET_ITEM(drafts, r);
        PyObject *toks = NULL, *lps = NULL, *ids = NULL, *parents = NULL, *path_list = NULL, *emitted = NULL,
                 *elps = NULL, *v = NULL;
        Py_ssize_t t = as_ssize(PyList_GET_ITEM(out_lens, r)), a = 0, n;
        if (t == -1 && PyErr_Occurred()) goto fail;
        toks = PyObject_GetAttr(rec, s_tokens);
        lps = toks ? PyObject_GetAttr(rec, s_logprobs) : NULL;
        ids = lps ? PyObject_GetAttr(draft, s_token_ids) : NULL;
        parents = ids ? PyObject_GetAttr(draft, s_parents) : NULL;
        if (parents == NULL) goto row_fail;
        if (as_list(&toks) < 0 || as_list(&lps) < 0 || as_list(&ids) < 0 || (parents != Py_None && as_list(&parents) < 0))
            goto row_fail;
        n = PyList_GET_SIZE(toks);
        if (t < 0 || t > n) {
            PyErr_Format(PyExc_ValueError, "recorded_verdicts: output length %zd outside the recorded %zd tokens", t, n);
            goto row_fail;
        }
        if (PyList_GET_SIZE(ids) == 0) {
            path_list = chain_path(0);
        } else if (parents == Py_None) {  /* a chain: its longest prefix equal to the recording */
            Py_ssize_t k = PyList_GET_SIZE(ids);
            if (k > n - t) k = n - t;
            while (a < k) {
                int eq = PyObject_RichCompareBool(PyList_GET_ITEM(ids, a), PyList_GET_ITEM(toks, t + a), Py_EQ);
                if (eq < 0) goto row_fail;
                if (!eq) break;
                a++;
            }
            path_list = chain_path(a);
        } else {
            Py_ssize_t k = PyList_GET_SIZE(ids), len;
            if (PyList_GET_SIZE(parents) != k) {
                PyErr_SetString(PyExc_ValueError, "recorded_verdicts: a draft's parents and token_ids differ in length");
                goto row_fail;
            }
            if (k + 1 > path_cap) {
                Py_ssize_t *grown = PyMem_Realloc(path, (k + 1) * sizeof(Py_ssize_t));
                if (grown == NULL) { PyErr_NoMemory(); goto row_fail; }
                path = grown;
                path_cap = k + 1;
            }
            len = tree_path(toks, t, ids, parents, path);
            if (len < 0) goto row_fail;
            path_list = PyList_New(len);
            if (path_list == NULL) goto row_fail;
            for (Py_ssize_t i = 0; i < len; i++) {
                PyObject *x = PyLong_FromSsize_t(path[i]);
                if (x == NULL) goto row_fail;
                PyList_SET_ITEM(path_list, i, x);
            }
        }
        if (path_list == NULL) goto row_fail;
        {  /* accepted + bonus, cut at the end of the recorded rollout */
            Py_ssize_t end = t + PySequence_Fast_GET_SIZE(path_list);
            emitted = PyList_GetSlice(toks, t, end < n ? end : n);
            if (emitted == NULL) goto row_fail;
            /* the empty draft's logprobs are lps[t:t + 1], as in Python; the same wherever the
               recording has one logprob per token */
            elps = PyList_GetSlice(lps, t, PyList_GET_SIZE(ids) ? t + PyList_GET_SIZE(emitted) : t + 1);
        }
        if (elps == NULL) goto row_fail;
        v = new_verdict((PyTypeObject *)vtype, emitted, path_list, elps);
        if (v == NULL) goto row_fail;
        PyList_SET_ITEM(out, r, v);
        Py_DECREF(toks); Py_DECREF(lps); Py_DECREF(ids); Py_DECREF(parents);
        Py_DECREF(path_list); Py_DECREF(emitted); Py_DECREF(elps);
        continue;
    row_fail:
        Py_XDECREF(toks); Py_XDECREF(lps); Py_XDECREF(ids); Py_XDECREF(parents);
        Py_XDECREF(path_list); Py_XDECREF(emitted); Py_XDECREF(elps);
        goto fail;
    }
    PyMem_Free(path);
    return out;
fail:
    PyMem_Free(path);
    Py_DECREF(out);
    return NULL;
}

/* obj.name += delta for an int attribute. */
static int add_int(PyObject *obj, PyObject *name, Py_ssize_t delta) {
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL) return -1;
    Py_ssize_t v = as_ssize(x);
    Py_DECREF(x);
    if (v == -1 && PyErr_Occurred()) return -1;
    PyObject *y = PyLong_FromSsize_t(v + delta);
    if (y == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, y);
    Py_DECREF(y);
    return rc;
}

/* DraftCounters.record(draft_len, accepted), or the undrafted pass's count. */
static int count_pass(PyObject *c, Py_ssize_t k, Py_ssize_t acc) {
    if (add_int(c, s_passes, 1) < 0) return -1;
    if (!k) return 0;
    if (add_int(c, s_drafts, 1) < 0 || add_int(c, s_draft_tokens, k) < 0 || add_int(c, s_accepted_tokens, acc) < 0)
        return -1;
    PyObject *per_pos = PyObject_GetAttr(c, s_per_pos);
    if (per_pos == NULL) return -1;
    if (!PyList_Check(per_pos)) {
        Py_DECREF(per_pos);
        PyErr_SetString(PyExc_TypeError, "num_accepted_tokens_per_pos must be a list");
        return -1;
    }
    for (Py_ssize_t i = 0; i < acc; i++) {
        PyObject *old = i < PyList_GET_SIZE(per_pos) ? PyList_GET_ITEM(per_pos, i) : NULL;
        Py_ssize_t v = old == NULL ? 0 : as_ssize(old);
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(per_pos); return -1; }
        PyObject *y = PyLong_FromSsize_t(v + 1);
        if (y == NULL) { Py_DECREF(per_pos); return -1; }
        if (old == NULL) {
            int rc = PyList_Append(per_pos, y);
            Py_DECREF(y);
            if (rc < 0) { Py_DECREF(per_pos); return -1; }
        } else {
            PyList_SetItem(per_pos, i, y);  /* steals y */
        }
    }
    Py_DECREF(per_pos);
    return 0;
}

/* lst += more */
static int extend(PyObject *lst, PyObject *more) {
    PyObject *r = PySequence_InPlaceConcat(lst, more);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* One row of Scheduler._settle_all with records off; returns the (emitted, accepted) tuple. */
static PyObject *settle_row(PyObject *row, Py_ssize_t k, PyObject *verdict, PyObject *stops, PyObject *now) {
    PyObject *em = NULL, *path = NULL, *lps = NULL, *mgs = NULL, *output = NULL, *pending = NULL, *counters = NULL,
             *limit_o = NULL, *row_lps = NULL, *reason = NULL, *result = NULL;
    int has_stops = PySet_GET_SIZE(stops) > 0;
    em = PyObject_GetAttr(verdict, s_emitted);
    path = em ? PyObject_GetAttr(verdict, s_path) : NULL;
    lps = path ? PyObject_GetAttr(verdict, s_logprobs) : NULL;
    mgs = lps ? PyObject_GetAttr(verdict, s_margins) : NULL;
    output = mgs ? PyObject_GetAttr(row, s_output) : NULL;
    pending = output ? PyObject_GetAttr(row, s_pending) : NULL;
    counters = pending ? PyObject_GetAttr(row, s_counters) : NULL;
    limit_o = counters ? PyObject_GetAttr(row, s_limit) : NULL;
    if (limit_o == NULL) goto done;
    if (as_list(&em) < 0 || as_list(&lps) < 0) goto done;  /* path and margins: any sequence (read only) */
    if (!PyList_Check(output) || !PyList_Check(pending)) {
        PyErr_SetString(PyExc_TypeError, "settle_rows: a row's output, pending, logprobs and margins must be lists");
        goto done;
    }
    Py_ssize_t limit = as_ssize(limit_o);
    if (limit == -1 && PyErr_Occurred()) goto done;
    Py_ssize_t out_len = PyList_GET_SIZE(output), room = limit - out_len, len_em = PyList_GET_SIZE(em);
    Py_ssize_t len_path = PyObject_Size(path), len_mgs = PyObject_Size(mgs);
    if (len_path < 0 || len_mgs < 0) goto done;
    Py_ssize_t acc = len_path - 1, n = len_em;
    if (has_stops || room < n) {  /* bench.core.drafting.cut_emitted */
        n = len_em < (room > 0 ? room : 0) ? len_em : (room > 0 ? room : 0);
        if (has_stops) {
            for (Py_ssize_t i = 0; i < n; i++) {
                int in = PySet_Contains(stops, PyList_GET_ITEM(em, i));
                if (in < 0) goto done;
                if (in) { n = i + 1; break; }
            }
        }
    }
    if (acc > n) acc = n;
    if (count_pass(counters, k, acc) < 0) goto done;
    if (n && has_stops) {
        int in = PySet_Contains(stops, PyList_GET_ITEM(em, n - 1));
        if (in < 0) goto done;
        reason = in ? s_stop : NULL;
    }
    if (reason == NULL) reason = n >= room ? s_length : s_empty;
    if (add_int(row, s_cached, PyList_GET_SIZE(pending) + len_path - 1) < 0) goto done;
    if (n < len_em) {  /* cut: the kept prefix of each list */
        PyObject *e2 = PyList_GetSlice(em, 0, n), *l2 = PyList_GetSlice(lps, 0, n), *m2 = PySequence_GetSlice(mgs, 0, n);
        Py_DECREF(em); Py_DECREF(lps); Py_DECREF(mgs);
        em = e2; lps = l2; mgs = m2;
        if (em == NULL || lps == NULL || mgs == NULL) goto done;
    }
    if (out_len == 0 && PyObject_SetAttr(row, s_first_t, now) < 0) goto done;
    if (extend(output, em) < 0) goto done;
    row_lps = PyObject_GetAttr(row, s_logprobs);
    if (row_lps == NULL) goto done;
    if (!PyList_Check(row_lps)) {
        PyErr_SetString(PyExc_TypeError, "settle_rows: a row's output, pending, logprobs and margins must be lists");
        goto done;
    }
    if (extend(row_lps, lps) < 0) goto done;
    if (len_mgs && PyObject_Size(mgs)) {
        PyObject *row_mgs = PyObject_GetAttr(row, s_margins);
        if (row_mgs == NULL) goto done;
        if (!PyList_Check(row_mgs)) {
            Py_DECREF(row_mgs);
            PyErr_SetString(PyExc_TypeError, "settle_rows: a row's output, pending, logprobs and margins must be lists");
            goto done;
        }
        int rc = extend(row_mgs, mgs);
        Py_DECREF(row_mgs);
        if (rc < 0) goto done;
    }
    if (PyObject_SetAttr(row, s_last_t, now) < 0) goto done;
    Py_ssize_t kept = PyList_GET_SIZE(em);
    if (kept) {
        PyObject *last = PyList_New(1);
        if (last == NULL) goto done;
        PyObject *tok = PyList_GET_ITEM(em, kept - 1);
        Py_INCREF(tok);
        PyList_SET_ITEM(last, 0, tok);
        int rc = PyObject_SetAttr(row, s_pending, last);
        Py_DECREF(last);
        if (rc < 0) goto done;
    }
    if (reason != s_empty || !kept) {  /* done: the recorded reason where the backend knows it */
        PyObject *final = PyObject_GetAttr(row, s_final_reason);
        if (final == NULL) goto done;
        int truth = PyObject_IsTrue(final);
        if (truth < 0) { Py_DECREF(final); goto done; }
        int rc = PyObject_SetAttr(row, s_finish_reason, truth ? final : (reason != s_empty ? reason : s_stop));
        Py_DECREF(final);
        if (rc < 0) goto done;
    }
    {
        PyObject *a = PyLong_FromSsize_t(acc);
        if (a == NULL) goto done;
        result = PyTuple_Pack(2, em, a);
        Py_DECREF(a);
    }
done:
    Py_XDECREF(em); Py_XDECREF(path); Py_XDECREF(lps); Py_XDECREF(mgs); Py_XDECREF(output); Py_XDECREF(pending);
    Py_XDECREF(counters); Py_XDECREF(limit_o); Py_XDECREF(row_lps);
    return result;
}

/* settle_rows(rows, draft_lens, verdicts, stops, now) -> [(emitted, accepted), ...]:
 * Scheduler._settle_all with records off. */
static PyObject *py_settle_rows(PyObject *self, PyObject *args) {
    PyObject *rows, *draft_lens, *verdicts, *stops, *now;
    if (!PyArg_ParseTuple(args, "O!O!O!OO", &PyList_Type, &rows, &PyList_Type, &draft_lens, &PyList_Type,
                          &verdicts, &stops, &now))
        return NULL;
    if (!PyAnySet_Check(stops)) {
        PyErr_SetString(PyExc_TypeError, "settle_rows: stops must be a set");
        return NULL;
    }
    Py_ssize_t m = PyList_GET_SIZE(rows);
    if (PyList_GET_SIZE(draft_lens) != m || PyList_GET_SIZE(verdicts) != m) {
        PyErr_SetString(PyExc_ValueError, "settle_rows: rows, draft_lens and verdicts differ in length");
        return NULL;
    }
    PyObject *out = PyList_New(m);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t k = as_ssize(PyList_GET_ITEM(draft_lens, i));
        if (k == -1 && PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        PyObject *s = settle_row(PyList_GET_ITEM(rows, i), k, PyList_GET_ITEM(verdicts, i), stops, now);
        if (s == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, s);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"recorded_verdicts", py_recorded_verdicts, METH_VARARGS,
     "recorded_verdicts(Verdict, recs, out_lens, drafts): bench.spec.recorded.recorded_verdicts in C."},
    {"settle_rows", py_settle_rows, METH_VARARGS,
     "settle_rows(rows, draft_lens, verdicts, stops, now): the scheduler's settle of a pass in C (records off)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "The one loop's per-row work in C.", -1, methods};

PyMODINIT_FUNC PyInit__rows(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_tokens, "tokens"); INTERN(s_logprobs, "logprobs"); INTERN(s_token_ids, "token_ids");
    INTERN(s_parents, "parents"); INTERN(s_emitted, "emitted"); INTERN(s_path, "path"); INTERN(s_margins, "margins");
    INTERN(s_counters, "counters"); INTERN(s_cached, "cached"); INTERN(s_pending, "pending");
    INTERN(s_output, "output"); INTERN(s_limit, "limit"); INTERN(s_first_t, "first_t"); INTERN(s_last_t, "last_t");
    INTERN(s_finish_reason, "finish_reason"); INTERN(s_final_reason, "final_reason");
    INTERN(s_passes, "num_forward_passes"); INTERN(s_drafts, "num_drafts"); INTERN(s_draft_tokens, "num_draft_tokens");
    INTERN(s_accepted_tokens, "num_accepted_tokens"); INTERN(s_per_pos, "num_accepted_tokens_per_pos");
    INTERN(s_stop, "stop"); INTERN(s_length, "length"); INTERN(s_empty, "");
    if ((no_args = PyTuple_New(0)) == NULL) return NULL;
#undef INTERN
    return PyModule_Create(&module);
}
