/* The counting rules' two tables in compiled code (tally_server.domain.idmap wraps this module).
 *
 * IdMap: an insertion-ordered map of str ids to ints, as a dict[str, int] behaves, holding each id
 * as its UTF-8 bytes in one arena instead of a str object per id: a writer's pending counts and
 * its dedup map of task ids (DESIGN §2). A dense array of entries keeps the insertion order (a
 * key deleted and set again goes to the end, as in a dict); an index over it is probed with the
 * str's own hash (keyed SipHash, so ids a client chooses cannot be made to collide). Values are int64 in place; an int outside int64 is kept as a Python
 * int object (the rules never make one, but nothing a client sends may overflow a count).
 *
 * apply_new(applied, pending, tasks, sources, values, done=None, settling=None): the rules' common
 * case in one call (every task new, none twice; with `done`, a set, no source that is not pending in
 * it; with `settling`, a dict, no delta for a source in it while its count is zero): each task
 * added to the dedup map, each delta added to its source's count, returns the sources whose count
 * is zero at the end of the batch, in the order they first reached zero; or None, having changed
 * nothing, when the case does not apply (the caller then applies the batch delta by delta).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* An index slot: 0 empty, 1 a deleted entry's, else tag << 32 | (position + 2), where the tag is
 * bits 32-60 of the key's hash (the slot's place comes from the low bits): a probe passes over
 * another key's slot without reading its entry, in the same cache line (linear probing). */
#define SLOT_EMPTY ((uint64_t)0)
#define SLOT_DUMMY ((uint64_t)1)
#define SLOT(tag, ix) ((uint64_t)(tag) << 32 | (uint64_t)((ix) + 2))
#define SLOT_IX(slot) ((Py_ssize_t)((slot) & 0xffffffffu) - 2)
#define TAG(hash) ((uint32_t)((hash) >> 32))
#define MIN_SIZE 8
/* How many lookups ahead apply_new fetches the index slot of the next one. */
#define PREFETCH 16

/* An entry in 24 bytes: the key's hash and three flags, where its bytes are, its value. */
typedef struct {
    uint64_t hf;  /* the str's hash (its low 61 bits) | flags << 61 */
    uint64_t loc; /* the key's bytes: arena[off : off + len], off << 24 | len */
    union {
        int64_t i;
        PyObject *o; /* with F_BIG: an int outside int64 */
    } v;
} Entry;

#define HASH_MASK (~(uint64_t)0 >> 3)
#define FLAG_SHIFT 61
#define F_DELETED 1u
#define F_BIG 2u  /* the value is a Python int (v.o), outside int64 */
#define F_MARK 4u /* transient, within one call: seen */
#define MAX_KEY_LEN 0xFFFFFF
#define E_HASH(e) ((e)->hf & HASH_MASK)
#define E_HAS(e, f) (((e)->hf >> FLAG_SHIFT) & (f))
#define E_SET(e, f) ((e)->hf |= (uint64_t)(f) << FLAG_SHIFT)
#define E_CLEAR(e, f) ((e)->hf &= ~((uint64_t)(f) << FLAG_SHIFT))
#define E_OFF(e) ((Py_ssize_t)((e)->loc >> 24))
#define E_LEN(e) ((Py_ssize_t)((e)->loc & MAX_KEY_LEN))

typedef struct {
    PyObject_HEAD
    uint64_t *index; /* mask + 1 slots (SLOT) */
    size_t mask;
    Py_ssize_t fill; /* slots not empty (live and dummy) */
    Entry *entries;
    Py_ssize_t nentries; /* entries used, deleted ones included */
    Py_ssize_t capacity;
    Py_ssize_t count; /* live entries */
    char *arena;
    Py_ssize_t arena_used;
    Py_ssize_t arena_capacity;
    uint64_t version; /* changes whenever a key is added or removed */
} IdMap;

static PyTypeObject IdMapType;

/* ---- keys ---------------------------------------------------------------------------------- */

typedef struct {
    const char *data;
    Py_ssize_t len;
    uint64_t hash; /* the str's hash, its low 61 bits */
    PyObject *owned; /* a bytes object holding data, when the str had to be encoded */
} Key;

static int
key_of(PyObject *s, Key *k)
{
    k->owned = NULL;
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "ids are str, not %.100s", Py_TYPE(s)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) {
        return -1;
    }
#endif
    if (PyUnicode_IS_COMPACT_ASCII(s)) {
        k->data = (const char *)PyUnicode_DATA(s);
        k->len = PyUnicode_GET_LENGTH(s);
    }
    else {
        k->data = PyUnicode_AsUTF8AndSize(s, &k->len);
        if (k->data == NULL) { /* a lone surrogate: keep it, as a dict would */
            PyErr_Clear();
            k->owned = PyUnicode_AsEncodedString(s, "utf-8", "surrogatepass");
            if (k->owned == NULL) {
                return -1;
            }
            k->data = PyBytes_AS_STRING(k->owned);
            k->len = PyBytes_GET_SIZE(k->owned);
        }
    }
    if (k->len > MAX_KEY_LEN) {
        Py_CLEAR(k->owned);
        PyErr_SetString(PyExc_ValueError, "an id of more than 16 MiB");
        return -1;
    }
    Py_hash_t hash = PyObject_Hash(s);
    if (hash == -1) {
        Py_CLEAR(k->owned);
        return -1;
    }
    k->hash = (uint64_t)hash & HASH_MASK;
    return 0;
}

static inline void
key_release(Key *k)
{
    Py_CLEAR(k->owned);
}

static PyObject *
key_str(IdMap *m, Entry *e)
{
    return PyUnicode_DecodeUTF8(m->arena + E_OFF(e), E_LEN(e), "surrogatepass");
}

/* ---- values -------------------------------------------------------------------------------- */

static PyObject *
value_obj(Entry *e)
{
    if (E_HAS(e, F_BIG)) {
        return Py_NewRef(e->v.o);
    }
    return PyLong_FromLongLong((long long)e->v.i);
}

/* Set e's value from an int object; -1 with TypeError for anything else. */
static int
value_set(Entry *e, PyObject *value)
{
    int overflow = 0;
    long long x;
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "values are int, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    x = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (E_HAS(e, F_BIG)) {
        Py_DECREF(e->v.o);
        E_CLEAR(e, F_BIG);
    }
    if (overflow) {
        e->v.o = Py_NewRef(value);
        E_SET(e, F_BIG);
    }
    else {
        e->v.i = (int64_t)x;
    }
    return 0;
}

/* ---- the table ----------------------------------------------------------------------------- */

/* Position of the entry for k, or -1; *slot: where it is, or the slot a new entry would take. */
static Py_ssize_t
lookup(IdMap *m, const Key *k, size_t *slot)
{
    size_t mask = m->mask;
    size_t i = (size_t)k->hash & mask;
    size_t freeslot = (size_t)-1;
    uint32_t tag = TAG(k->hash);
    for (;;) {
        uint64_t s = m->index[i];
        if (s == SLOT_EMPTY) {
            *slot = freeslot != (size_t)-1 ? freeslot : i;
            return -1;
        }
        if (s == SLOT_DUMMY) {
            if (freeslot == (size_t)-1) {
                freeslot = i;
            }
        }
        else if ((uint32_t)(s >> 32) == tag) {
            Py_ssize_t ix = SLOT_IX(s);
            Entry *e = &m->entries[ix];
            if (E_HASH(e) == k->hash && E_LEN(e) == k->len &&
                memcmp(m->arena + E_OFF(e), k->data, (size_t)k->len) == 0) {
                *slot = i;
                return ix;
            }
        }
        i = (i + 1) & mask;
    }
}

