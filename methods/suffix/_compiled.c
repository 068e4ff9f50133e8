/* The counted suffix automaton of methods/suffix/automaton.py and the queries of
 * methods/suffix/index.py, compiled: the same states, counts, times, top children and drafts
 * (every float operation in the same order, so scores equal to the bit), in C arrays this object
 * owns. methods/suffix/compiled.py wraps it as CompiledIndex; the Python modules are the
 * reference and their docstrings say why each step is right. tests/test_suffix_index.py runs its
 * checks against the trie on both. Built by setup.py where a C compiler is at hand (optional:
 * without one the pure-Python index runs). Compile with -ffp-contract=off (no fused multiply-add)
 * so products and sums round as Python's do. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NO_TOKEN INT32_MIN
#define UNKNOWN (-2)
#define START_TOKEN (-1)
#define BYTES(p) ((p) ? (const char *)(p) : "")

typedef struct { int32_t *v; int32_t n, cap; } ivec;
typedef struct { int64_t *v; int32_t n, cap; } lvec;

static int ivec_push(ivec *a, int32_t x) {
    if (a->n == a->cap) {
        int32_t cap = a->cap ? a->cap * 2 : 4;
        int32_t *v = PyMem_Realloc(a->v, (size_t)cap * sizeof(int32_t));
        if (!v) { PyErr_NoMemory(); return -1; }
        a->v = v; a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}
static int lvec_push(lvec *a, int64_t x) {
    if (a->n == a->cap) {
        int32_t cap = a->cap ? a->cap * 2 : 4;
        int64_t *v = PyMem_Realloc(a->v, (size_t)cap * sizeof(int64_t));
        if (!v) { PyErr_NoMemory(); return -1; }
        a->v = v; a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

typedef struct {        /* one inserted sequence */
    ivec tokens;        /* its text */
    ivec par;           /* per position: the state of the suffix before it (the count parents) */
    lvec when;          /* per position: the clock when it was appended */
    int32_t end, deep;  /* the automaton's "last"; a state holding its suffix of min(len, depth) */
    int live;
} Seq;

typedef struct {
    PyObject_HEAD
    int32_t max_depth;
    int counted;        /* 0: transitions only (no counts, times, top children or texts: the cache
                           oracle's walk, about half the memory); see need_counts */
    double compact_ratio;
    int64_t version;
    /* states */
    int32_t n, cap;
    int32_t *len, *link, *tok, *to, *count, *top, *last_tok;
    int64_t *time;
    /* tokens of a state's second and later transitions, in insertion order: pool[more_at[s]] (-1: none;
       most states have none, so a 4-byte index a state instead of a 16-byte vector) */
    int32_t *more_at;
    ivec *pool; int32_t npool, poolcap;
    /* (state, token) -> target of those transitions: open addressing */
    uint64_t *hkey; int32_t *hval; size_t hcap, hused;
    int64_t clock, dead_tokens;
    /* sequences: seq_id (Python int) -> slot in seqs */
    PyObject *ids;      /* dict seq_id -> slot (insertion order: the sequences' order) */
    Seq *seqs; int32_t nseq, capseq;
    ivec free_slots;
    /* scratch */
    ivec buf_tok, buf_par; int32_t *buf_match; int32_t buf_match_cap;
    double *buf_score; int32_t buf_score_cap;
} Index;

#define HEMPTY UINT64_MAX
static inline uint64_t hkey_of(int32_t s, int32_t c) { return ((uint64_t)(uint32_t)s << 32) | (uint32_t)c; }
static inline size_t hslot(uint64_t k, size_t mask) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33;
    return (size_t)k & mask;
}
static int32_t hget(Index *x, int32_t s, int32_t c) {
    if (!x->hcap) return -1;
    uint64_t k = hkey_of(s, c); size_t mask = x->hcap - 1, i = hslot(k, mask);
    while (x->hkey[i] != HEMPTY) {
        if (x->hkey[i] == k) return x->hval[i];
        i = (i + 1) & mask;
    }
    return -1;
}
static int hput(Index *x, int32_t s, int32_t c, int32_t v);
static int hgrow(Index *x) {
    size_t old = x->hcap, cap = old ? old * 2 : 1024;
    uint64_t *ok = x->hkey; int32_t *ov = x->hval;
    x->hkey = PyMem_Malloc(cap * sizeof(uint64_t));
    x->hval = PyMem_Malloc(cap * sizeof(int32_t));
    if (!x->hkey || !x->hval) { PyErr_NoMemory(); return -1; }
    memset(x->hkey, 0xff, cap * sizeof(uint64_t));
    x->hcap = cap; x->hused = 0;
    for (size_t i = 0; i < old; i++)
        if (ok[i] != HEMPTY) hput(x, (int32_t)(ok[i] >> 32), (int32_t)(uint32_t)ok[i], ov[i]);
    PyMem_Free(ok); PyMem_Free(ov);
    return 0;
}
static int hput(Index *x, int32_t s, int32_t c, int32_t v) {  /* insert or update */
    if (2 * (x->hused + 1) > x->hcap && hgrow(x) < 0) return -1;
    uint64_t k = hkey_of(s, c); size_t mask = x->hcap - 1, i = hslot(k, mask);
    while (x->hkey[i] != HEMPTY) {
        if (x->hkey[i] == k) { x->hval[i] = v; return 0; }
        i = (i + 1) & mask;
    }
    x->hkey[i] = k; x->hval[i] = v; x->hused++;
    return 0;
}

static const ivec NO_MORE = {NULL, 0, 0};
/* a state's second and later transition tokens (read only: a push may move the pool) */
static inline const ivec *more_of(const Index *x, int32_t s) {
    int32_t i = x->more_at[s];
    return i < 0 ? &NO_MORE : &x->pool[i];
}
static int more_push(Index *x, int32_t s, int32_t c) {
    if (x->more_at[s] < 0) {
        if (x->npool == x->poolcap) {
            int32_t cap = x->poolcap ? x->poolcap * 2 : 64;
            ivec *p = PyMem_Realloc(x->pool, (size_t)cap * sizeof(ivec));
            if (!p) { PyErr_NoMemory(); return -1; }
            x->pool = p; x->poolcap = cap;
        }
        x->pool[x->npool].v = NULL; x->pool[x->npool].n = x->pool[x->npool].cap = 0;
        x->more_at[s] = x->npool++;
    }
    return ivec_push(&x->pool[x->more_at[s]], c);
}

static inline int32_t trans(Index *x, int32_t p, int32_t c) {
    if (x->tok[p] == c) return x->to[p];
    if (x->more_at[p] < 0) return -1;
    return hget(x, p, c);
}

/* the queries that read counts, times or texts: refused on an automaton made with counts=False */
static int need_counts(Index *x, const char *what) {
    if (x->counted) return 0;
    PyErr_Format(PyExc_ValueError, "%s needs counts: this CompiledAutomaton was made with counts=False "
                 "(transitions only, for longest_prefix); make it with counts=True", what);
    return -1;
}

static int new_state(Index *x, int32_t len, int32_t link, int32_t tok, int32_t to, int32_t count,
                     int64_t time, int32_t top, int32_t last_tok) {
    if (x->n == x->cap) {
        int32_t cap = x->cap ? x->cap * 2 : 64;
#define GROW(f, T) { T *p = PyMem_Realloc(x->f, (size_t)cap * sizeof(T)); if (!p) { PyErr_NoMemory(); return -1; } x->f = p; }
        GROW(len, int32_t) GROW(link, int32_t) GROW(tok, int32_t) GROW(to, int32_t) GROW(more_at, int32_t)
        if (x->counted) { GROW(count, int32_t) GROW(top, int32_t) GROW(last_tok, int32_t) GROW(time, int64_t) }
#undef GROW
        x->cap = cap;
    }
    int32_t s = x->n++;
    x->len[s] = len; x->link[s] = link; x->tok[s] = tok; x->to[s] = to;
    if (x->counted) { x->count[s] = count; x->time[s] = time; x->top[s] = top; x->last_tok[s] = last_tok; }
    x->more_at[s] = -1;
    return s;
}

