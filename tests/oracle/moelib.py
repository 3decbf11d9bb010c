"""ctypes binding of libmoe's generic entry point (moe_run_host), for the
independent oracles. Arrays travel in their storage type: bf16/fp16 as
uint16, narrow formats as uint8 (fp4 packed two per byte), with the moe dtype
named beside them."""
import ctypes as C
import glob
import os

import numpy as np

DTYPES = ["invalid", "fp32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2",
          "int8", "uint8", "int32", "e8m0", "fp4_e2m1"]
STORAGE = {"fp32": np.float32, "fp16": np.uint16, "bf16": np.uint16, "fp8_e4m3fn": np.uint8,
           "fp8_e4m3fnuz": np.uint8, "fp8_e5m2": np.uint8, "int8": np.int8, "uint8": np.uint8,
           "int32": np.int32, "e8m0": np.uint8, "fp4_e2m1": np.uint8}
MAX_DIMS = 8
PARAM_STRING, PARAM_BOOL, PARAM_INT, PARAM_DOUBLE = 0, 1, 2, 3


class Tensor(C.Structure):
    _fields_ = [("dtype", C.c_int), ("ndim", C.c_int32), ("shape", C.c_int64 * MAX_DIMS),
                ("data", C.c_void_p), ("nbytes", C.c_size_t)]


class NamedTensor(C.Structure):
    _fields_ = [("name", C.c_char_p), ("tensor", Tensor)]


class Param(C.Structure):
    _fields_ = [("name", C.c_char_p), ("type", C.c_int), ("s", C.c_char_p), ("b", C.c_bool),
                ("i", C.c_int64), ("d", C.c_double)]


class Params(C.Structure):
    _fields_ = [("items", C.POINTER(Param)), ("count", C.c_size_t)]


class Error(C.Structure):
    _fields_ = [("msg", C.c_char * 512)]


class MoeError(Exception):
    def __init__(self, status, msg):
        super().__init__(f"status {status}: {msg}")
        self.status = status
        self.msg = msg


_lib = None


def default_lib_path():
    """$MOE_LIB, else the newest build*/kernels/libmoe.so of this checkout."""
    if "MOE_LIB" in os.environ:
        return os.environ["MOE_LIB"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cands = sorted(glob.glob(os.path.join(root, "build*", "kernels", "libmoe.so")), key=os.path.getmtime)
    return cands[-1] if cands else "libmoe.so"


def lib():
    global _lib
    if _lib is None:
        _lib = C.CDLL(default_lib_path())
        _lib.moe_run_host.restype = C.c_int
        _lib.moe_run_host.argtypes = [C.c_char_p, C.POINTER(NamedTensor), C.c_size_t, C.POINTER(Params),
                                      C.c_void_p, C.POINTER(C.POINTER(NamedTensor)),
                                      C.POINTER(C.c_size_t), C.POINTER(Error)]
        _lib.moe_outputs_free.argtypes = [C.POINTER(NamedTensor), C.c_size_t]
    return _lib


def _tensor(arr, dtype, shape=None):
    """A moe_tensor over a C-contiguous numpy array (kept alive by caller).
    `shape` overrides the logical shape (fp4: elements, not bytes)."""
    t = Tensor()
    t.dtype = DTYPES.index(dtype)
    shp = arr.shape if shape is None else shape
    t.ndim = len(shp)
    for i, s in enumerate(shp):
        t.shape[i] = int(s)
    t.data = arr.ctypes.data if arr.size else None
    t.nbytes = arr.nbytes
    return t


def _params(params):
    items = (Param * max(1, len(params)))()
    keep = []
    for i, (k, v) in enumerate(params.items()):
        p = items[i]
        kb = k.encode()
        keep.append(kb)
        p.name = kb
        if isinstance(v, bool):
            p.type, p.b = PARAM_BOOL, v
        elif isinstance(v, int):
            p.type, p.i = PARAM_INT, v
        elif isinstance(v, float):
            p.type, p.d = PARAM_DOUBLE, v
        else:
            sb = str(v).encode()
            keep.append(sb)
            p.type, p.s = PARAM_STRING, sb
    return Params(items, len(params)), keep, items


def run(op, inputs, params=None, expert_set=None):
    """inputs: {name: (array, dtype_name) or (array, dtype_name, logical_shape)}.
    Returns {name: (array in storage type with the logical shape's storage form, dtype_name)}.
    Raises MoeError on a non-zero status."""
    L = lib()
    arrs = []
    named = (NamedTensor * max(1, len(inputs)))()
    names = []
    for i, (name, spec) in enumerate(inputs.items()):
        arr = np.ascontiguousarray(spec[0])
        arrs.append(arr)
        nb = name.encode()
        names.append(nb)
        named[i].name = nb
        named[i].tensor = _tensor(arr, spec[1], spec[2] if len(spec) > 2 else None)
    prm, keep, items = _params(params or {})
    outs = C.POINTER(NamedTensor)()
    n = C.c_size_t()
    err = Error()
    st = L.moe_run_host(op.encode(), named, len(inputs), C.byref(prm), expert_set, C.byref(outs),
                        C.byref(n), C.byref(err))
    if st != 0:
        raise MoeError(st, err.msg.decode(errors="replace"))
    res = {}
    try:
        for i in range(n.value):
            o = outs[i]
            dt = DTYPES[o.tensor.dtype]
            shape = [o.tensor.shape[d] for d in range(o.tensor.ndim)]
            if dt == "fp4_e2m1":
                shape[-1] //= 2
            buf = (C.c_char * o.tensor.nbytes).from_address(o.tensor.data) if o.tensor.nbytes else b""
            a = np.frombuffer(bytes(buf), dtype=STORAGE[dt]).reshape(shape).copy()
            res[o.name.decode()] = (a, dt)
    finally:
        L.moe_outputs_free(outs, n.value)
    return res


class ExpertSet:
    """A loaded expert set (directory with config.json + safetensors)."""

    def __init__(self, path, name="set"):
        L = lib()
        L.moe_expert_set_load.restype = C.c_int
        L.moe_expert_set_load.argtypes = [C.c_char_p, C.c_char_p, C.POINTER(C.c_void_p), C.POINTER(Error)]
        L.moe_expert_set_destroy.argtypes = [C.c_void_p]
        self.ptr = C.c_void_p()
        err = Error()
        st = L.moe_expert_set_load(str(path).encode(), name.encode(), C.byref(self.ptr), C.byref(err))
        if st != 0:
            raise MoeError(st, err.msg.decode(errors="replace"))

    def close(self):
        if self.ptr:
            lib().moe_expert_set_destroy(self.ptr)
            self.ptr = C.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