/* The slot holding entry ix. */
static size_t
slot_of(IdMap *m, Py_ssize_t ix)
{
    size_t mask = m->mask;
    uint64_t hash = E_HASH(&m->entries[ix]);
    uint64_t want = SLOT(TAG(hash), ix);
    size_t i = (size_t)hash & mask;
    while (m->index[i] != want) {
        i = (i + 1) & mask;
    }
    return i;
}

static int
build_index(IdMap *m, size_t size)
{
    uint64_t *index = PyMem_Calloc(size, sizeof(uint64_t)); /* SLOT_EMPTY */
    if (index == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(m->index);
    m->index = index;
    m->mask = size - 1;
    for (Py_ssize_t ix = 0; ix < m->nentries; ix++) {
        Entry *e = &m->entries[ix];
        if (E_HAS(e, F_DELETED)) {
            continue;
        }
        uint64_t hash = E_HASH(e);
        size_t i = (size_t)hash & m->mask;
        while (index[i] != SLOT_EMPTY) {
            i = (i + 1) & m->mask;
        }
        index[i] = SLOT(TAG(hash), ix);
    }
    m->fill = m->count;
    return 0;
}

/* Drop deleted entries and their keys' bytes; insertion order is kept. */
static int
compact(IdMap *m)
{
    Py_ssize_t live_bytes = 0;
    for (Py_ssize_t ix = 0; ix < m->nentries; ix++) {
        if (!E_HAS(&m->entries[ix], F_DELETED)) {
            live_bytes += E_LEN(&m->entries[ix]);
        }
    }
    Py_ssize_t cap = live_bytes > 64 ? live_bytes + live_bytes / 2 : 64;
    char *arena = PyMem_Malloc((size_t)cap);
    if (arena == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t n = 0, used = 0;
    for (Py_ssize_t ix = 0; ix < m->nentries; ix++) {
        Entry e = m->entries[ix];
        if (E_HAS(&e, F_DELETED)) {
            continue;
        }
        memcpy(arena + used, m->arena + E_OFF(&e), (size_t)E_LEN(&e));
        e.loc = (uint64_t)used << 24 | (uint64_t)E_LEN(&e);
        used += E_LEN(&e);
        m->entries[n++] = e;
    }
    PyMem_Free(m->arena);
    m->arena = arena;
    m->arena_used = used;
    m->arena_capacity = cap;
    m->nentries = n;
    m->version++;
    return 0;
}

/* Room for `extra` new keys of `extra_bytes` bytes in all: no resize (nor moved entry) until then. */
static int
reserve(IdMap *m, Py_ssize_t extra, Py_ssize_t extra_bytes)
{
    int rebuild = 0;
    if (m->nentries + extra > m->capacity) {
        Py_ssize_t deleted = m->nentries - m->count;
        if (deleted > 0 && deleted >= m->nentries / 4) {
            if (compact(m) < 0) {
                return -1;
            }
            rebuild = 1;
        }
        if (m->nentries + extra > m->capacity) {
            Py_ssize_t cap = (m->count + extra) + (m->count + extra) / 2 + 8;
            if (cap > INT32_MAX) {
                PyErr_SetString(PyExc_MemoryError, "too many ids in one map");
                return -1;
            }
            Entry *entries = PyMem_Realloc(m->entries, (size_t)cap * sizeof(Entry));
            if (entries == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            m->entries = entries;
            m->capacity = cap;
        }
    }
    if (m->arena_used + extra_bytes > m->arena_capacity) {
        Py_ssize_t cap = m->arena_used + extra_bytes;
        cap += cap / 2 + 64;
        char *arena = PyMem_Realloc(m->arena, (size_t)cap);
        if (arena == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        m->arena = arena;
        m->arena_capacity = cap;
    }
    size_t size = m->mask + 1;
    if (rebuild || (size_t)(m->fill + extra) * 3 > size * 2) {
        size_t want = MIN_SIZE;
        while (want < (size_t)(m->count + extra) * 2) {
            want <<= 1;
        }
        if (build_index(m, want) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Append a new entry for k at `slot` (from lookup, after reserve); returns its position. */
static Py_ssize_t
insert_new(IdMap *m, const Key *k, size_t slot, int64_t value)
{
    Py_ssize_t ix = m->nentries++;
    Entry *e = &m->entries[ix];
    e->hf = k->hash;
    e->loc = (uint64_t)m->arena_used << 24 | (uint64_t)k->len;
    e->v.i = value;
    memcpy(m->arena + m->arena_used, k->data, (size_t)k->len);
    m->arena_used += k->len;
    if (m->index[slot] == SLOT_EMPTY) {
        m->fill++;
    }
    m->index[slot] = SLOT(TAG(k->hash), ix);
    m->count++;
    m->version++;
    return ix;
}

static void
delete_at(IdMap *m, Py_ssize_t ix, size_t slot)
{
    Entry *e = &m->entries[ix];
    m->index[slot] = SLOT_DUMMY;
    if (E_HAS(e, F_BIG)) {
        Py_CLEAR(e->v.o);
    }
    e->hf = (uint64_t)F_DELETED << FLAG_SHIFT;
    m->count--;
    m->version++;
}

/* Remove every entry from position n on (added by a call being undone), and their keys' bytes. */
static void
truncate_to(IdMap *m, Py_ssize_t n, Py_ssize_t arena_used)
{
    for (Py_ssize_t ix = m->nentries - 1; ix >= n; ix--) {
        if (!E_HAS(&m->entries[ix], F_DELETED)) {
            delete_at(m, ix, slot_of(m, ix));
        }
    }
    m->nentries = n;
    m->arena_used = arena_used;
}

static int
init_storage(IdMap *m)
{
    m->index = NULL;
    m->entries = NULL;
    m->arena = NULL;
    m->nentries = m->capacity = m->count = m->fill = 0;
    m->arena_used = m->arena_capacity = 0;
    m->version++; /* never back to a value an iterator may hold */
    return build_index(m, MIN_SIZE);
}

static void
free_storage(IdMap *m)
{
    if (m->entries != NULL) {
        for (Py_ssize_t ix = 0; ix < m->nentries; ix++) {
            if (E_HAS(&m->entries[ix], F_BIG)) {
                Py_CLEAR(m->entries[ix].v.o);
            }
        }
    }
    PyMem_Free(m->index);
    PyMem_Free(m->entries);
    PyMem_Free(m->arena);
    m->index = NULL;
    m->entries = NULL;
    m->arena = NULL;
}

/* Set k to value (an int object). */
static int
set_item(IdMap *m, PyObject *key, PyObject *value)
{
    Key k;
    size_t slot;
    if (key_of(key, &k) < 0) {
        return -1;
    }
    Py_ssize_t ix = lookup(m, &k, &slot);
    if (ix < 0) {
        if (!PyLong_Check(value)) {
            key_release(&k);
            PyErr_Format(PyExc_TypeError, "values are int, not %.100s", Py_TYPE(value)->tp_name);
            return -1;
        }
        if (reserve(m, 1, k.len) < 0) {
            key_release(&k);
            return -1;
        }
        ix = lookup(m, &k, &slot);
        ix = insert_new(m, &k, slot, 0);
    }
    key_release(&k);
    return value_set(&m->entries[ix], value);
}

/* ---- the mapping protocol ------------------------------------------------------------------ */

static PyObject *
IdMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    IdMap *m = (IdMap *)type->tp_alloc(type, 0); /* zeroed: version 0 */
    if (m == NULL) {
        return NULL;
    }
    if (init_storage(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static int update_from(IdMap *m, PyObject *other);

static int
IdMap_init(IdMap *m, PyObject *args, PyObject *kwds)
{
    PyObject *other = NULL;
    static char *kwlist[] = {"items", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:IdMap", kwlist, &other)) {
        return -1;
    }
    if (m->count) {
        free_storage(m);
        if (init_storage(m) < 0) {
            return -1;
        }
    }
    return other == NULL ? 0 : update_from(m, other);
}

static void
IdMap_dealloc(IdMap *m)
{
    free_storage(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
IdMap_len(IdMap *m)
{
    return m->count;
}

/* The entry of `key` (and its slot), or -1 with KeyError (a key that is no str is not here). */
static Py_ssize_t
find_existing(IdMap *m, PyObject *key, size_t *slot)
{
    Key k;
    if (key_of(key, &k) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetObject(PyExc_KeyError, key);
        }
        return -1;
    }
    Py_ssize_t ix = lookup(m, &k, slot);
    key_release(&k);
    if (ix < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
    }
    return ix;
}

static PyObject *
IdMap_getitem(IdMap *m, PyObject *key)
{
    size_t slot;
    Py_ssize_t ix = find_existing(m, key, &slot);
    return ix < 0 ? NULL : value_obj(&m->entries[ix]);
}

static int
IdMap_ass_subscript(IdMap *m, PyObject *key, PyObject *value)
{
    if (value != NULL) {
        return set_item(m, key, value);
    }
    size_t slot;
    Py_ssize_t ix = find_existing(m, key, &slot);
    if (ix < 0) {
        return -1;
    }
    delete_at(m, ix, slot);
    return 0;
}

static int
IdMap_contains(IdMap *m, PyObject *key)
{
    Key k;
    size_t slot;
    if (!PyUnicode_Check(key)) {
        return 0;
    }
    if (key_of(key, &k) < 0) {
        return -1;
    }
    Py_ssize_t ix = lookup(m, &k, &slot);
    key_release(&k);
    return ix >= 0;
}

static PyObject *
IdMap_get(IdMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    Key k;
    size_t slot;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *fallback = nargs == 2 ? args[1] : Py_None;
    if (!PyUnicode_Check(args[0])) {
        return Py_NewRef(fallback);
    }
    if (key_of(args[0], &k) < 0) {
        return NULL;
    }
    Py_ssize_t ix = lookup(m, &k, &slot);
    key_release(&k);
    if (ix < 0) {
        return Py_NewRef(fallback);
    }
    return value_obj(&m->entries[ix]);
}

static int
update_from(IdMap *m, PyObject *other)
{
    if (PyDict_Check(other)) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(other, &pos, &key, &value)) {
            Py_INCREF(key);
            Py_INCREF(value);
            int rc = set_item(m, key, value);
            Py_DECREF(key);
            Py_DECREF(value);
            if (rc < 0) {
                return -1;
            }
        }
        return 0;
    }
    PyObject *items;
    if (PyObject_HasAttrString(other, "keys")) {
        items = PyMapping_Items(other);
    }
    else {
        items = PySequence_List(other);
    }
    if (items == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(items);
            PyErr_SetString(PyExc_TypeError, "IdMap() takes a mapping or (key, value) pairs");
            return -1;
        }
        if (set_item(m, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    return 0;
}

static PyObject *
IdMap_update(IdMap *m, PyObject *other)
{
    if (update_from(m, other) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
IdMap_clear(IdMap *m, PyObject *Py_UNUSED(ignored))
{
    free_storage(m);
    if (init_storage(m) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* kind 0: keys, 1: values, 2: (key, value) tuples */
static PyObject *
listing(IdMap *m, int kind)
{
    PyObject *out = PyList_New(m->count);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t ix = 0; ix < m->nentries; ix++) {
        Entry *e = &m->entries[ix];
        if (E_HAS(e, F_DELETED)) {
            continue;
        }
        PyObject *item;
        if (kind == 0) {
            item = key_str(m, e);
        }
        else if (kind == 1) {
            item = value_obj(e);
        }
        else {
            PyObject *key = key_str(m, e);
            PyObject *value = key ? value_obj(e) : NULL;
            item = value ? PyTuple_Pack(2, key, value) : NULL;
            Py_XDECREF(key);
            Py_XDECREF(value);
        }
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, item);
    }
    return out;
}

static PyObject *
IdMap_items(IdMap *m, PyObject *Py_UNUSED(ignored))
{
    return listing(m, 2);
}

static PyObject *
IdMap_values(IdMap *m, PyObject *Py_UNUSED(ignored))
{
    return listing(m, 1);
}

static PyObject *
IdMap_sizeof(IdMap *m, PyObject *Py_UNUSED(ignored))
{
    size_t size = sizeof(IdMap) + (m->mask + 1) * sizeof(uint64_t) + (size_t)m->capacity * sizeof(Entry) +
                  (size_t)m->arena_capacity;
    return PyLong_FromSize_t(size);
}

/* take_zeros(sources): if every source is here once with a count of zero, delete them all and
 * return True; else change nothing and return False. */
static PyObject *
IdMap_take_zeros(IdMap *m, PyObject *sources)
{
    if (!PyList_CheckExact(sources)) {
        PyErr_SetString(PyExc_TypeError, "take_zeros() takes a list of ids");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(sources);
    Py_ssize_t *found = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (found == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t i, marked = 0;
    int ok = 1;
    for (i = 0; i < n; i++) {
        Key k;
        size_t slot;
        if (key_of(PyList_GET_ITEM(sources, i), &k) < 0) {
            ok = -1;
            break;
        }
        Py_ssize_t ix = lookup(m, &k, &slot);
        key_release(&k);
        if (ix < 0 || E_HAS(&m->entries[ix], F_BIG | F_MARK) || m->entries[ix].v.i != 0) {
            ok = 0;
            break;
        }
        E_SET(&m->entries[ix], F_MARK);
        found[marked++] = ix;
    }
    for (i = 0; i < marked; i++) {
        E_CLEAR(&m->entries[found[i]], F_MARK);
    }
    if (ok == 1) {
        for (i = 0; i < marked; i++) {
            delete_at(m, found[i], slot_of(m, found[i]));
        }
    }
    PyMem_Free(found);
    if (ok < 0) {
        return NULL;
    }
    return PyBool_FromLong(ok);
}

/* ---- iteration ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    IdMap *map;
    Py_ssize_t pos;
    uint64_t version;
} IdMapIter;

static PyTypeObject IdMapIterType;

static PyObject *
IdMap_iter(IdMap *m)
{
    IdMapIter *it = PyObject_New(IdMapIter, &IdMapIterType);
    if (it == NULL) {
        return NULL;
    }
    it->map = (IdMap *)Py_NewRef(m);
    it->pos = 0;
    it->version = m->version;
    return (PyObject *)it;
}

static void
IdMapIter_dealloc(IdMapIter *it)
{
    Py_XDECREF(it->map);
    PyObject_Free(it);
}

static PyObject *
IdMapIter_next(IdMapIter *it)
{
    IdMap *m = it->map;
    if (m == NULL) {
        return NULL;
    }
    if (m->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "IdMap changed size during iteration");
        return NULL;
    }
    while (it->pos < m->nentries) {
        Entry *e = &m->entries[it->pos++];
        if (!E_HAS(e, F_DELETED)) {
            return key_str(m, e);
        }
    }
    Py_CLEAR(it->map);
    return NULL;
}

static PyTypeObject IdMapIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tally_server._ledgercore.IdMapIterator",
    .tp_basicsize = sizeof(IdMapIter),
    .tp_dealloc = (destructor)IdMapIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)IdMapIter_next,
};

/* ---- apply_new ----------------------------------------------------------------------------- */

static PyObject *
apply_new(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 5 || nargs > 7 || !PyObject_TypeCheck(args[0], &IdMapType) ||
        !PyObject_TypeCheck(args[1], &IdMapType) || !PyList_CheckExact(args[2]) ||
        !PyList_CheckExact(args[3]) || !PyList_CheckExact(args[4]) ||
        (nargs >= 6 && args[5] != Py_None && !PyAnySet_Check(args[5])) ||
        (nargs == 7 && args[6] != Py_None && !PyDict_Check(args[6]))) {
        PyErr_SetString(PyExc_TypeError, "apply_new(applied: IdMap, pending: IdMap, tasks: list, sources: "
                                         "list, values: list, done: set | None = None, settling: dict | "
                                         "None = None)");
        return NULL;
    }
    IdMap *applied = (IdMap *)args[0], *pending = (IdMap *)args[1];
    PyObject *tasks = args[2], *sources = args[3], *values = args[4];
    /* Sources that may not be counted unless pending already (a writer's own completions). */
    PyObject *done = nargs >= 6 && args[5] != Py_None && PySet_GET_SIZE(args[5]) > 0 ? args[5] : NULL;
    /* Sources that may not be counted while at zero (settling: a delta cancels their settle). */
    PyObject *settling = nargs == 7 && args[6] != Py_None && PyDict_GET_SIZE(args[6]) > 0 ? args[6] : NULL;
    Py_ssize_t n = PyList_GET_SIZE(tasks);
    if (PyList_GET_SIZE(sources) != n || PyList_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "apply_new(): the columns differ in length");
        return NULL;
    }
    if (applied == pending) {
        PyErr_SetString(PyExc_ValueError, "apply_new(): applied and pending are one map");
        return NULL;
    }
    Py_ssize_t i, task_bytes = 0, source_bytes = 0, nkeys = 0;
    size_t cells = (size_t)(n ? n : 1);
    /* Per delta: its value, the task's key, and (for the sources that reached zero, first time
     * each) their entry and their position in `sources`. */
    char *scratch = PyMem_Malloc(cells * (sizeof(int64_t) + sizeof(Key) + 2 * sizeof(Py_ssize_t)));
    if (scratch == NULL) {
        return PyErr_NoMemory();
    }
    int64_t *ints = (int64_t *)scratch;
    Key *tkeys = (Key *)(ints + cells);
    Py_ssize_t *zero_ix = (Py_ssize_t *)(tkeys + cells);
    Py_ssize_t *zero_pos = zero_ix + cells;
    Py_ssize_t nzeros = 0;
    PyObject *result = NULL;
    /* 1. The values in range, the ids str, the tasks' keys. */
    for (i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        PyObject *sid = PyList_GET_ITEM(sources, i);
        int overflow = 0;
        long long x;
        if (!PyLong_Check(v)) {
            PyErr_Format(PyExc_TypeError, "values are int, not %.100s", Py_TYPE(v)->tp_name);
            goto done;
        }
        x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (overflow) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        ints[i] = (int64_t)x;
        if (!PyUnicode_Check(sid)) {
            PyErr_Format(PyExc_TypeError, "ids are str, not %.100s", Py_TYPE(sid)->tp_name);
            goto done;
        }
        source_bytes += PyUnicode_IS_COMPACT_ASCII(sid) ? PyUnicode_GET_LENGTH(sid)
                                                        : 4 * PyUnicode_GET_LENGTH(sid);
        if (key_of(PyList_GET_ITEM(tasks, i), &tkeys[i]) < 0) {
            goto done;
        }
        nkeys++;
        task_bytes += tkeys[i].len;
    }
    /* 2. Every task new, else nothing changes. The dedup map outgrows the caches: each lookup
     * waits for memory, so the slots of the lookups a few places ahead are fetched meanwhile. */
    for (i = 0; i < n; i++) {
        size_t slot;
        if (i + PREFETCH < n) {
            __builtin_prefetch(&applied->index[(size_t)tkeys[i + PREFETCH].hash & applied->mask]);
        }
        if (lookup(applied, &tkeys[i], &slot) >= 0) {
            result = Py_NewRef(Py_None); /* a skip or a rewrite */
            goto done;
        }
    }
    if (reserve(applied, n, task_bytes) < 0 || reserve(pending, n, source_bytes) < 0) {
        goto done;
    }
    /* From here no entry moves (reserve made room for all): positions stay valid. */
    Py_ssize_t applied_n = applied->nentries, applied_bytes = applied->arena_used;
    Py_ssize_t pending_n = pending->nentries, pending_bytes = pending->arena_used;
    /* 3. Add the tasks; a task twice in the batch undoes them (the rules then skip the second). */
    for (i = 0; i < n; i++) {
        size_t slot;
        if (i + PREFETCH < n) {
            __builtin_prefetch(&applied->index[(size_t)tkeys[i + PREFETCH].hash & applied->mask]);
        }
        if (lookup(applied, &tkeys[i], &slot) >= 0) {
            truncate_to(applied, applied_n, applied_bytes);
            result = Py_NewRef(Py_None);
            goto done;
        }
        insert_new(applied, &tkeys[i], slot, ints[i]);
    }
    /* 4. The counts. A count leaving int64 (never in practice) undoes the whole call. */
    for (i = 0; i < n; i++) {
        Key k;
        size_t slot;
        Entry *e;
        if (key_of(PyList_GET_ITEM(sources, i), &k) < 0) {
            goto undo;
        }
        Py_ssize_t ix = lookup(pending, &k, &slot);
        /* Not pending and done, or settling at zero: 1, and nothing changes (-1: a lookup failed). */
        int declined = 0;
        if (ix < 0 && done != NULL) {
            declined = PySet_Contains(done, PyList_GET_ITEM(sources, i));
        }
        else if (ix >= 0 && settling != NULL && !E_HAS(&pending->entries[ix], F_BIG) &&
                 pending->entries[ix].v.i == 0) {
            declined = PyDict_Contains(settling, PyList_GET_ITEM(sources, i));
        }
        if (declined != 0) {
            key_release(&k);
            if (declined > 0) {
                result = Py_NewRef(Py_None);
            }
            goto undo;
        }
        if (ix < 0) {
            ix = insert_new(pending, &k, slot, ints[i]);
            e = &pending->entries[ix];
        }
        else {
            e = &pending->entries[ix];
            int64_t sum;
            if (E_HAS(e, F_BIG) || __builtin_add_overflow(e->v.i, ints[i], &sum)) {
                key_release(&k);
                result = Py_NewRef(Py_None);
                goto undo;
            }
            e->v.i = sum;
        }
        key_release(&k);
        if (e->v.i == 0 && !E_HAS(e, F_MARK)) {
            E_SET(e, F_MARK);
            zero_ix[nzeros] = ix;
            zero_pos[nzeros++] = i;
        }
    }
    /* 5. The sources at zero now, in the order they first reached it. */
    result = PyList_New(0);
    for (Py_ssize_t z = 0; z < nzeros; z++) {
        Entry *e = &pending->entries[zero_ix[z]];
        E_CLEAR(e, F_MARK);
        if (result != NULL && e->v.i == 0 && PyList_Append(result, PyList_GET_ITEM(sources, zero_pos[z])) < 0) {
            Py_CLEAR(result);
        }
    }
    goto done;
undo:
    /* Deltas 0 .. i-1 were added (delta i was not). Give them back: the counts of the sources that
     * were there before, then the entries added since (at the end of each map, so the order is as
     * it was). Looking a key up again cannot fail: each was read before. */
    {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        for (Py_ssize_t z = 0; z < nzeros; z++) {
            E_CLEAR(&pending->entries[zero_ix[z]], F_MARK);
        }
        for (i = i - 1; i >= 0; i--) {
            Key k;
            size_t slot;
            if (key_of(PyList_GET_ITEM(sources, i), &k) < 0) {
                PyErr_Clear();
                continue;
            }
            Py_ssize_t ix = lookup(pending, &k, &slot);
            key_release(&k);
            if (ix >= 0 && ix < pending_n) {
                pending->entries[ix].v.i -= ints[i];
            }
        }
        truncate_to(pending, pending_n, pending_bytes);
        truncate_to(applied, applied_n, applied_bytes);
        PyErr_Restore(type, value, traceback);
    }
done:
    for (i = 0; i < nkeys; i++) {
        key_release(&tkeys[i]);
    }
    PyMem_Free(scratch);
    return result;
}

/* ---- plain_batch -------------------------------------------------------------------------- */

/* Whether each of `ids` is an ASCII str of 1 to max_bytes characters; adds their lengths to *text. */
static int
plain_ids(PyObject *ids, Py_ssize_t max_bytes, Py_ssize_t *text)
{
    Py_ssize_t n = PyList_GET_SIZE(ids);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        if (!PyUnicode_Check(id)) {
            return 0;
        }
#if PY_VERSION_HEX < 0x030C0000
        if (PyUnicode_READY(id) < 0) {
            PyErr_Clear();
            return 0;
        }
#endif
        Py_ssize_t len = PyUnicode_GET_LENGTH(id);
        if (!PyUnicode_IS_COMPACT_ASCII(id) || len == 0 || len > max_bytes) {
            return 0;
        }
        *text += len;
    }
    return 1;
}

/* A column's count as the journal stores it (ledger.packed_strs / packed_ints): little-endian uint32. */
static char *
put_count(char *out, Py_ssize_t n)
{
    uint32_t count = (uint32_t)n;
    for (int b = 0; b < 4; b++) {
        *out++ = (char)((count >> (8 * b)) & 0xff);
    }
    return out;
}

/* The column as the journal stores it (ledger.packed_strs): a little-endian uint32 count,
 * a uint32 length per id (in the machine's order, as array("I").tobytes() writes it), then the ids'
 * bytes one after the other. */
static char *
pack_ids(char *out, PyObject *ids)
{
    Py_ssize_t n = PyList_GET_SIZE(ids);
    out = put_count(out, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t len = (uint32_t)PyUnicode_GET_LENGTH(PyList_GET_ITEM(ids, i));
        memcpy(out, &len, 4);
        out += 4;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        Py_ssize_t len = PyUnicode_GET_LENGTH(id);
        memcpy(out, PyUnicode_DATA(id), (size_t)len);
        out += len;
    }
    return out;
}

static PyObject *
plain_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        !PyList_CheckExact(args[2]) || !PyLong_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "plain_batch(tasks: list, sources: list, values: list, max_id_bytes: int)");
        return NULL;
    }
    PyObject *tasks = args[0], *sources = args[1], *values = args[2];
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[3]);
    if (max_bytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(tasks);
    if (PyList_GET_SIZE(sources) != n || PyList_GET_SIZE(values) != n || n > (Py_ssize_t)UINT32_MAX) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        int overflow = 0;
        if (!PyLong_CheckExact(v)) {
            Py_RETURN_NONE;
        }
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (overflow || x <= -(1LL << 62) || x >= (1LL << 62)) {
            Py_RETURN_NONE;
        }
    }
    Py_ssize_t text = 0;
    if (!plain_ids(tasks, max_bytes, &text) || !plain_ids(sources, max_bytes, &text)) {
        Py_RETURN_NONE;
    }
    PyObject *blob = PyBytes_FromStringAndSize(NULL, 12 + 16 * n + text);
    if (blob == NULL) {
        return NULL;
    }
    char *out = pack_ids(pack_ids(PyBytes_AS_STRING(blob), tasks), sources);
    /* The values: a little-endian uint32 count, then int64s in the machine's order (array("q")). */
    out = put_count(out, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t x = (int64_t)PyLong_AsLongLong(PyList_GET_ITEM(values, i)); /* in range: checked */
        memcpy(out, &x, 8);
        out += 8;
    }
    return blob;
}

/* ---- parse_apply_deltas ------------------------------------------------------------------- */

#define MAX_FIELD ((1u << 29) - 1) /* protobuf's largest field number */

/* A varint at *p (before end); 0 when malformed or truncated. */
static int
read_varint(const unsigned char **p, const unsigned char *end, uint64_t *out)
{
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*p >= end) {
            return 0;
        }
        unsigned char byte = *(*p)++;
        if (shift == 63 && byte > 1) {
            return 0;
        }
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 1;
        }
    }
    return 0;
}

/* Past a field of this wire type whose tag was read; 0 when malformed (or a group). */
static int
skip_field(const unsigned char **p, const unsigned char *end, unsigned wire)
{
    uint64_t n;
    switch (wire) {
    case 0:
        return read_varint(p, end, &n);
    case 1:
        if (end - *p < 8) {
            return 0;
        }
        *p += 8;
        return 1;
    case 2:
        if (!read_varint(p, end, &n) || n > (uint64_t)(end - *p)) {
            return 0;
        }
        *p += n;
        return 1;
    case 5:
        if (end - *p < 4) {
            return 0;
        }
        *p += 4;
        return 1;
    default:
        return 0;
    }
}

typedef struct {
    const unsigned char *data;
    Py_ssize_t len;
} Span;

typedef struct {
    Span *ids[2]; /* task ids, source ids */
    Py_ssize_t n[2], cap[2];
    int64_t *values;
    Py_ssize_t nvalues, cap_values;
    Py_ssize_t text; /* bytes of every id */
} Columns;

static int
grow(void **array, Py_ssize_t *cap, size_t item)
{
    Py_ssize_t want = *cap ? *cap * 2 : 1024;
    void *bigger = PyMem_Realloc(*array, (size_t)want * item);
    if (bigger == NULL) {
        return 0;
    }
    *array = bigger;
    *cap = want;
    return 1;
}

static int
add_value(Columns *c, uint64_t zigzag)
{
    int64_t v = (int64_t)(zigzag >> 1) ^ -(int64_t)(zigzag & 1);
    if (v <= -(1LL << 62) || v >= (1LL << 62)) {
        return 0; /* validation names it */
    }
    if (c->nvalues == c->cap_values && !grow((void **)&c->values, &c->cap_values, sizeof(int64_t))) {
        return 0;
    }
    c->values[c->nvalues++] = v;
    return 1;
}

/* DeltaColumns' fields into `c`, if every one is plain (else 0: the caller falls back). */
static int
read_columns(const unsigned char *p, const unsigned char *end, Columns *c, Py_ssize_t max_bytes,
             Py_ssize_t max_deltas)
{
    while (p < end) {
        uint64_t tag, n;
        if (!read_varint(&p, end, &tag) || (tag >> 3) == 0) {
            return 0;
        }
        uint64_t field = tag >> 3;
        unsigned wire = (unsigned)(tag & 7);
        if (field > MAX_FIELD) {
            return 0;
        }
        if (field == 1 || field == 2) {
            int which = (int)field - 1;
            if (wire != 2 || !read_varint(&p, end, &n) || n > (uint64_t)(end - p)) {
                return 0;
            }
            if (n == 0 || n > (uint64_t)max_bytes || c->n[which] >= max_deltas) {
                return 0;
            }
            for (uint64_t i = 0; i < n; i++) {
                if (p[i] & 0x80) {
                    return 0; /* not ASCII: protobuf checks the UTF-8, validation the rest */
                }
            }
            if (c->n[which] == c->cap[which] &&
                !grow((void **)&c->ids[which], &c->cap[which], sizeof(Span))) {
                return 0;
            }
            c->ids[which][c->n[which]++] = (Span){p, (Py_ssize_t)n};
            c->text += (Py_ssize_t)n;
            p += n;
        }
        else if (field == 3 && wire == 2) { /* packed */
            if (!read_varint(&p, end, &n) || n > (uint64_t)(end - p)) {
                return 0;
            }
            const unsigned char *stop = p + n;
            while (p < stop) {
                uint64_t zigzag;
                if (!read_varint(&p, stop, &zigzag) || c->nvalues >= max_deltas || !add_value(c, zigzag)) {
                    return 0;
                }
            }
        }
        else if (field == 3 && wire == 0) {
            uint64_t zigzag;
            if (!read_varint(&p, end, &zigzag) || c->nvalues >= max_deltas || !add_value(c, zigzag)) {
                return 0;
            }
        }
        else if (field <= 3 || !skip_field(&p, end, wire)) {
            return 0;
        }
    }
    return 1;
}

/* How many of the ids made last ids_list remembers (a power of two), when `shared`. */
#define RECENT_IDS 1024

/* The list of str of the ids; with `shared`, an id that came a little earlier in the list (the same
 * bytes in the slot its bytes pick among RECENT_IDS) is the same str object: a batch's deltas
 * come several per source, and each str made costs an allocation and, when first looked up, its
 * SipHash (which the shared object keeps). */
static PyObject *
ids_list(Span *spans, Py_ssize_t n, int shared)
{
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        return NULL;
    }
    Py_ssize_t recent[RECENT_IDS]; /* position in the list of the id last seen in each slot, or -1 */
    if (shared) {
        memset(recent, 0xff, sizeof recent);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *data = spans[i].data;
        Py_ssize_t len = spans[i].len;
        size_t slot = 0;
        if (shared) {
            uint64_t h = 14695981039346656037ull; /* FNV-1a of the id's bytes */
            for (Py_ssize_t b = 0; b < len; b++) {
                h = (h ^ data[b]) * 1099511628211ull;
            }
            slot = (size_t)(h ^ (h >> 32)) & (RECENT_IDS - 1);
            Py_ssize_t j = recent[slot];
            if (j >= 0 && spans[j].len == len && memcmp(spans[j].data, data, (size_t)len) == 0) {
                PyList_SET_ITEM(list, i, Py_NewRef(PyList_GET_ITEM(list, j)));
                continue;
            }
        }
        PyObject *id = PyUnicode_New(len, 127);
        if (id == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        memcpy(PyUnicode_DATA(id), data, (size_t)len);
        PyList_SET_ITEM(list, i, id);
        if (shared) {
            recent[slot] = i;
        }
    }
    return list;
}

static char *
pack_spans(char *out, Span *spans, Py_ssize_t n)
{
    out = put_count(out, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t len = (uint32_t)spans[i].len;
        memcpy(out, &len, 4);
        out += 4;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(out, spans[i].data, (size_t)spans[i].len);
        out += spans[i].len;
    }
    return out;
}

static PyObject *
parse_apply_deltas(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyLong_Check(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "parse_apply_deltas(data: bytes, max_id_bytes: int, max_deltas: int)");
        return NULL;
    }
    Py_ssize_t max_bytes = PyLong_AsSsize_t(args[1]), max_deltas = PyLong_AsSsize_t(args[2]);
    if ((max_bytes == -1 || max_deltas == -1) && PyErr_Occurred()) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    const unsigned char *end = p + PyBytes_GET_SIZE(args[0]);
    const unsigned char *handle = NULL;
    Py_ssize_t handle_len = 0;
    uint64_t batch_seq = 0, ordered = 0;
    const unsigned char *columns = NULL, *columns_end = NULL;
    while (p < end) {
        uint64_t tag, n;
        if (!read_varint(&p, end, &tag) || (tag >> 3) == 0) {
            Py_RETURN_NONE;
        }
        uint64_t field = tag >> 3;
        unsigned wire = (unsigned)(tag & 7);
        if (field > MAX_FIELD) {
            Py_RETURN_NONE; /* not a field number: protobuf refuses it */
        }
        if ((field == 1 || field == 4) && wire == 2) {
            if (!read_varint(&p, end, &n) || n > (uint64_t)(end - p)) {
                Py_RETURN_NONE;
            }
            if (field == 1) { /* the last one counts, as protobuf reads it */
                handle = p;
                handle_len = (Py_ssize_t)n;
            }
            else if (columns != NULL) {
                Py_RETURN_NONE; /* twice: protobuf merges them */
            }
            else {
                columns = p;
                columns_end = p + n;
            }
            p += n;
        }
        else if ((field == 3 || field == 5) && wire == 0) {
            if (!read_varint(&p, end, field == 3 ? &batch_seq : &ordered)) {
                Py_RETURN_NONE;
            }
        }
        else if (field <= 5 || !skip_field(&p, end, wire)) {
            Py_RETURN_NONE; /* the rows (deltas), a known field of another wire type, malformed */
        }
    }
    if (columns == NULL) {
        Py_RETURN_NONE;
    }
    Columns c = {{NULL, NULL}, {0, 0}, {0, 0}, NULL, 0, 0, 0};
    PyObject *result = NULL, *name = NULL, *tasks = NULL, *sources = NULL, *values = NULL, *packed = NULL;
    if (!read_columns(columns, columns_end, &c, max_bytes, max_deltas) || c.n[0] != c.n[1] ||
        c.n[0] != c.nvalues) {
        if (PyErr_Occurred()) {
            goto done;
        }
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t count = c.n[0];
    name = PyUnicode_DecodeUTF8((const char *)(handle ? handle : (const unsigned char *)""), handle_len, NULL);
    if (name == NULL) {
        PyErr_Clear();
        result = Py_NewRef(Py_None); /* protobuf says what is wrong with it */
        goto done;
    }
    tasks = ids_list(c.ids[0], count, 0); /* each task comes once */
    sources = tasks ? ids_list(c.ids[1], count, 1) : NULL;
    values = sources ? PyList_New(count) : NULL;
    if (values == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *v = PyLong_FromLongLong((long long)c.values[i]);
        if (v == NULL) {
            goto done;
        }
        PyList_SET_ITEM(values, i, v);
    }
    packed = PyBytes_FromStringAndSize(NULL, 12 + 16 * count + c.text);
    if (packed == NULL) {
        goto done;
    }
    char *out = pack_spans(pack_spans(PyBytes_AS_STRING(packed), c.ids[0], count), c.ids[1], count);
    out = put_count(out, count);
    memcpy(out, c.values, (size_t)count * sizeof(int64_t));
    result = Py_BuildValue("(OKOOOOO)", name, (unsigned long long)batch_seq, ordered ? Py_True : Py_False,
                           tasks, sources, values, packed);
done:
    Py_XDECREF(name);
    Py_XDECREF(tasks);
    Py_XDECREF(sources);
    Py_XDECREF(values);
    Py_XDECREF(packed);
    PyMem_Free(c.ids[0]);
    PyMem_Free(c.ids[1]);
    PyMem_Free(c.values);
    return result;
}

/* ---- hash_rows, pack_rows: a completion file's keys as rows of words ----------------------------- */

/* The C-contiguous buffers of args[0 .. n - 1], the last one writable; on failure (an exception
 * set) the ones taken are released and -1 is returned. */
static int
take_buffers(PyObject *const *args, Py_buffer *views, int n)
{
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | (i == n - 1 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(args[i], &views[i], flags) < 0) {
            while (i-- > 0) {
                PyBuffer_Release(&views[i]);
            }
            return -1;
        }
    }
    return 0;
}

static void
release_buffers(Py_buffer *views, int n)
{
    for (int i = 0; i < n; i++) {
        PyBuffer_Release(&views[i]);
    }
}

/* hash_rows(words, lengths, out): out[i] = hash(bytes of key i), where key i is the first
 * lengths[i] bytes of row i of words (n rows of the same number of little-endian 64-bit words, as
 * lmdb_pages.pack_words packs the keys of a completion file's pages; a row's bytes in memory are
 * the key's bytes on a little-endian machine). Each buffer must be C-contiguous; lengths and out
 * hold n 8-byte integers. Python's own bytes hash (keyed SipHash, the process's secret) of millions
 * of keys, without the GIL and without a bytes object per key. Returns True, or False (nothing
 * written) on a big-endian machine, where a row is not the key's bytes. */
static PyObject *
hash_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "hash_rows(words, lengths, out) takes 3 arguments");
        return NULL;
    }
#if !PY_LITTLE_ENDIAN
    Py_RETURN_FALSE;
#else
    Py_buffer view[3];
    if (take_buffers(args, view, 3) < 0) {
        return NULL;
    }
    const Py_buffer *words = &view[0], *lengths = &view[1], *out = &view[2];
    PyObject *result = NULL;
    Py_ssize_t n = lengths->len / 8;
    Py_ssize_t row = n > 0 ? words->len / n : 0; /* bytes per row */
    if (lengths->len % 8 != 0 || out->len != lengths->len ||
        (n > 0 && (words->len % n != 0 || row % 8 != 0))) {
        PyErr_Format(PyExc_ValueError,
                     "hash_rows: %zd bytes of words, %zd of lengths and %zd of out do not make n rows of "
                     "words, n lengths and n hashes",
                     words->len, lengths->len, out->len);
        goto done;
    }
    const int64_t *len = (const int64_t *)lengths->buf;
    for (Py_ssize_t i = 0; i < n; i++) { /* every key inside its row: nothing read past it */
        if (len[i] < 0 || len[i] > row) {
            PyErr_Format(PyExc_ValueError, "hash_rows: key %zd of %lld bytes in a row of %zd", i,
                         (long long)len[i], row);
            goto done;
        }
    }
    const char *base = (const char *)words->buf;
    uint64_t *hashes = (uint64_t *)out->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
#if PY_VERSION_HEX >= 0x030E0000
        hashes[i] = (uint64_t)Py_HashBuffer(base + i * row, (Py_ssize_t)len[i]);
#else
        hashes[i] = (uint64_t)_Py_HashBytes(base + i * row, (Py_ssize_t)len[i]);
#endif
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_True);
done:
    release_buffers(view, 3);
    return result;