static void free_states(Index *x) {
    for (int32_t i = 0; i < x->npool; i++) PyMem_Free(x->pool[i].v);
    PyMem_Free(x->len); PyMem_Free(x->link); PyMem_Free(x->tok); PyMem_Free(x->to);
    PyMem_Free(x->count); PyMem_Free(x->top); PyMem_Free(x->last_tok); PyMem_Free(x->time);
    PyMem_Free(x->more_at); PyMem_Free(x->pool); PyMem_Free(x->hkey); PyMem_Free(x->hval);
    x->len = x->link = x->tok = x->to = x->count = x->top = x->last_tok = NULL;
    x->time = NULL; x->more_at = NULL; x->pool = NULL; x->hkey = NULL; x->hval = NULL;
    x->n = x->cap = 0; x->npool = x->poolcap = 0; x->hcap = x->hused = 0;
}
static void free_seq(Seq *q) {
    PyMem_Free(q->tokens.v); PyMem_Free(q->par.v); PyMem_Free(q->when.v);
    memset(q, 0, sizeof(Seq));
}
static void free_seqs(Index *x) {
    for (int32_t i = 0; i < x->nseq; i++) free_seq(&x->seqs[i]);
    PyMem_Free(x->seqs); x->seqs = NULL; x->nseq = x->capseq = 0;
    PyMem_Free(x->free_slots.v); memset(&x->free_slots, 0, sizeof(ivec));
    Py_CLEAR(x->ids);
}

static int reset_states(Index *x) {  /* the root only */
    free_states(x);
    if (new_state(x, 0, -1, NO_TOKEN, -1, 0, 0, UNKNOWN, START_TOKEN) < 0) return -1;
    x->clock = 0; x->dead_tokens = 0;
    return 0;
}

static int32_t new_seq_slot(Index *x) {
    if (x->free_slots.n) {
        int32_t s = x->free_slots.v[--x->free_slots.n];
        return s;
    }
    if (x->nseq == x->capseq) {
        int32_t cap = x->capseq ? x->capseq * 2 : 16;
        Seq *p = PyMem_Realloc(x->seqs, (size_t)cap * sizeof(Seq));
        if (!p) { PyErr_NoMemory(); return -1; }
        memset(p + x->capseq, 0, (size_t)(cap - x->capseq) * sizeof(Seq));
        x->seqs = p; x->capseq = cap;
    }
    return x->nseq++;
}

/* slot of seq_id, -1 when absent (no error set), -2 on error */
static int32_t slot_of(Index *x, PyObject *sid) {
    PyObject *v = PyDict_GetItemWithError(x->ids, sid);
    if (!v) return PyErr_Occurred() ? -2 : -1;
    return (int32_t)PyLong_AsLong(v);
}

static int32_t add_seq(Index *x, PyObject *sid) {
    int32_t slot = new_seq_slot(x);
    if (slot < 0) return -2;
    Seq *q = &x->seqs[slot];
    memset(q, 0, sizeof(Seq));
    q->live = 1;
    PyObject *v = PyLong_FromLong(slot);
    if (!v || PyDict_SetItem(x->ids, sid, v) < 0) { Py_XDECREF(v); return -2; }
    Py_DECREF(v);
    return slot;
}

/* CountedSuffixAutomaton._insert */
static int insert(Index *x, int32_t slot, const int32_t *tokens, Py_ssize_t ntok, const int64_t *clock) {
    Seq *q0 = &x->seqs[slot];
    int32_t last = q0->end, deep = q0->deep;
    int32_t top_depth = x->max_depth - 1;
    int64_t n = q0->tokens.n;
    int64_t t = x->clock;
    for (Py_ssize_t i = 0; i < ntok; i++) {
        int32_t c = tokens[i];
        int32_t q = trans(x, last, c);
        if (q >= 0 && x->len[q] == x->len[last] + 1) {
            last = q;
        } else {
            int32_t p, cur;
            if (q >= 0) {
                p = last; cur = -1;
            } else {
                cur = new_state(x, x->len[last] + 1, 0, NO_TOKEN, -1, 0, 0, -1, c);
                if (cur < 0) return -1;
                p = last;
                while (p >= 0) {
                    if (x->tok[p] == c) { q = x->to[p]; break; }
                    if (x->more_at[p] >= 0) {
                        q = hget(x, p, c);
                        if (q >= 0) break;
                    }
                    if (x->tok[p] == NO_TOKEN) { x->tok[p] = c; x->to[p] = cur; }
                    else {
                        if (more_push(x, p, c) < 0 || hput(x, p, c, cur) < 0) return -1;
                    }
                    p = x->link[p];
                }
                if (p < 0) { last = cur; q = -1; }
                else if (x->len[q] == x->len[p] + 1) { x->link[cur] = q; last = cur; q = -1; }
            }
            if (q >= 0) {  /* split q */
                int32_t k = x->counted
                    ? new_state(x, x->len[p] + 1, x->link[q], x->tok[q], x->to[q], x->count[q], x->time[q],
                                x->top[q], x->last_tok[q])
                    : new_state(x, x->len[p] + 1, x->link[q], x->tok[q], x->to[q], 0, 0, 0, 0);
                if (k < 0) return -1;
                for (int32_t j = 0; j < more_of(x, q)->n; j++) {  /* re-read: a push may move the pool */
                    int32_t tj = more_of(x, q)->v[j];
                    if (more_push(x, k, tj) < 0 || hput(x, k, tj, hget(x, q, tj)) < 0) return -1;
                }
                while (p >= 0) {
                    if (x->tok[p] == c) {
                        if (x->to[p] != q) break;
                        x->to[p] = k;
                    } else {
                        if (x->more_at[p] < 0 || hget(x, p, c) != q) break;
                        if (hput(x, p, c, k) < 0) return -1;
                    }
                    if (x->counted && x->top[p] == q) x->top[p] = k;
                    p = x->link[p];
                }
                x->link[q] = k;
                if (cur >= 0) { x->link[cur] = k; last = cur; }
                else last = k;
            }
        }
        if (!x->counted) { t += 1; n += 1; continue; }
        /* counts */
        Seq *sq = &x->seqs[slot];
        int64_t want = n < top_depth ? n : top_depth;
        int32_t s = deep;
        for (;;) {
            int32_t k = x->link[s];
            if (k < 0 || x->len[k] < want) break;
            s = k;
        }
        if (ivec_push(&sq->par, s) < 0) return -1;
        if (clock) t = clock[i];
        if (lvec_push(&sq->when, t) < 0) return -1;
        int32_t p = s, prev = -1, cx = 0;
        while (p > 0) {
            int32_t xx = x->tok[p] == c ? x->to[p] : hget(x, p, c);
            if (xx != prev) {
                cx = ++x->count[xx];
                if (cx == 1) x->time[xx] = t;
                if (prev < 0) deep = xx;
                prev = xx;
            }
            int32_t tp = x->top[p];
            if (tp != xx) {
                if (tp == -1) x->top[p] = xx;
                else if (tp >= 0) {
                    int32_t ct = x->count[tp];
                    if (cx > ct || (cx == ct && x->time[xx] < x->time[tp])) x->top[p] = xx;
                }
            }
            p = x->link[p];
        }
        int32_t xx = x->tok[0] == c ? x->to[0] : hget(x, 0, c);
        if (xx != prev) {
            cx = ++x->count[xx];
            if (cx == 1) x->time[xx] = t;
            if (prev < 0) deep = xx;
        }
        if (ivec_push(&sq->tokens, c) < 0) return -1;
        t += 1;
        n += 1;
    }
    if (x->counted) x->count[0] += (int32_t)ntok;
    x->clock = t;
    x->seqs[slot].end = last; x->seqs[slot].deep = deep;
    return 0;
}

/* tokens of a Python sequence into buf_tok; -1 on error */
static int read_tokens(Index *x, PyObject *obj, ivec *buf) {
    PyObject *fast = PySequence_Fast(obj, "tokens must be a sequence of ints");
    if (!fast) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    buf->n = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        long v = PyLong_AsLong(items[i]);
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        if (v < INT32_MIN + 1 || v > INT32_MAX) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "token id %ld does not fit in a signed 32-bit int", v);
            return -1;
        }
        if (ivec_push(buf, (int32_t)v) < 0) { Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    return 0;
}

/* append buf_tok to sequence sid (created if absent; nothing when buf_tok is empty); 0 or -1 */
static int extend_seq(Index *x, PyObject *sid) {
    if (!x->buf_tok.n) return 0;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return -1;
    if (slot < 0 && (slot = add_seq(x, sid)) < 0) return -1;
    if (insert(x, slot, x->buf_tok.v, x->buf_tok.n, NULL) < 0) return -1;
    x->version++;
    return 0;
}

