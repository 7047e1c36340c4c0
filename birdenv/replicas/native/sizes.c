/* A result's size, in C: every batch a session fetches is counted against its byte cap here.
 *
 * birdenv.replicas.session holds the rule (_row_bytes, summed by _rows_bytes) and uses this
 * function when it is built; tests/test_tools.py checks that both count the same for any rows
 * SQLite can return and for others, and raise the same errors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* batch_bytes(rows): birdenv.replicas.session._row_bytes summed over rows: per row, each value's
 * operator.length_hint(value, 8) plus 8. SQLite's types first: the length of an exact str or
 * bytes, 8 for an exact int, float or None (none of which has a length or a length hint, which
 * Python only finds out by looking both up); PyObject_LengthHint, what length_hint runs, for the
 * rest. */
static PyObject *batch_bytes(PyObject *module, PyObject *rows)
{
    PyObject *outer = PySequence_Fast(rows, "batch_bytes() takes a sequence of rows");
    if (outer == NULL)
        return NULL;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(outer); i++) {
        PyObject *row = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, i), "a row is a sequence");
        if (row == NULL)
            goto fail;
        total += 8;
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(row); j++) {
            PyObject *value = PySequence_Fast_GET_ITEM(row, j);
            Py_ssize_t size;
            if (PyUnicode_CheckExact(value))
                size = PyUnicode_GET_LENGTH(value);
            else if (PyBytes_CheckExact(value))
                size = PyBytes_GET_SIZE(value);
            else if (value == Py_None || PyLong_CheckExact(value) || PyFloat_CheckExact(value))
                size = 8;
            else if ((size = PyObject_LengthHint(value, 8)) < 0) {
                Py_DECREF(row);
                goto fail;
            }
            total += size;
        }
        Py_DECREF(row);
    }
    Py_DECREF(outer);
    return PyLong_FromSsize_t(total);
fail:
    Py_DECREF(outer);
    return NULL;
}

static PyMethodDef methods[] = {
    {"batch_bytes", batch_bytes, METH_O,
     "batch_bytes(rows): about how many bytes the rows hold, as birdenv.replicas.session counts "
     "them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "birdenv.replicas.native._sizes",
    "A result's size in C (the rule is birdenv.replicas.session's)", -1, methods,
};

PyMODINIT_FUNC PyInit__sizes(void)
{
    return PyModule_Create(&module);
}