#endif
}

/* pack_rows(data, offsets, lengths, out): row i of out = the bytes data[offsets[i] : offsets[i] +
 * lengths[i]], zero past them: lmdb_pages.pack_words of a completion file's keys (n rows of
 * little-endian 64-bit words, each wide enough for every key), by one copy per key without the GIL.
 * offsets and lengths hold n 8-byte integers; every key must lie inside data and fit in its row.
 * Returns True, or False (nothing written) on a big-endian machine. */
static PyObject *
pack_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pack_rows(data, offsets, lengths, out) takes 4 arguments");
        return NULL;
    }
#if !PY_LITTLE_ENDIAN
    Py_RETURN_FALSE;
#else
    Py_buffer view[4];
    if (take_buffers(args, view, 4) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_buffer *data = &view[0], *offsets = &view[1], *lengths = &view[2], *out = &view[3];
    Py_ssize_t n = lengths->len / 8;
    Py_ssize_t row = n > 0 ? out->len / n : 0;
    if (lengths->len % 8 != 0 || offsets->len != lengths->len ||
        (n > 0 && (out->len % n != 0 || row % 8 != 0))) {
        PyErr_Format(PyExc_ValueError,
                     "pack_rows: %zd bytes of offsets, %zd of lengths and %zd of out do not make n "
                     "offsets, n lengths and n rows of words",
                     offsets->len, lengths->len, out->len);
        goto done;
    }
    const int64_t *off = (const int64_t *)offsets->buf, *len = (const int64_t *)lengths->buf;
    for (Py_ssize_t i = 0; i < n; i++) { /* nothing read outside data, nothing written past a row */
        if (len[i] < 0 || len[i] > row || off[i] < 0 || off[i] > data->len - len[i]) {
            PyErr_Format(PyExc_ValueError,
                         "pack_rows: key %zd of %lld bytes at %lld, in %zd bytes of data and a row of %zd",
                         i, (long long)len[i], (long long)off[i], data->len, row);
            goto done;
        }
    }
    const char *src = (const char *)data->buf;
    char *dst = (char *)out->buf;
    Py_BEGIN_ALLOW_THREADS
    memset(dst, 0, (size_t)out->len);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(dst + i * row, src + off[i], (size_t)len[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_True);
done:
    release_buffers(view, 4);
    return result;
#endif
}

/* ---- set_absent: a live set's overlay gains the ids it lacks ----------------------------------- */

/* set_absent(d, keys, value): d[key] = value for each key of the list that d lacks, the others left
 * as they are (dict.setdefault of each, in one pass). Returns None when every key was added (the
 * usual case: the caller keeps its list), else the list of those added, in order. */
static PyObject *
set_absent(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "set_absent(d: dict, keys: list, value)");
        return NULL;
    }
    PyObject *d = args[0], *keys = args[1], *value = args[2];
    PyObject *added = NULL; /* made at the first key d had already */
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t before = PyDict_GET_SIZE(d);
        Py_INCREF(key); /* the list may lose it while the dict hashes it */
        PyObject *got = PyDict_SetDefault(d, key, value);
        int fresh = PyDict_GET_SIZE(d) > before;
        if (got == NULL) {
            Py_DECREF(key);
            Py_XDECREF(added);
            return NULL;
        }
        if (added == NULL && !fresh) {
            added = PyList_GetSlice(keys, 0, i); /* every one before it was added */
            if (added == NULL) {
                Py_DECREF(key);
                return NULL;
            }
        }
        else if (added != NULL && fresh && PyList_Append(added, key) < 0) {
            Py_DECREF(key);
            Py_DECREF(added);
            return NULL;
        }
        Py_DECREF(key);
    }
    return added != NULL ? added : Py_NewRef(Py_None);
}