static PyObject *Index_extend(Index *x, PyObject *args) {
    PyObject *sid, *toks;
    if (!PyArg_ParseTuple(args, "OO", &sid, &toks)) return NULL;
    if (read_tokens(x, toks, &x->buf_tok) < 0 || extend_seq(x, sid) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Index_append(Index *x, PyObject *args) {
    PyObject *sid; long tok;
    if (!PyArg_ParseTuple(args, "Ol", &sid, &tok)) return NULL;
    if (tok < INT32_MIN + 1 || tok > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "token id %ld does not fit in a signed 32-bit int", tok);
        return NULL;
    }
    int32_t c = (int32_t)tok;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    if (slot < 0 && (slot = add_seq(x, sid)) < 0) return NULL;
    if (insert(x, slot, &c, 1, NULL) < 0) return NULL;
    x->version++;
    Py_RETURN_NONE;
}

/* CountedSuffixAutomaton.extend_copy */
static PyObject *Index_extend_copy(Index *x, PyObject *args) {
    if (need_counts(x, "extend_copy") < 0) return NULL;
    PyObject *sid, *src_id;
    if (!PyArg_ParseTuple(args, "OO", &sid, &src_id)) return NULL;
    int32_t have = slot_of(x, sid);
    if (have == -2) return NULL;
    if (have >= 0) { PyErr_Format(PyExc_ValueError, "sequence %R exists", sid); return NULL; }
    int32_t src = slot_of(x, src_id);
    if (src == -2) return NULL;
    if (src < 0) { PyErr_SetObject(PyExc_KeyError, src_id); return NULL; }
    int32_t slot = add_seq(x, sid);
    if (slot < 0) return NULL;
    Seq *s = &x->seqs[src], *d = &x->seqs[slot];
    int32_t m = s->tokens.n;
    for (int32_t i = 0; i < m; i++) {
        s = &x->seqs[src]; d = &x->seqs[slot];
        if (ivec_push(&d->tokens, s->tokens.v[i]) < 0 || ivec_push(&d->par, s->par.v[i]) < 0 ||
            lvec_push(&d->when, x->clock + i) < 0) return NULL;
    }
    s = &x->seqs[src]; d = &x->seqs[slot];
    d->end = s->end; d->deep = s->deep;
    int64_t t = x->clock;
    x->clock = t + m;
    int32_t top_depth = x->max_depth - 1;
    for (int32_t i = 0; i < m; i++) {
        int32_t c = d->tokens.v[i];
        int32_t want = i < top_depth ? i : top_depth;
        int32_t p = d->par.v[i];
        for (;;) {
            int32_t k = x->link[p];
            if (k < 0 || x->len[k] < want) break;
            p = k;
        }
        int32_t prev = -1, cx = 0;
        while (p >= 0) {
            int32_t xx = x->tok[p] == c ? x->to[p] : hget(x, p, c);
            if (xx != prev) {
                cx = ++x->count[xx];
                if (cx == 1) x->time[xx] = t + i;
                prev = xx;
            }
            int32_t tp = x->top[p];
            if (tp != xx) {
                if (tp == -1) x->top[p] = xx;
                else if (tp >= 0) {
                    int32_t ct = x->count[tp];
                    if (cx > ct || (cx == ct && x->time[xx] < x->time[tp])) x->top[p] = xx;
                }
            }
            p = x->link[p];
        }
    }
    x->count[0] += m;
    x->version++;
    Py_RETURN_NONE;
}

static int compact(Index *x);

/* CountedSuffixAutomaton.remove */
static PyObject *Index_remove(Index *x, PyObject *args) {
    if (need_counts(x, "remove") < 0) return NULL;
    PyObject *sid;
    if (!PyArg_ParseTuple(args, "O", &sid)) return NULL;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    if (slot < 0) Py_RETURN_NONE;
    if (PyDict_DelItem(x->ids, sid) < 0) return NULL;
    Seq *q = &x->seqs[slot];
    int32_t top_depth = x->max_depth - 1;
    for (int32_t i = 0; i < q->tokens.n; i++) {
        int32_t c = q->tokens.v[i];
        int32_t want = i < top_depth ? i : top_depth;
        int32_t p = q->par.v[i];
        for (;;) {
            int32_t k = x->link[p];
            if (k < 0 || x->len[k] < want) break;
            p = k;
        }
        int32_t prev = -1;
        while (p >= 0) {
            int32_t xx = x->tok[p] == c ? x->to[p] : hget(x, p, c);
            if (xx != prev) { x->count[xx] -= 1; prev = xx; }
            if (x->top[p] == xx) x->top[p] = UNKNOWN;
            p = x->link[p];
        }
        x->count[0] -= 1;
    }
    x->dead_tokens += q->tokens.n;
    free_seq(q);
    if (ivec_push(&x->free_slots, slot) < 0) return NULL;
    x->version++;
    if ((double)x->dead_tokens > x->compact_ratio * x->count[0] + 4096 && compact(x) < 0) return NULL;
    Py_RETURN_NONE;
}

typedef struct { int64_t when; int32_t slot, i; } Event;
static int cmp_event(const void *a, const void *b) {
    const Event *e = a, *f = b;
    if (e->when != f->when) return e->when < f->when ? -1 : 1;
    if (e->slot != f->slot) return e->slot < f->slot ? -1 : 1;
    return e->i < f->i ? -1 : e->i > f->i;
}

/* CountedSuffixAutomaton.compact: rebuild from the live sequences in their time order */
static int compact(Index *x) {
    int64_t clock = x->clock, version = x->version;
    Py_ssize_t total = 0, pos = 0;
    PyObject *key, *val;
    while (PyDict_Next(x->ids, &pos, &key, &val)) total += x->seqs[PyLong_AsLong(val)].tokens.n;
    Event *ev = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(Event));
    if (!ev) { PyErr_NoMemory(); return -1; }
    Py_ssize_t k = 0; pos = 0;
    /* the old texts move aside: each slot's tokens are kept, its counts are rebuilt */
    int32_t nslots = x->nseq;
    Seq *old = PyMem_Calloc((size_t)(nslots ? nslots : 1), sizeof(Seq));
    if (!old) { PyMem_Free(ev); PyErr_NoMemory(); return -1; }
    while (PyDict_Next(x->ids, &pos, &key, &val)) {
        int32_t slot = (int32_t)PyLong_AsLong(val);
        Seq *q = &x->seqs[slot];
        for (int32_t i = 0; i < q->tokens.n; i++) { ev[k].when = q->when.v[i]; ev[k].slot = slot; ev[k].i = i; k++; }
        old[slot] = *q;
        memset(q, 0, sizeof(Seq));
        q->live = 1;
    }
    qsort(ev, (size_t)total, sizeof(Event), cmp_event);
    int rc = reset_states(x);
    for (Py_ssize_t j = 0; rc == 0 && j < total; j++) {
        int32_t c = old[ev[j].slot].tokens.v[ev[j].i];
        rc = insert(x, ev[j].slot, &c, 1, &ev[j].when);
    }
    for (int32_t s = 0; s < nslots; s++) free_seq(&old[s]);
    PyMem_Free(old); PyMem_Free(ev);
    x->clock = clock; x->version = version + 1;
    return rc;
}

static PyObject *Index_compact(Index *x, PyObject *Py_UNUSED(a)) {
    if (need_counts(x, "compact") < 0) return NULL;
    if (compact(x) < 0) return NULL;
    Py_RETURN_NONE;
}

/* ----- queries ----- */
static int32_t top_of(Index *x, int32_t node) {
    int32_t top = x->top[node];
    if (top != UNKNOWN) return top;
    int32_t best = -1;
    if (x->tok[node] != NO_TOKEN) {
        int32_t ch = x->to[node];
        if (x->count[ch] > 0) best = ch;
    }
    const ivec *d = more_of(x, node);
    for (int32_t j = 0; j < d->n; j++) {
        int32_t ch = hget(x, node, d->v[j]);
        int32_t c = x->count[ch];
        if (c > 0 && (best < 0 || c > x->count[best] || (c == x->count[best] && x->time[ch] < x->time[best])))
            best = ch;
    }
    if (node) x->top[node] = best;
    return best;
}

static int32_t state_of_suffix(Index *x, int32_t state, int32_t n) {
    for (;;) {
        int32_t k = x->link[state];
        if (k < 0 || x->len[k] < n) return state;
        state = k;
    }
}

static int ensure_match(Index *x, int32_t m) {
    if (m <= x->buf_match_cap) return 0;
    int32_t *p = PyMem_Realloc(x->buf_match, (size_t)m * sizeof(int32_t));
    if (!p) { PyErr_NoMemory(); return -1; }
    x->buf_match = p; x->buf_match_cap = m;
    return 0;
}

static void chain(Index *x, int32_t state, int32_t m, int32_t *out) {
    while (m > 0) {
        int32_t lo = x->len[x->link[state]];
        for (int32_t i = lo; i < m; i++) out[i] = state;
        m = lo; state = x->link[state];
    }
}

static PyObject *list_of(const int32_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromLong(v[i]);
        if (!o) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, o);
    }
    return out;
}