/* ---- sort_entries: a compact index's entries, sorted ------------------------------------------ */

/* Sorts v[0 .. n - 1] ascending by the bits below `shift` (every value of v has the same bits from
 * `shift` up): insertion sort when few, else one pass by the next 8 bits into tmp (room for n) and
 * back, then each part the same way by the bits below those. The entries are hashes, so the parts
 * shrink 256 times a level and rarely need more than one. */
static void
sort_below(uint64_t *v, size_t n, uint64_t *tmp, int shift)
{
    if (n <= 32 || shift <= 0) {
        if (shift <= 0) {
            return; /* every bit the same: equal values */
        }
        for (size_t i = 1; i < n; i++) {
            uint64_t x = v[i];
            size_t j = i;
            while (j > 0 && v[j - 1] > x) {
                v[j] = v[j - 1];
                j--;
            }
            v[j] = x;
        }
        return;
    }
    int digit = shift >= 8 ? shift - 8 : 0;
    uint64_t mask = (((uint64_t)1) << (shift - digit)) - 1;
    size_t count[257] = {0};
    for (size_t i = 0; i < n; i++) {
        count[((v[i] >> digit) & mask) + 1]++;
    }
    for (int b = 0; b < 256; b++) {
        count[b + 1] += count[b];
    }
    size_t at[256];
    memcpy(at, count, sizeof at);
    for (size_t i = 0; i < n; i++) {
        tmp[at[(v[i] >> digit) & mask]++] = v[i];
    }
    memcpy(v, tmp, n * sizeof *v);
    for (int b = 0; b < 256; b++) {
        if (count[b + 1] - count[b] > 1) {
            sort_below(v + count[b], count[b + 1] - count[b], tmp, digit);
        }
    }
}