static void longest_live(Index *x, const int32_t *ctx, Py_ssize_t start, Py_ssize_t end, int32_t *vs, int32_t *ns) {
    int32_t v = 0, n = 0;
    for (Py_ssize_t i = start; i < end; i++) {
        int32_t c = ctx[i];
        for (;;) {
            int32_t xx = trans(x, v, c);
            if (xx >= 0) { v = xx; n++; break; }
            if (v == 0) break;
            v = x->link[v]; n = x->len[v];
        }
    }
    while (n > 0 && x->count[v] <= 0) { v = x->link[v]; n = x->len[v]; }
    *vs = v; *ns = n;
}

/* own matches of a slot into buf_match; returns m (or -1) */
static int32_t own_matches(Index *x, int32_t slot) {
    Seq *q = &x->seqs[slot];
    if (!q->tokens.n) return 0;
    int32_t m = q->tokens.n < x->max_depth ? q->tokens.n : x->max_depth;
    if (ensure_match(x, m) < 0) return -1;
    chain(x, state_of_suffix(x, q->deep, m), m, x->buf_match);
    return m;
}

/* the top-child path: tokens into buf_tok, running scores into buf_score; returns its length */
static int32_t path(Index *x, int32_t node, int32_t steps, double min_prob) {
    if (steps > x->buf_score_cap) {
        double *p = PyMem_Realloc(x->buf_score, (size_t)steps * sizeof(double));
        if (!p) { PyErr_NoMemory(); return -1; }
        x->buf_score = p; x->buf_score_cap = steps;
    }
    x->buf_tok.n = 0;
    double prob = 1.0, score = 0.0;
    while (x->buf_tok.n < steps) {
        int32_t child = x->top[node];
        if (child == UNKNOWN) child = top_of(x, node);
        if (child < 0) break;
        prob *= (double)x->count[child] / (double)x->count[node];
        if (prob < min_prob) break;
        if (ivec_push(&x->buf_tok, x->last_tok[child]) < 0) return -1;
        score += prob;
        x->buf_score[x->buf_tok.n - 1] = score;
        node = child;
    }
    return x->buf_tok.n;
}

typedef struct { double negp; int64_t when; int32_t d, node, parent; } HeapItem;
static int heap_less(const HeapItem *a, const HeapItem *b) {  /* Python's tuple order */
    if (a->negp != b->negp) return a->negp < b->negp;
    if (a->when != b->when) return a->when < b->when;
    if (a->d != b->d) return a->d < b->d;
    if (a->node != b->node) return a->node < b->node;
    return a->parent < b->parent;
}
typedef struct { HeapItem *v; int32_t n, cap; } Heap;
static int heap_push(Heap *h, HeapItem it) {
    if (h->n == h->cap) {
        int32_t cap = h->cap ? 2 * h->cap : 64;
        HeapItem *p = PyMem_Realloc(h->v, (size_t)cap * sizeof(HeapItem));
        if (!p) { PyErr_NoMemory(); return -1; }
        h->v = p; h->cap = cap;
    }
    int32_t i = h->n++;
    while (i > 0) {
        int32_t up = (i - 1) / 2;
        if (!heap_less(&it, &h->v[up])) break;
        h->v[i] = h->v[up]; i = up;
    }
    h->v[i] = it;
    return 0;
}
static HeapItem heap_pop(Heap *h) {
    HeapItem top = h->v[0], last = h->v[--h->n];
    int32_t i = 0;
    for (;;) {
        int32_t l = 2 * i + 1;
        if (l >= h->n) break;
        if (l + 1 < h->n && heap_less(&h->v[l + 1], &h->v[l])) l++;
        if (!heap_less(&h->v[l], &last)) break;
        h->v[i] = h->v[l]; i = l;
    }
    if (h->n) h->v[i] = last;
    return top;
}

/* SuffixIndex._expand_tree: tokens into buf_tok, parents into buf_par; score out */
static int expand_tree(Index *x, int32_t node, int32_t m, int32_t budget, double min_prob, double *score_out) {
    Heap h = {NULL, 0, 0};
    x->buf_tok.n = 0; x->buf_par.n = 0;
    double score = 0.0, prob = 1.0;
    int32_t parent = -1, d = m;
    for (;;) {
        if (d < x->max_depth) {
            double total = (double)x->count[node];
            int32_t first = x->tok[node] != NO_TOKEN ? 1 : 0;
            const ivec *more = more_of(x, node);
            for (int32_t j = -first; j < more->n; j++) {
                int32_t child = j < 0 ? x->to[node] : hget(x, node, more->v[j]);
                int32_t c = x->count[child];
                if (c <= 0) continue;
                double p = prob * ((double)c / total);
                if (p >= min_prob) {
                    HeapItem it = {-p, x->time[child], d + 1, child, parent};
                    if (heap_push(&h, it) < 0) { PyMem_Free(h.v); return -1; }
                }
            }
        }
        if (!h.n || x->buf_tok.n >= budget) break;
        HeapItem it = heap_pop(&h);
        prob = -it.negp; d = it.d; node = it.node;
        if (ivec_push(&x->buf_par, it.parent) < 0 || ivec_push(&x->buf_tok, x->last_tok[node]) < 0) {
            PyMem_Free(h.v); return -1;
        }
        score += prob;
        parent = x->buf_tok.n - 1;
    }
    PyMem_Free(h.v);
    *score_out = score;
    return 0;
}

/* a Speculation's fields as a tuple (tokens, parents or None, score, match_len) */
static PyObject *result(Index *x, int tree, double score, int32_t m) {
    PyObject *toks = list_of(x->buf_tok.v, x->buf_tok.n);
    if (!toks) return NULL;
    PyObject *par;
    if (tree && x->buf_tok.n) {
        par = list_of(x->buf_par.v, x->buf_par.n);
        if (!par) { Py_DECREF(toks); return NULL; }
    } else { par = Py_None; Py_INCREF(par); }
    return Py_BuildValue("(NNdi)", toks, par, score, m);
}

/* SuffixIndex.speculate (best score) and speculate_longest on matches[0..nm) */
static PyObject *spec_rule(Index *x, const int32_t *matches, int32_t nm, int longest, int32_t max_spec,
                           double factor, double offset, double min_prob, int tree) {
    int32_t depth = x->max_depth;
    int32_t m = nm < depth - 1 ? nm : depth - 1;
    if (longest) {
        while (m > 0) {
            int32_t node = matches[m - 1];
            int32_t lo = x->len[x->link[node]];
            if (top_of(x, node) < 0) { m = lo; continue; }
            while (m > lo) {
                int32_t budget = (int32_t)(m * factor + offset + 1e-6);
                if (budget > max_spec) budget = max_spec;
                if (budget > 0) {
                    double score = 0.0;
                    if (tree) {
                        if (expand_tree(x, node, m, budget, min_prob, &score) < 0) return NULL;
                    } else {
                        int32_t steps = budget < depth - m ? budget : depth - m;
                        int32_t k = path(x, node, steps, min_prob);
                        if (k < 0) return NULL;
                        score = k ? x->buf_score[k - 1] : 0.0;
                    }
                    return result(x, tree, score, m);
                }
                m -= 1;
            }
        }
        x->buf_tok.n = 0;
        return result(x, 0, 0.0, 0);
    }
    int found = 0;
    double best_score = 0.0;
    int32_t best_m = nm;
    ivec best_tok = {NULL, 0, 0}, best_par = {NULL, 0, 0};
    double *pscore = NULL; int32_t plen = 0;  /* the chain path of the current state */
    PyObject *out = NULL;
    while (m > 0) {
        int32_t node = matches[m - 1];
        int32_t lo = x->len[x->link[node]];
        int32_t first = top_of(x, node);
        if (first < 0) { m = lo; continue; }
        double share = (double)x->count[first], total = (double)x->count[node];
        int32_t path_steps = -1;
        plen = 0;
        ivec ptok = {NULL, 0, 0};
        while (m > lo) {
            int32_t budget = (int32_t)(m * factor + offset + 1e-6);
            if (budget > max_spec) budget = max_spec;
            if (budget <= 0) { m -= 1; continue; }
            int32_t reach = tree ? budget : (budget < depth - m ? budget : depth - m);
            if (reach * share / total <= best_score) { m -= 1; continue; }
            double score;
            int32_t k = 0;
            if (tree) {
                if (expand_tree(x, node, m, budget, min_prob, &score) < 0) { PyMem_Free(ptok.v); goto done; }
            } else {
                int32_t steps = budget < depth - m ? budget : depth - m;
                if (steps > path_steps && plen == (path_steps > 0 ? path_steps : 0)) {
                    int32_t got = path(x, node, steps, min_prob);
                    if (got < 0) { PyMem_Free(ptok.v); goto done; }
                    /* keep this state's path aside: buf_tok and buf_score are scratch */
                    ptok.n = 0;
                    for (int32_t j = 0; j < got; j++) if (ivec_push(&ptok, x->buf_tok.v[j]) < 0) { PyMem_Free(ptok.v); goto done; }
                    double *ps = PyMem_Realloc(pscore, (size_t)(got ? got : 1) * sizeof(double));
                    if (!ps) { PyErr_NoMemory(); PyMem_Free(ptok.v); goto done; }
                    pscore = ps;
                    memcpy(pscore, x->buf_score, (size_t)got * sizeof(double));
                    plen = got; path_steps = steps;
                }
                k = steps < plen ? steps : plen;
                score = k ? pscore[k - 1] : 0.0;
            }
            if (score > best_score) {
                found = 1; best_score = score; best_m = m;
                best_tok.n = 0; best_par.n = 0;
                if (tree) {
                    for (int32_t j = 0; j < x->buf_tok.n; j++)
                        if (ivec_push(&best_tok, x->buf_tok.v[j]) < 0 || ivec_push(&best_par, x->buf_par.v[j]) < 0) { PyMem_Free(ptok.v); goto done; }
                } else {
                    for (int32_t j = 0; j < k; j++) if (ivec_push(&best_tok, ptok.v[j]) < 0) { PyMem_Free(ptok.v); goto done; }
                }
            }
            m -= 1;
        }
        PyMem_Free(ptok.v);
    }
    x->buf_tok.n = 0; x->buf_par.n = 0;
    if (found) {
        for (int32_t j = 0; j < best_tok.n; j++) if (ivec_push(&x->buf_tok, best_tok.v[j]) < 0) goto done;
        for (int32_t j = 0; j < best_par.n; j++) if (ivec_push(&x->buf_par, best_par.v[j]) < 0) goto done;
        out = result(x, tree, best_score, best_m);
    } else {
        out = result(x, 0, 0.0, best_m);
    }
done:
    PyMem_Free(best_tok.v); PyMem_Free(best_par.v); PyMem_Free(pscore);
    return out;
}

static int read_matches(Index *x, PyObject *obj, int32_t *nm) {
    if (read_tokens(x, obj, &x->buf_par) < 0) return -1;
    if (ensure_match(x, x->buf_par.n) < 0) return -1;
    memcpy(x->buf_match, x->buf_par.v, (size_t)x->buf_par.n * sizeof(int32_t));
    *nm = x->buf_par.n;
    return 0;
}

static PyObject *Index_speculate_raw(Index *x, PyObject *args) {
    if (need_counts(x, "speculate") < 0) return NULL;
    PyObject *matches; int longest, tree; int max_spec; double factor, offset, min_prob;
    if (!PyArg_ParseTuple(args, "Opidddp", &matches, &longest, &max_spec, &factor, &offset, &min_prob, &tree)) return NULL;
    int32_t nm;
    if (read_matches(x, matches, &nm) < 0) return NULL;
    return spec_rule(x, x->buf_match, nm, longest, max_spec, factor, offset, min_prob, tree);
}

/* the rule on a sequence's own matches, in one call (the in-flight drafters' hot path) */
static PyObject *Index_speculate_own_raw(Index *x, PyObject *args) {
    if (need_counts(x, "speculate_own") < 0) return NULL;
    PyObject *sid; int longest, tree; int max_spec; double factor, offset, min_prob;
    if (!PyArg_ParseTuple(args, "Opidddp", &sid, &longest, &max_spec, &factor, &offset, &min_prob, &tree)) return NULL;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    int32_t nm = slot < 0 ? 0 : own_matches(x, slot);
    if (nm < 0) return NULL;
    return spec_rule(x, x->buf_match, nm, longest, max_spec, factor, offset, min_prob, tree);
}

static PyObject *Index_own_matches(Index *x, PyObject *args) {
    if (need_counts(x, "own_matches") < 0) return NULL;
    PyObject *sid;
    if (!PyArg_ParseTuple(args, "O", &sid)) return NULL;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    if (slot < 0) return PyList_New(0);
    int32_t m = own_matches(x, slot);
    if (m < 0) return NULL;
    return list_of(x->buf_match, m);
}

static PyObject *Index_longest_live(Index *x, PyObject *args) {
    if (need_counts(x, "_longest_live") < 0) return NULL;
    PyObject *ctx; Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "Onn", &ctx, &start, &end)) return NULL;
    if (read_tokens(x, ctx, &x->buf_tok) < 0) return NULL;
    if (start < 0) start = 0;
    if (end > x->buf_tok.n) end = x->buf_tok.n;
    int32_t v, n;
    longest_live(x, x->buf_tok.v, start, end, &v, &n);
    return Py_BuildValue("(ii)", v, n);
}

static PyObject *Index_chain(Index *x, PyObject *args) {
    if (need_counts(x, "_chain") < 0) return NULL;
    int state, m;
    if (!PyArg_ParseTuple(args, "ii", &state, &m)) return NULL;
    if (state < 0 || state >= x->n || m < 0) { PyErr_SetString(PyExc_ValueError, "no such state"); return NULL; }
    if (ensure_match(x, m) < 0) return NULL;
    chain(x, state, m, x->buf_match);
    return list_of(x->buf_match, m);
}

/* IndexMatcher.feed's automaton walk: (state, n) after the tokens */
static PyObject *Index_feed(Index *x, PyObject *args) {
    if (need_counts(x, "_feed") < 0) return NULL;
    int v, n; PyObject *toks;
    if (!PyArg_ParseTuple(args, "iiO", &v, &n, &toks)) return NULL;
    if (read_tokens(x, toks, &x->buf_tok) < 0) return NULL;
    for (int32_t i = 0; i < x->buf_tok.n; i++) {
        int32_t c = x->buf_tok.v[i];
        for (;;) {
            int32_t xx = trans(x, v, c);
            if (xx >= 0 && x->count[xx] > 0) { v = xx; n++; break; }
            if (v == 0) break;
            v = x->link[v]; n = x->len[v];
        }
        if (n > x->max_depth) { n = x->max_depth; v = state_of_suffix(x, v, n); }
    }
    return Py_BuildValue("(ii)", v, n);
}

/* SuffixIndex.speculate_first_hit */
static PyObject *Index_first_hit_raw(Index *x, PyObject *args) {
    if (need_counts(x, "speculate_first_hit") < 0) return NULL;
    PyObject *ctx; int window, min_match, max_spec; double min_prob;
    if (!PyArg_ParseTuple(args, "Oiiid", &ctx, &window, &min_match, &max_spec, &min_prob)) return NULL;
    if (read_tokens(x, ctx, &x->buf_par) < 0) return NULL;
    Py_ssize_t n = x->buf_par.n;
    Py_ssize_t longest = window;
    if (n < longest) longest = n;
    if (x->max_depth - 1 < longest) longest = x->max_depth - 1;
    x->buf_tok.n = 0;
    if (longest < min_match) return result(x, 0, 0.0, 0);
    int32_t v, m;
    longest_live(x, x->buf_par.v, n - longest, n, &v, &m);
    while (m >= min_match) {
        if (top_of(x, v) >= 0) {
            int32_t steps = max_spec < x->max_depth - m ? max_spec : x->max_depth - m;
            int32_t k = path(x, v, steps, min_prob);
            if (k < 0) return NULL;
            return result(x, 0, k ? x->buf_score[k - 1] : 0.0, m);
        }
        if (v == 0) break;
        v = x->link[v]; m = x->len[v];
    }
    x->buf_tok.n = 0;
    return result(x, 0, 0.0, 0);
}

/* methods.oracle.SuffixAutomaton.longest_prefix: the largest m <= limit with seq[start:start + m]
 * a substring of some inserted text (removed ones included: the cache oracle removes nothing) */
static PyObject *Index_longest_prefix(Index *x, PyObject *args) {
    PyObject *seq; Py_ssize_t start, limit;
    if (!PyArg_ParseTuple(args, "Onn", &seq, &start, &limit)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "seq must be a sequence of ints");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), end = start + limit < n ? start + limit : n, i = start;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int32_t state = 0;
    for (; i < end; i++) {
        long c = PyLong_AsLong(items[i]);
        if (c == -1 && PyErr_Occurred()) { Py_DECREF(fast); return NULL; }
        if (c < INT32_MIN + 1 || c > INT32_MAX) break;
        int32_t nx = trans(x, state, (int32_t)c);
        if (nx < 0) break;
        state = nx;
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(i > start ? i - start : 0);
}