/* sort_entries(parts, prefix, out): out = sorted((h & prefix) | i for i, part in enumerate(parts) for
 * h in part), each part a C-contiguous buffer of uint64 and out one of their total length: a compact
 * index's entries (domain/compact.py), made in one pass that scatters them by their top bits into
 * out (a radix sort's first pass), then each bucket sorted in the cache. No copy of the entries is
 * allocated (a bucket's room only), and the GIL is released throughout. Returns True. */
static PyObject *
sort_entries(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sort_entries(parts, prefix, out) takes 3 arguments");
        return NULL;
    }
    PyObject *parts = PySequence_Fast(args[0], "sort_entries: parts must be a sequence of buffers");
    if (parts == NULL) {
        return NULL;
    }
    uint64_t prefix = PyLong_AsUnsignedLongLong(args[1]);
    if (prefix == (uint64_t)-1 && PyErr_Occurred()) {
        Py_DECREF(parts);
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(parts);
    Py_buffer *views = PyMem_Calloc((size_t)k + 1, sizeof(Py_buffer));
    size_t *counts = NULL;
    uint64_t *tmp = NULL;
    PyObject *result = NULL;
    Py_ssize_t taken = 0;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (; taken < k; taken++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts, taken), &views[taken], PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        if (views[taken].len % 8 != 0) {
            PyErr_Format(PyExc_ValueError, "sort_entries: part %zd holds %zd bytes, not a whole number of uint64",
                         taken, views[taken].len);
            taken++;
            goto done;
        }
        total += views[taken].len / 8;
    }
    if (PyObject_GetBuffer(args[2], &views[k], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        goto done;
    }
    taken++;
    if (views[k].len != total * 8) {
        PyErr_Format(PyExc_ValueError, "sort_entries: out holds %zd bytes for %zd entries", views[k].len, total);
        goto done;
    }
    /* Buckets of a few thousand entries on average: 32 KiB, sorted in the CPU's cache. */
    int top = 0;
    while (top < 16 && ((size_t)total >> (top + 11)) > 0) {
        top++;
    }
    size_t buckets = (size_t)1 << top;
    int shift = 64 - top;
    counts = PyMem_Calloc(buckets + 1, sizeof *counts);
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *out = (uint64_t *)views[k].buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        const uint64_t *h = (const uint64_t *)views[i].buf;
        size_t n = (size_t)views[i].len / 8;
        for (size_t j = 0; j < n; j++) {
            counts[top ? ((h[j] & prefix) >> shift) + 1 : 1]++;
        }
    }
    size_t largest = 0;
    for (size_t b = 0; b < buckets; b++) {
        largest = counts[b + 1] > largest ? counts[b + 1] : largest;
        counts[b + 1] += counts[b];
    }
    tmp = malloc((largest ? largest : 1) * sizeof *tmp);
    if (tmp == NULL) {
        failed = 1;
    } else {
        size_t *at = counts; /* counts[b]: where bucket b's next entry goes, then its end */
        for (Py_ssize_t i = 0; i < k; i++) {
            const uint64_t *h = (const uint64_t *)views[i].buf;
            size_t n = (size_t)views[i].len / 8;
            uint64_t tag = (uint64_t)i;
            for (size_t j = 0; j < n; j++) {
                uint64_t e = (h[j] & prefix) | tag;
                out[at[top ? e >> shift : 0]++] = e;
            }
        }
        size_t start = 0; /* now counts[b] is bucket b's end */
        for (size_t b = 0; b < buckets; b++) {
            if (counts[b] - start > 1) {
                sort_below(out + start, counts[b] - start, tmp, shift);
            }
            start = counts[b];
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_True);
done:
    free(tmp);
    PyMem_Free(counts);
    if (views != NULL) {
        release_buffers(views, (int)taken);
        PyMem_Free(views);
    }
    Py_DECREF(parts);
    return result;
}