/* ----- inspection ----- */
static PyObject *Index_sequence(Index *x, PyObject *args) {
    if (need_counts(x, "sequence") < 0) return NULL;
    PyObject *sid;
    if (!PyArg_ParseTuple(args, "O", &sid)) return NULL;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    if (slot < 0) { PyErr_SetObject(PyExc_KeyError, sid); return NULL; }
    return list_of(x->seqs[slot].tokens.v, x->seqs[slot].tokens.n);
}
static PyObject *Index_sequence_length(Index *x, PyObject *args) {
    if (need_counts(x, "sequence_length") < 0) return NULL;
    PyObject *sid;
    if (!PyArg_ParseTuple(args, "O", &sid)) return NULL;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    if (slot < 0) { PyErr_SetObject(PyExc_KeyError, sid); return NULL; }
    return PyLong_FromLong(x->seqs[slot].tokens.n);
}
static PyObject *Index_sequence_tail(Index *x, PyObject *args) {
    if (need_counts(x, "sequence_tail") < 0) return NULL;
    PyObject *sid;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On", &sid, &n)) return NULL;
    int32_t slot = slot_of(x, sid);
    if (slot == -2) return NULL;
    if (slot < 0) { PyErr_SetObject(PyExc_KeyError, sid); return NULL; }
    Py_ssize_t len = x->seqs[slot].tokens.n;
    if (n < 0) n = 0;
    if (n > len) n = len;
    return list_of(x->seqs[slot].tokens.v + (len - n), n);
}
static PyObject *Index_count_of(Index *x, PyObject *args) {
    if (need_counts(x, "count_of") < 0) return NULL;
    int s;
    if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
    if (s < 0 || s >= x->n) { PyErr_SetString(PyExc_ValueError, "no such state"); return NULL; }
    return PyLong_FromLong(x->count[s]);
}
static PyObject *Index_top_child(Index *x, PyObject *args) {
    if (need_counts(x, "top_child") < 0) return NULL;
    int s;
    if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
    if (s < 0 || s >= x->n) { PyErr_SetString(PyExc_ValueError, "no such state"); return NULL; }
    int32_t t = top_of(x, s);
    if (t < 0) Py_RETURN_NONE;
    return PyLong_FromLong(t);
}
static PyObject *Index_approx_bytes(Index *x, PyObject *Py_UNUSED(a)) {
    int64_t extra = 0, seqb = 0;
    for (int32_t i = 0; i < x->npool; i++) extra += x->pool[i].cap;
    for (int32_t i = 0; i < x->nseq; i++)
        seqb += (int64_t)x->seqs[i].tokens.cap * 8 + (int64_t)x->seqs[i].when.cap * 8;
    return PyLong_FromLongLong((int64_t)x->cap * (x->counted ? 40 : 20) + (int64_t)x->poolcap * 16 + extra * 4 + (int64_t)x->hcap * 12 + seqb);
}

/* ----- pickling: every array as bytes ----- */
static PyObject *Index_getstate(Index *x, PyObject *Py_UNUSED(a)) {
    if (need_counts(x, "pickling") < 0) return NULL;
    ivec more_flat = {NULL, 0, 0};  /* state, n, tokens... for states with more */
    for (int32_t s = 0; s < x->n; s++) {
        const ivec *m = more_of(x, s);
        if (!m->n) continue;
        if (ivec_push(&more_flat, s) < 0 || ivec_push(&more_flat, m->n) < 0) goto fail;
        for (int32_t j = 0; j < m->n; j++) {
            int32_t c = m->v[j];
            if (ivec_push(&more_flat, c) < 0 || ivec_push(&more_flat, hget(x, s, c)) < 0) goto fail;
        }
    }
    PyObject *seqs = PyList_New(0);
    if (!seqs) goto fail;
    Py_ssize_t pos = 0; PyObject *key, *val;
    while (PyDict_Next(x->ids, &pos, &key, &val)) {
        Seq *q = &x->seqs[PyLong_AsLong(val)];
        PyObject *t = Py_BuildValue("(Oy#y#y#ii)", key, BYTES(q->tokens.v), (Py_ssize_t)q->tokens.n * 4,
                                    BYTES(q->par.v), (Py_ssize_t)q->par.n * 4, BYTES(q->when.v),
                                    (Py_ssize_t)q->when.n * 8, q->end, q->deep);
        if (!t || PyList_Append(seqs, t) < 0) { Py_XDECREF(t); Py_DECREF(seqs); goto fail; }
        Py_DECREF(t);
    }
    Py_ssize_t n4 = (Py_ssize_t)x->n * 4;
    PyObject *st = Py_BuildValue("(idLLLy#y#y#y#y#y#y#y#y#N)", x->max_depth, x->compact_ratio, (long long)x->version,
                                 (long long)x->clock, (long long)x->dead_tokens, (char *)x->len, n4, (char *)x->link, n4,
                                 (char *)x->tok, n4, (char *)x->to, n4, (char *)x->count, n4,
                                 (char *)x->top, n4, (char *)x->last_tok, n4, (char *)x->time,
                                 (Py_ssize_t)x->n * 8, BYTES(more_flat.v), (Py_ssize_t)more_flat.n * 4, seqs);
    PyMem_Free(more_flat.v);
    return st;
fail:
    PyMem_Free(more_flat.v);
    return NULL;
}

static int copy_bytes(PyObject *b, void *dst, Py_ssize_t size) {
    if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) != size) { PyErr_SetString(PyExc_ValueError, "bad state"); return -1; }
    memcpy(dst, PyBytes_AS_STRING(b), (size_t)size);
    return 0;
}

static PyObject *Index_setstate(Index *x, PyObject *st) {
    int depth; double ratio; long long version, clock, dead;
    PyObject *a[9], *seqs;
    if (!PyArg_ParseTuple(st, "idLLLSSSSSSSSSO", &depth, &ratio, &version, &clock, &dead, &a[0], &a[1], &a[2],
                          &a[3], &a[4], &a[5], &a[6], &a[7], &a[8], &seqs)) return NULL;
    free_states(x); free_seqs(x);
    x->ids = PyDict_New();
    if (!x->ids) return NULL;
    x->max_depth = depth; x->compact_ratio = ratio; x->version = version;
    int32_t n = (int32_t)(PyBytes_GET_SIZE(a[0]) / 4);
    for (int32_t s = 0; s < n; s++) if (new_state(x, 0, 0, 0, 0, 0, 0, 0, 0) < 0) return NULL;
    Py_ssize_t n4 = (Py_ssize_t)n * 4;
    if (copy_bytes(a[0], x->len, n4) < 0 || copy_bytes(a[1], x->link, n4) < 0 || copy_bytes(a[2], x->tok, n4) < 0 ||
        copy_bytes(a[3], x->to, n4) < 0 || copy_bytes(a[4], x->count, n4) < 0 || copy_bytes(a[5], x->top, n4) < 0 ||
        copy_bytes(a[6], x->last_tok, n4) < 0 || copy_bytes(a[7], x->time, (Py_ssize_t)n * 8) < 0) return NULL;
    const int32_t *mf = (const int32_t *)PyBytes_AS_STRING(a[8]);
    Py_ssize_t mn = PyBytes_GET_SIZE(a[8]) / 4, i = 0;
    while (i < mn) {
        int32_t s = mf[i], k = mf[i + 1];
        i += 2;
        for (int32_t j = 0; j < k; j++, i += 2)
            if (more_push(x, s, mf[i]) < 0 || hput(x, s, mf[i], mf[i + 1]) < 0) return NULL;
    }
    Py_ssize_t ns = PyList_Size(seqs);
    for (Py_ssize_t j = 0; j < ns; j++) {
        PyObject *key, *tb, *pb, *wb; int end, deep;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(seqs, j), "OSSSii", &key, &tb, &pb, &wb, &end, &deep)) return NULL;
        int32_t slot = add_seq(x, key);
        if (slot < 0) return NULL;
        Seq *q = &x->seqs[slot];
        int32_t len = (int32_t)(PyBytes_GET_SIZE(tb) / 4);
        for (int32_t k = 0; k < len; k++) {
            q = &x->seqs[slot];
            if (ivec_push(&q->tokens, ((int32_t *)PyBytes_AS_STRING(tb))[k]) < 0 ||
                ivec_push(&q->par, ((int32_t *)PyBytes_AS_STRING(pb))[k]) < 0 ||
                lvec_push(&q->when, ((int64_t *)PyBytes_AS_STRING(wb))[k]) < 0) return NULL;
        }
        x->seqs[slot].end = end; x->seqs[slot].deep = deep;
    }
    x->clock = clock; x->dead_tokens = dead;
    Py_RETURN_NONE;
}

/* ----- type ----- */
static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Index *x = (Index *)type->tp_alloc(type, 0);
    if (!x) return NULL;
    x->max_depth = 64; x->compact_ratio = 2.0; x->counted = 1;
    x->ids = PyDict_New();
    if (!x->ids || reset_states(x) < 0) { Py_DECREF(x); return NULL; }
    return (PyObject *)x;
}

static int Index_init(Index *x, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_depth", "compact_ratio", "counts", NULL};
    int depth = 64, counted = 1; double ratio = 2.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|idp", names, &depth, &ratio, &counted)) return -1;
    if (depth < 1) { PyErr_Format(PyExc_ValueError, "max_depth must be >= 1, got %d", depth); return -1; }
    if (counted != x->counted) {  /* before anything is inserted: the per-state arrays differ */
        if (x->n > 1 || PyDict_Size(x->ids)) {
            PyErr_SetString(PyExc_ValueError, "counts can be chosen only on a new automaton");
            return -1;
        }
        x->counted = counted;
        if (reset_states(x) < 0) return -1;
    }
    x->max_depth = depth; x->compact_ratio = ratio;
    return 0;
}

static void Index_dealloc(Index *x) {
    free_states(x); free_seqs(x);
    PyMem_Free(x->buf_tok.v); PyMem_Free(x->buf_par.v); PyMem_Free(x->buf_match); PyMem_Free(x->buf_score);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

static Py_ssize_t Index_len(Index *x) { return PyDict_Size(x->ids); }
static int Index_contains(Index *x, PyObject *sid) { return PyDict_Contains(x->ids, sid); }

static PyObject *get_version(Index *x, void *c) { return PyLong_FromLongLong(x->version); }
static PyObject *get_num_nodes(Index *x, void *c) { return PyLong_FromLong(x->n); }
static PyObject *get_max_depth(Index *x, void *c) { return PyLong_FromLong(x->max_depth); }
static PyObject *get_compact_ratio(Index *x, void *c) { return PyFloat_FromDouble(x->compact_ratio); }

static PyGetSetDef Index_getset[] = {
    {"version", (getter)get_version, NULL, "bumped by every change (matchers rematch after one)", NULL},
    {"num_nodes", (getter)get_num_nodes, NULL, "automaton states", NULL},
    {"max_depth", (getter)get_max_depth, NULL, NULL, NULL},
    {"compact_ratio", (getter)get_compact_ratio, NULL, NULL, NULL},
    {NULL}
};

static PyMethodDef Index_methods[] = {
    {"extend", (PyCFunction)Index_extend, METH_VARARGS, "append tokens to a sequence (new or existing)"},
    {"append", (PyCFunction)Index_append, METH_VARARGS, "append one token"},
    {"extend_copy", (PyCFunction)Index_extend_copy, METH_VARARGS, "a new sequence equal to a live one"},
    {"remove", (PyCFunction)Index_remove, METH_VARARGS, "forget a sequence"},
    {"compact", (PyCFunction)Index_compact, METH_NOARGS, "rebuild from the live sequences"},
    {"sequence", (PyCFunction)Index_sequence, METH_VARARGS, "a sequence's tokens (a new list)"},
    {"sequence_length", (PyCFunction)Index_sequence_length, METH_VARARGS, "a sequence's length"},
    {"sequence_tail", (PyCFunction)Index_sequence_tail, METH_VARARGS, "a sequence's last n tokens (a new list)"},
    {"count_of", (PyCFunction)Index_count_of, METH_VARARGS, NULL},
    {"top_child", (PyCFunction)Index_top_child, METH_VARARGS, NULL},
    {"approx_bytes", (PyCFunction)Index_approx_bytes, METH_NOARGS, NULL},
    {"own_matches", (PyCFunction)Index_own_matches, METH_VARARGS, "states of a sequence's own suffixes"},
    {"_longest_live", (PyCFunction)Index_longest_live, METH_VARARGS, NULL},
    {"_chain", (PyCFunction)Index_chain, METH_VARARGS, NULL},
    {"_feed", (PyCFunction)Index_feed, METH_VARARGS, NULL},
    {"_speculate", (PyCFunction)Index_speculate_raw, METH_VARARGS, NULL},
    {"_speculate_own", (PyCFunction)Index_speculate_own_raw, METH_VARARGS, NULL},
    {"_first_hit", (PyCFunction)Index_first_hit_raw, METH_VARARGS, NULL},
    {"longest_prefix", (PyCFunction)Index_longest_prefix, METH_VARARGS,
     "largest m <= limit with seq[start:start + m] in some text (the cache oracle's walk)"},
    {"__getstate__", (PyCFunction)Index_getstate, METH_NOARGS, NULL},
    {"__setstate__", (PyCFunction)Index_setstate, METH_O, NULL},
    {NULL}
};

static PySequenceMethods Index_as_sequence = {
    .sq_length = (lenfunc)Index_len,
    .sq_contains = (objobjproc)Index_contains,
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "methods.suffix._compiled.CompiledAutomaton",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The counted suffix automaton and its queries in C (methods/suffix/compiled.py wraps it).",
    .tp_new = Index_new,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
    .tp_as_sequence = &Index_as_sequence,
};

/* ---- one iteration's rows at once: the in-flight tree drafters' propose_batch / observe_batch ----
   Row i's automaton is indexes[i] (one per prompt), its sequence seq_ids[i]; each row does what the
   per-row calls do, in row order, so a batch equals its calls made one by one. */

static Index *row_index(PyObject *obj, Py_ssize_t i) {
    if (!PyObject_TypeCheck(obj, &IndexType)) {
        PyErr_Format(PyExc_TypeError, "row %zd: expected a CompiledAutomaton, got %.80s", i, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (Index *)obj;
}

/* append tokens[from:to] of a Python sequence to sequence sid of x (created if absent); 0 or -1 */
static int extend_from(Index *x, PyObject *sid, PyObject *tokens, Py_ssize_t from, Py_ssize_t to) {
    PyObject *tail = PySequence_GetSlice(tokens, from, to);
    if (!tail) return -1;
    int bad = read_tokens(x, tail, &x->buf_tok);
    Py_DECREF(tail);
    return bad < 0 ? -1 : extend_seq(x, sid);
}

/* speculate_own_many(indexes, seq_ids, outputs, budgets, cap, longest, factor, offset, min_prob, tree)
   -> (results, drafts, draft_tokens, match_len_sum). results[i]: (tokens, parents) of row i's draft
   of at most min(cap, budgets[i]) tokens, empty where its index or sequence id is None or that
   limit is 0 or the sequence is longer than START + outputs[i]; a sequence shorter than that is
   first topped up from outputs[i] (the engine showed tokens it did not observe), as the per-row
   propose does. The sums count the non-empty drafts returned. */
static PyObject *speculate_own_many(PyObject *mod, PyObject *args) {
    PyObject *indexes, *sids, *outputs, *budgets; int cap, longest, tree; double factor, offset, min_prob;
    if (!PyArg_ParseTuple(args, "O!O!O!O!ipdddp", &PyList_Type, &indexes, &PyList_Type, &sids, &PyList_Type,
                          &outputs, &PyList_Type, &budgets, &cap, &longest, &factor, &offset, &min_prob, &tree))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(indexes);
    if (PyList_GET_SIZE(sids) != n || PyList_GET_SIZE(outputs) != n || PyList_GET_SIZE(budgets) != n) {
        PyErr_SetString(PyExc_ValueError, "speculate_own_many: indexes, seq_ids, outputs and budgets differ in length");
        return NULL;
    }
    PyObject *results = PyList_New(n);
    if (!results) return NULL;
    long drafts = 0, draft_tokens = 0, match_sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *io = PyList_GET_ITEM(indexes, i), *sid = PyList_GET_ITEM(sids, i), *r = NULL;
        long budget = PyLong_AsLong(PyList_GET_ITEM(budgets, i));
        if (budget == -1 && PyErr_Occurred()) goto fail;
        long limit = cap < budget ? cap : budget;
        Index *x = NULL;
        int32_t slot = -1;
        if (io != Py_None && sid != Py_None && limit > 0) {
            if (!(x = row_index(io, i)) || need_counts(x, "speculate_own_many") < 0) goto fail;
            if ((slot = slot_of(x, sid)) == -2) goto fail;
            if (slot < 0) { PyErr_SetObject(PyExc_KeyError, sid); goto fail; }
        }
        if (slot < 0) {
            r = Py_BuildValue("([]O)", Py_None);
        } else {
            PyObject *output = PyList_GET_ITEM(outputs, i);
            Py_ssize_t out_len = PyObject_Length(output);
            if (out_len < 0) goto fail;
            Py_ssize_t have = x->seqs[slot].tokens.n - 1;
            if (have < out_len) {  /* the engine showed tokens it did not observe: take them */
                if (extend_from(x, sid, output, have, out_len) < 0) goto fail;
                have = out_len;
            }
            if (have > out_len) {
                r = Py_BuildValue("([]O)", Py_None);
            } else {
                int32_t nm = own_matches(x, slot);
                if (nm < 0) goto fail;
                PyObject *spec = spec_rule(x, x->buf_match, nm, longest, (int32_t)limit, factor, offset, min_prob, tree);
                if (!spec) goto fail;
                PyObject *toks = PyTuple_GET_ITEM(spec, 0);
                Py_ssize_t k = PyList_GET_SIZE(toks);
                if (k) { drafts++; draft_tokens += (long)k; match_sum += PyLong_AsLong(PyTuple_GET_ITEM(spec, 3)); }
                r = PyTuple_Pack(2, toks, PyTuple_GET_ITEM(spec, 1));
                Py_DECREF(spec);
            }
        }
        if (!r) goto fail;
        PyList_SET_ITEM(results, i, r);
    }
    return Py_BuildValue("(Nlll)", results, drafts, draft_tokens, match_sum);
fail:
    Py_DECREF(results);
    return NULL;
}

/* extend_many(indexes, seq_ids, token_lists): indexes[i].extend(seq_ids[i], token_lists[i]) for every
   row whose sequence id is not None, in row order */
static PyObject *extend_many(PyObject *mod, PyObject *args) {
    PyObject *indexes, *sids, *lists;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &indexes, &PyList_Type, &sids, &PyList_Type, &lists))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(indexes);
    if (PyList_GET_SIZE(sids) != n || PyList_GET_SIZE(lists) != n) {
        PyErr_SetString(PyExc_ValueError, "extend_many: indexes, seq_ids and token_lists differ in length");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *sid = PyList_GET_ITEM(sids, i);
        if (sid == Py_None) continue;
        Index *x = row_index(PyList_GET_ITEM(indexes, i), i);
        if (!x || read_tokens(x, PyList_GET_ITEM(lists, i), &x->buf_tok) < 0 || extend_seq(x, sid) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* the global trie's matches of a context (SuffixIndex.context_matches / match) into g->buf_match */
static int32_t context_matches(Index *g, int32_t gslot, const int32_t *ctx, int32_t n) {
    int32_t depth = g->max_depth;
    if (gslot >= 0 && g->seqs[gslot].tokens.n >= (n < depth ? n : depth)) return own_matches(g, gslot);
    int32_t v, m;
    longest_live(g, ctx, n > depth ? n - depth : 0, n, &v, &m);
    if (ensure_match(g, m) < 0) return -1;
    chain(g, v, m, g->buf_match);
    return m;
}

/* speculate_pair_many(global, owns, prompt_lens, global_ids, outputs, budgets, cap, factor, offset,
   min_prob, tree) -> (results, own_wins, global_wins, drafts, draft_tokens): suffix_global's
   in-flight propose for every row in order. Row i's own trie owns[i] holds its context (prompt
   and output) as sequence 0, topped up from outputs[i] when it is behind (and its response in the
   global trie, global_ids[i], with it); each trie drafts by the best-score rule over the
   context's suffixes up to one token shorter than min(context, max_depth), and the own draft
   wins ties. results[i] = (tokens, parents); empty where owns[i] is None, the limit
   min(cap, budgets[i]) is 0 or the own trie is ahead of the output. */
static PyObject *speculate_pair_many(PyObject *mod, PyObject *args) {
    PyObject *gobj, *owns, *plens, *gids, *outputs, *budgets; int cap, tree; double factor, offset, min_prob;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!idddp", &gobj, &PyList_Type, &owns, &PyList_Type, &plens, &PyList_Type,
                          &gids, &PyList_Type, &outputs, &PyList_Type, &budgets, &cap, &factor, &offset, &min_prob, &tree))
        return NULL;
    if (!PyObject_TypeCheck(gobj, &IndexType)) {
        PyErr_Format(PyExc_TypeError, "the global trie must be a CompiledAutomaton, got %.80s", Py_TYPE(gobj)->tp_name);
        return NULL;
    }
    Index *g = (Index *)gobj;
    if ( need_counts(g, "speculate_pair_many") < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(owns);
    if (PyList_GET_SIZE(plens) != n || PyList_GET_SIZE(gids) != n || PyList_GET_SIZE(outputs) != n ||
        PyList_GET_SIZE(budgets) != n) {
        PyErr_SetString(PyExc_ValueError, "speculate_pair_many: the per-row lists differ in length");
        return NULL;
    }
    PyObject *own_id = PyLong_FromLong(0), *results = PyList_New(n);
    if (!own_id || !results) { Py_XDECREF(own_id); Py_XDECREF(results); return NULL; }
    long own_wins = 0, global_wins = 0, drafts = 0, draft_tokens = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *oo = PyList_GET_ITEM(owns, i), *gid = PyList_GET_ITEM(gids, i), *output = PyList_GET_ITEM(outputs, i);
        PyObject *r = NULL, *mine = NULL, *theirs = NULL;
        long budget = PyLong_AsLong(PyList_GET_ITEM(budgets, i));
        if (budget == -1 && PyErr_Occurred()) goto fail;
        long plen = PyLong_AsLong(PyList_GET_ITEM(plens, i));
        if (plen == -1 && PyErr_Occurred()) goto fail;
        long limit = cap < budget ? cap : budget;
        Py_ssize_t out_len = PyObject_Length(output);
        if (out_len < 0) goto fail;
        Index *own = NULL;
        if (oo != Py_None && limit > 0) {
            if (!(own = row_index(oo, i)) || need_counts(own, "speculate_pair_many") < 0) goto fail;
        }
        int32_t oslot = own ? slot_of(own, own_id) : -1;
        if (oslot == -2) goto fail;
        Py_ssize_t have = oslot < 0 ? 0 : own->seqs[oslot].tokens.n - plen;
        if (own && have < out_len) {  /* tokens the engine did not observe(): take them, as observe does */
            if (extend_from(own, own_id, output, have, out_len) < 0) goto fail;
            if (gid != Py_None && extend_from(g, gid, output, have, out_len) < 0) goto fail;
            if ((oslot = slot_of(own, own_id)) == -2) goto fail;
            have = out_len;
        }
        if (!own || have > out_len) {
            r = Py_BuildValue("([]O)", Py_None);
        } else {
            int32_t depth = g->max_depth;
            long ctx_len = plen + (long)out_len;
            int32_t longest = (int32_t)((ctx_len < depth ? ctx_len : depth) - 1);
            if (longest < 0) longest = 0;
            int32_t nm = oslot < 0 ? 0 : own_matches(own, oslot);
            if (nm < 0) goto fail;
            mine = spec_rule(own, own->buf_match, nm < longest ? nm : longest, 0, (int32_t)limit, factor, offset,
                             min_prob, tree);
            if (!mine) goto fail;
            const int32_t *ctx = NULL; int32_t clen = 0;  /* the own text's last max_depth tokens */
            if (oslot >= 0) {
                ivec *t = &own->seqs[oslot].tokens;
                clen = t->n < depth ? t->n : depth;
                ctx = t->v + (t->n - clen);
            }
            int32_t gslot = gid == Py_None ? -1 : slot_of(g, gid);
            if (gslot == -2) goto fail;
            int32_t gm = context_matches(g, gslot, ctx, clen);
            if (gm < 0) goto fail;
            theirs = spec_rule(g, g->buf_match, gm < longest ? gm : longest, 0, (int32_t)limit, factor, offset,
                               min_prob, tree);
            if (!theirs) goto fail;
            PyObject *pick = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(mine, 2)) >= PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(theirs, 2))
                             ? mine : theirs;
            Py_ssize_t k = PyList_GET_SIZE(PyTuple_GET_ITEM(pick, 0));
            if (pick == mine) own_wins += k > 0; else global_wins++;
            if (k) { drafts++; draft_tokens += (long)k; }
            r = PyTuple_Pack(2, PyTuple_GET_ITEM(pick, 0), PyTuple_GET_ITEM(pick, 1));
            Py_CLEAR(mine); Py_CLEAR(theirs);
        }
        if (!r) goto fail;
        PyList_SET_ITEM(results, i, r);
        continue;
    fail:
        Py_XDECREF(mine); Py_XDECREF(theirs); Py_DECREF(results); Py_DECREF(own_id);
        return NULL;
    }
    Py_DECREF(own_id);
    return Py_BuildValue("(Nllll)", results, own_wins, global_wins, drafts, draft_tokens);
}

static PyMethodDef module_methods[] = {
    {"speculate_pair_many", speculate_pair_many, METH_VARARGS,
     "suffix_global's in-flight propose for every row of an iteration (see the comment above it)"},
    {"speculate_own_many", speculate_own_many, METH_VARARGS,
     "the in-flight drafters' propose for every row of an iteration (see the comment above it)"},
    {"extend_many", extend_many, METH_VARARGS, "extend every row's sequence, in row order"},
    {NULL}
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_compiled", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__compiled(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "CompiledAutomaton", (PyObject *)&IndexType) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