/* ---- the types ----------------------------------------------------------------------------- */

static PyMappingMethods IdMap_as_mapping = {
    .mp_length = (lenfunc)IdMap_len,
    .mp_subscript = (binaryfunc)IdMap_getitem,
    .mp_ass_subscript = (objobjargproc)IdMap_ass_subscript,
};

static PySequenceMethods IdMap_as_sequence = {
    .sq_contains = (objobjproc)IdMap_contains,
};

static PyMethodDef IdMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))IdMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"update", (PyCFunction)IdMap_update, METH_O, "Set every (key, value) of a mapping or of pairs."},
    {"clear", (PyCFunction)IdMap_clear, METH_NOARGS, "Remove every key."},
    {"items", (PyCFunction)IdMap_items, METH_NOARGS, "A list of the (key, value) pairs, in order."},
    {"values", (PyCFunction)IdMap_values, METH_NOARGS, "A list of the values, in order."},
    {"take_zeros", (PyCFunction)IdMap_take_zeros, METH_O,
     "Delete these keys if each is here once at 0 (returns True); else change nothing (False)."},
    {"__sizeof__", (PyCFunction)IdMap_sizeof, METH_NOARGS, "Bytes held, the keys' included."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IdMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tally_server._ledgercore.IdMap",
    .tp_doc = "An insertion-ordered map of str ids to ints, each id kept as its UTF-8 bytes.",
    .tp_basicsize = sizeof(IdMap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = IdMap_new,
    .tp_init = (initproc)IdMap_init,
    .tp_dealloc = (destructor)IdMap_dealloc,
    .tp_as_mapping = &IdMap_as_mapping,
    .tp_as_sequence = &IdMap_as_sequence,
    .tp_iter = (getiterfunc)IdMap_iter,
    .tp_methods = IdMap_methods,
};

static PyMethodDef module_methods[] = {
    {"apply_new", (PyCFunction)(void (*)(void))apply_new, METH_FASTCALL,
     "apply_new(applied, pending, tasks, sources, values, done=None, settling=None): the batch if every "
     "task is new and none comes twice, no source not pending is in the set done and no delta comes for "
     "a source of the dict settling at zero (returns the sources at zero, in order); else None, nothing "
     "changed."},
    {"plain_batch", (PyCFunction)(void (*)(void))plain_batch, METH_FASTCALL,
     "plain_batch(tasks, sources, values, max_id_bytes): if every id is ASCII of 1 to max_id_bytes "
     "characters and every value an int within +-2**62 (exclusive), the three columns as the "
     "journal stores them; else None."},
    {"parse_apply_deltas", (PyCFunction)(void (*)(void))parse_apply_deltas, METH_FASTCALL,
     "parse_apply_deltas(data, max_id_bytes, max_deltas): an ApplyDeltasRequest's bytes holding a plain "
     "batch as columns (every id ASCII of 1 to max_id_bytes bytes, every delta within +-2**62, at most "
     "max_deltas): (handle, batch_seq, ordered, task_ids, source_ids, deltas, packed); anything else "
     "(the rows, unknown groups, a malformed or refused field): None, for protobuf and validation."},
    {"pack_rows", (PyCFunction)(void (*)(void))pack_rows, METH_FASTCALL,
     "pack_rows(data, offsets, lengths, out): row i of out = data[offsets[i] : offsets[i] + lengths[i]], "
     "zero past it (lmdb_pages.pack_words); True, or False on a big-endian machine."},
    {"hash_rows", (PyCFunction)(void (*)(void))hash_rows, METH_FASTCALL,
     "hash_rows(words, lengths, out): out[i] = hash() of the first lengths[i] bytes of row i of words "
     "(keys packed as rows of little-endian words); True, or False on a big-endian machine."},
    {"set_absent", (PyCFunction)(void (*)(void))set_absent, METH_FASTCALL,
     "set_absent(d, keys, value): d.setdefault(key, value) for each key of the list; None if every key "
     "was added, else the list of those added, in order."},
    {"sort_entries", (PyCFunction)(void (*)(void))sort_entries, METH_FASTCALL,
     "sort_entries(parts, prefix, out): out = sorted((h & prefix) | i for i, part in enumerate(parts) "
     "for h in part), parts buffers of uint64 and out one of their total length; True."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tally_server._ledgercore",
    .m_doc = "The counting rules' tables in compiled code (see tally_server.domain.idmap).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__ledgercore(void)
{
    if (PyType_Ready(&IdMapType) < 0 || PyType_Ready(&IdMapIterType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "IdMap", (PyObject *)&IdMapType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
