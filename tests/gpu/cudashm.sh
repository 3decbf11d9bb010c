#!/usr/bin/env bash
# CUDA shared memory end to end on a GPU machine: device buffers of this
# script's process (cudaMalloc through ctypes on libcudart: torch's, or any
# the loader finds) exported as CUDA IPC handles, registered with a moed on
# the GPU (--device gpu), and quant and fused_moe requests whose inputs are
# read from them and whose outputs are written into them. Every output must
# be bit-identical to the same request sent with raw contents; bounds and
# registration errors must get their status naming the field; unregistering
# must leave the server serving. No tritonclient, no protobuf package: the
# few messages are encoded by hand (grpcio only), as tests/gpu/moed_reload.sh does.
#   tests/gpu/cudashm.sh BINDIR LOGDIR
# BINDIR: moed and moe-mkset, or tests/gpu/pack.sh's output (bin.tar.xz,
# unpacked here, and lib/: on the library path of those two only, not of
# this script's Python).
# MOE_CUDASHM_DRY=1: a dry run without a GPU (moed --device cpu, POSIX
# regions through the system extension in place of the device buffers): the
# same requests, offsets, comparisons and errors, to check the script itself.
# Prints ok/FAIL lines (also LOGDIR/cudashm.txt); exits nonzero on a FAIL.
set -euo pipefail
bin=$(cd "$1" && pwd); log=$2
mkdir -p "$log"
log=$(cd "$log" && pwd)
work=$(mktemp -d)
pid=""
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
libs=${LD_LIBRARY_PATH:-}
[ -d "$bin/lib" ] && libs=$bin/lib${libs:+:$libs}
if [ -f "$bin/bin.tar.xz" ]; then
  mkdir "$work/bin"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$bin/bin.tar.xz" "$work/bin"
  chmod +x "$work/bin"/*
  bin=$work/bin
fi
for b in moed moe-mkset; do
  [ -x "$bin/$b" ] || { echo "cudashm.sh: $bin/$b missing (tests/gpu/pack.sh packs it)" >&2; exit 2; }
done

LD_LIBRARY_PATH=$libs "$bin/moe-mkset" --out "$work/models/mix_bf16" --scheme bf16 --experts 8 --hidden 1024 --intermediate 512 \
  --top-k 2 --seed 4 >/dev/null
LD_LIBRARY_PATH=$libs "$bin/moe-mkset" --out "$work/models/qwen_int4" --scheme wna16 --bits 4 --group-size 128 --experts 128 \
  --hidden 2048 --intermediate 768 --top-k 8 --seed 3 >/dev/null
device=gpu
[ "${MOE_CUDASHM_DRY:-0}" = 1 ] && device=cpu
LD_LIBRARY_PATH=$libs "$bin/moed" --device "$device" --model-repository "$work/models" --address 127.0.0.1 --grpc-port 0 \
  --http-port -1 --rest-port 0 --port-file "$work/port" >"$log/moed-cudashm.log" 2>&1 &
pid=$!
for _ in $(seq 200); do [ -s "$work/port" ] && break; sleep 0.1; done
if [ ! -s "$work/port" ]; then echo "FAIL moed did not start"; tail -20 "$log/moed-cudashm.log"; exit 1; fi

rc=0
python3 - "$work/port" "$pid" <<'PY' | tee "$log/cudashm.txt" || rc=1
import base64, ctypes, glob, importlib.util, json, mmap, os, struct, sys, time, urllib.error, urllib.request
import grpc
import numpy as np

DRY = os.environ.get("MOE_CUDASHM_DRY", "0") == "1"
ports = open(sys.argv[1]).read().split()
gport, rport = ports[0], ports[2]
moed_pid = int(sys.argv[2])
chan = grpc.insecure_channel(f"127.0.0.1:{gport}", options=[("grpc.max_receive_message_length", 1 << 30),
                                                           ("grpc.max_send_message_length", 1 << 30)])
bad = 0
npass = 0


def report(ok, what):
    global bad, npass
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    bad += not ok
    npass += bool(ok)


# ---- protobuf by hand (proto/grpc_service.proto's field numbers) ----------------------------------------
def varint(n):
    n &= (1 << 64) - 1  # negative int64: two's complement, ten bytes
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def f_len(field, data):
    if isinstance(data, str):
        data = data.encode()
    return varint(field << 3 | 2) + varint(len(data)) + data


def f_int(field, n):
    return varint(field << 3 | 0) + varint(n)


def param(key, value):  # a map<string, InferParameter> entry
    if isinstance(value, bool):
        v = f_int(1, int(value))
    elif isinstance(value, int):
        v = f_int(2, value)
    else:
        v = f_len(3, str(value))
    return f_len(1, key) + f_len(2, v)


def parse(buf):
    """{field: [values]}: ints for varints, bytes for length-delimited."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i)
            v, i = bytes(buf[i:i + n]), i + n
        elif wt == 1:
            v, i = bytes(buf[i:i + 8]), i + 8
        elif wt == 5:
            v, i = bytes(buf[i:i + 4]), i + 4
        else:
            raise ValueError(f"wire type {wt}")
        out.setdefault(field, []).append(v)
    return out


def read_varint(buf, i):
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def packed_ints(vals):
    out = []
    for v in vals:
        if isinstance(v, int):
            out.append(v)
        else:
            i = 0
            while i < len(v):
                n, i = read_varint(v, i)
                out.append(n)
    return out


def call(method, body, timeout=120):
    return chan.unary_unary(f"/inference.GRPCInferenceService/{method}")(body, timeout=timeout)


def status_of(fn):
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def expect(fn, code, words, what):
    got, msg = status_of(fn)
    report(got == code and all(w in msg for w in words), f"{what}: {code.name} naming {words} ({got.name}: {msg})")


# ---- requests ---------------------------------------------------------------------------------------------
class Tensor:
    def __init__(self, name, dtype, arr):
        self.name, self.dtype, self.arr = name, dtype, np.ascontiguousarray(arr)


def infer_body(model, inputs, params, in_shm=None, outs=None):
    """ModelInferRequest. in_shm: {input name: (region, offset)} (else raw
    contents); outs: [(output name, region, offset, byte_size)] (None: no
    outputs named, every one comes back raw)."""
    b = f_len(1, model)
    for k, v in params.items():
        b += f_len(4, param(k, v))
    raws = []
    for t in inputs:
        m = f_len(1, t.name) + f_len(2, t.dtype) + f_len(3, b"".join(varint(d) for d in t.arr.shape))
        if in_shm and t.name in in_shm:
            region, off = in_shm[t.name]
            m += f_len(4, param("shared_memory_region", region)) + f_len(4, param("shared_memory_offset", off))
            m += f_len(4, param("shared_memory_byte_size", t.arr.nbytes))
        else:
            raws.append(t.arr.tobytes())
        b += f_len(5, m)
    for name, region, off, size in outs or []:
        m = f_len(1, name) + f_len(2, param("shared_memory_region", region))
        m += f_len(2, param("shared_memory_offset", off)) + f_len(2, param("shared_memory_byte_size", size))
        b += f_len(6, m)
    for r in raws:
        b += f_len(7, r)
    return b


def infer(model, inputs, params, in_shm=None, outs=None):
    """[(name, datatype, shape, raw bytes or b"")] of the response."""
    r = parse(call("ModelInfer", infer_body(model, inputs, params, in_shm, outs)))
    raw = r.get(6, [])
    res = []
    for k, o in enumerate(r.get(5, [])):
        t = parse(o)
        res.append((t[1][0].decode(), t[2][0].decode(), packed_ints(t.get(3, [])), raw[k] if k < len(raw) else b""))
    return res


# ---- regions: device buffers (CUDA IPC) or, dry, POSIX objects ----------------------------------------------
def load_cudart():
    cands = []
    for mod in ("torch", "nvidia"):
        spec = importlib.util.find_spec(mod)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cands += sorted(glob.glob(f"{loc}/lib/libcudart*.so*")) + sorted(glob.glob(f"{loc}/**/libcudart.so*",
                                                                                    recursive=True))
    cands += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    cands += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    for c in cands:
        try:
            lib = ctypes.CDLL(c)
            print(f"     libcudart: {c}", flush=True)
            return lib
        except OSError:
            continue
    try:  # last: the one torch loads, wherever it is
        import torch
        torch.cuda.init()
        for line in open("/proc/self/maps"):
            if "libcudart" in line and line.split()[-1].startswith("/"):
                print(f"     libcudart (torch's): {line.split()[-1]}", flush=True)
                return ctypes.CDLL(line.split()[-1])
    except Exception as e:
        print(f"     torch: {e}", flush=True)
    raise SystemExit("FAIL no libcudart found (torch/lib, nvidia/*/lib, the loader's path, /usr/local/cuda)")


def align(n, a=256):
    return (n + a - 1) // a * a


class CudaRegion:
    KIND = "Cuda"

    def __init__(self, rt, name, size):
        self.rt, self.name, self.size = rt, name, size
        self.ptr = ctypes.c_void_p()
        self.check(rt.cudaMalloc(ctypes.byref(self.ptr), ctypes.c_size_t(size)), "cudaMalloc")
        h = (ctypes.c_ubyte * 64)()
        self.check(rt.cudaIpcGetMemHandle(h, self.ptr), "cudaIpcGetMemHandle")
        self.handle = bytes(h)

    def check(self, e, what):
        if e != 0:
            raise SystemExit(f"FAIL {what}: cudaError {e}")

    def register_body(self, name=None, handle=None, device=0, size=None):
        return (f_len(1, name or self.name) + f_len(2, self.handle if handle is None else handle) + f_int(3, device)
                + f_int(4, self.size if size is None else size))

    def write(self, off, data):
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        self.check(self.rt.cudaMemcpy(ctypes.c_void_p(self.ptr.value + off), buf, ctypes.c_size_t(len(data)), 1),
                   "cudaMemcpy H2D")
        self.check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def fill(self, byte):
        self.check(self.rt.cudaMemset(self.ptr, byte, ctypes.c_size_t(self.size)), "cudaMemset")
        self.check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def read(self, off, n):
        buf = ctypes.create_string_buffer(n)
        self.check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        self.check(self.rt.cudaMemcpy(buf, ctypes.c_void_p(self.ptr.value + off), ctypes.c_size_t(n), 2),
                   "cudaMemcpy D2H")
        return buf.raw

    def close(self):
        self.rt.cudaFree(self.ptr)


class SysRegion:  # the dry run's stand-in: a POSIX object through the system extension
    KIND = "System"

    def __init__(self, rt, name, size):
        self.name, self.size = name, size
        self.key = f"/moed_cudashm_dry_{os.getpid()}_{name}"
        fd = os.open("/dev/shm" + self.key, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        self.m = mmap.mmap(fd, size)
        os.close(fd)
        self.handle = b"\0" * 64

    def register_body(self, name=None, handle=None, device=0, size=None):
        return f_len(1, name or self.name) + f_len(2, self.key) + f_int(3, 0) + f_int(4, self.size if size is None
                                                                                       else size)

    def write(self, off, data):
        self.m[off:off + len(data)] = bytes(data)

    def fill(self, byte):
        self.m[:] = bytes([byte]) * self.size

    def read(self, off, n):
        return bytes(self.m[off:off + n])

    def close(self):
        self.m.close()
        os.unlink("/dev/shm" + self.key)


Region = SysRegion if DRY else CudaRegion
K = Region.KIND
rt = None
if not DRY:
    rt = load_cudart()
    n = ctypes.c_int(0)
    report(rt.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0, f"this process sees {n.value} GPU(s)")
    rt.cudaSetDevice(0)


def register(r, **kw):
    call(f"{K}SharedMemoryRegister", r.register_body(**kw))


def status(name=""):
    """{name: (device_id or key, byte_size)}"""
    res = parse(call(f"{K}SharedMemoryStatus", f_len(1, name) if name else b""))
    out = {}
    for e in res.get(1, []):
        v = parse(parse(e)[2][0])  # proto3 leaves zeros out: device_id 0 is absent
        nm = v[1][0].decode()
        out[nm] = ((v.get(2, [0])[0], v.get(3, [0])[0]) if K == "Cuda" else (v[2][0].decode(), v.get(4, [0])[0]))
    return out


def unregister(name=""):
    call(f"{K}SharedMemoryUnregister", f_len(1, name) if name else b"")


# ---- the server up, its models loaded -----------------------------------------------------------------------
rng = np.random.default_rng(11)


def bf16(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


mix = [Tensor("hidden_states", "BF16", bf16(rng.standard_normal((17, 1024)))),
       Tensor("router_logits", "FP32", rng.standard_normal((17, 8)).astype(np.float32))]
qwen = [Tensor("hidden_states", "BF16", bf16(rng.standard_normal((33, 2048)))),
        Tensor("router_logits", "FP32", rng.standard_normal((33, 128)).astype(np.float32))]
for model, ins in (("mix_bf16", mix), ("qwen_int4", qwen)):
    for attempt in range(1200):  # the repository loads after the port opens
        code, msg = status_of(lambda: infer(model, ins, {}))
        if code == grpc.StatusCode.OK:
            break
        time.sleep(0.1)
    report(code == grpc.StatusCode.OK, f"moed serves {model} ({code.name} {msg})")
md = parse(call("ServerMetadata", b""))
ext = [e.decode() for e in md.get(3, [])]
if not DRY:
    report("cuda_shared_memory" in ext, f"ServerMetadata lists cuda_shared_memory ({ext})")

MIB = 1 << 20
cin, cout = Region(rt, "cin", 16 * MIB), Region(rt, "cout", 16 * MIB)
try:
    register(cin)
    register(cout)
    st = status()
    want = {"cin": (0, 16 * MIB), "cout": (0, 16 * MIB)} if K == "Cuda" else {
        "cin": (cin.key, 16 * MIB), "cout": (cout.key, 16 * MIB)}
    report(st == want, f"status lists both regions with device_id and byte_size ({st})")
    report(status("cout") == {"cout": want["cout"]}, "status of one region")

    cases = [
        ("quant.per_token bf16 [64, 7168] (copied on the worker)", "quant.per_token",
         [Tensor("x", "BF16", bf16(rng.standard_normal((64, 7168)) * 3))], {"out_dtype": "fp8_e4m3fn"}),
        ("quant.per_token fp32 [4, 256] (copied while decoding)", "quant.per_token",
         [Tensor("x", "FP32", rng.standard_normal((4, 256)).astype(np.float32))], {"out_dtype": "int8"}),
        ("quant.mx bf16 [64, 7168]", "quant.mx", [Tensor("x", "BF16", bf16(rng.standard_normal((64, 7168))))],
         {"format": "mxfp4"}),
        ("fused_moe mix_bf16 T=17", "mix_bf16", mix, {}),
        ("fused_moe mix_bf16 T=512", "mix_bf16",
         [Tensor("hidden_states", "BF16", bf16(rng.standard_normal((512, 1024)))),
          Tensor("router_logits", "FP32", rng.standard_normal((512, 8)).astype(np.float32))], {}),
        ("fused_moe qwen_int4 T=33", "qwen_int4", qwen, {}),
    ]
    for what, model, ins, params in cases:
        try:
            ref = infer(model, ins, params)
            # inputs at 256-aligned offsets past a first gap (the offset honoured), outputs likewise
            cin.fill(0x5A)
            cout.fill(0xA5)
            in_shm, off = {}, 4096
            for t in ins:
                cin.write(off, t.arr.tobytes())
                in_shm[t.name] = ("cin", off)
                off = align(off + t.arr.nbytes)
            outs, off = [], 8192
            for name, _, _, raw in ref:
                outs.append((name, "cout", off, len(raw)))
                off = align(off + len(raw))
            got = infer(model, ins, params, in_shm=in_shm, outs=outs)
            meta_ok = [(n, d, s) for n, d, s, _ in got] == [(n, d, s) for n, d, s, _ in ref]
            same = all(cout.read(o, size) == raw for (_, _, o, size), (_, _, _, raw) in zip(outs, ref))
            empty = all(len(raw) == 0 for *_, raw in got)
            report(meta_ok and same and empty and len(ref) > 0,
                   f"{what}: inputs and {len(ref)} outputs in {K} shm bit-identical to raw contents"
                   f" (metadata {'same' if meta_ok else 'differs'}, bytes {'same' if same else 'DIFFER'},"
                   f" response {'carries no bytes' if empty else 'carries bytes'})")
            # inputs from shm, outputs raw in the response
            got = infer(model, ins, params, in_shm=in_shm)
            report([g[3] for g in got] == [r[3] for r in ref], f"{what}: inputs in {K} shm, outputs raw: bit-identical")
            # inputs raw, outputs into shm
            cout.fill(0xA5)
            got = infer(model, ins, params, outs=outs)
            same = all(cout.read(o, size) == raw for (_, _, o, size), (_, _, _, raw) in zip(outs, ref))
            report(same, f"{what}: inputs raw, outputs into {K} shm: bit-identical")
        except grpc.RpcError as e:  # one case's failure is reported, the others still run
            report(False, f"{what}: {e.code().name}: {e.details()}")

    # bounds, on every use
    x = Tensor("x", "FP32", rng.standard_normal((4, 256)).astype(np.float32))
    C = grpc.StatusCode
    expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, in_shm={"x": ("cin", 16 * MIB - 4096 + 64)}),
           C.INVALID_ARGUMENT, ["inputs[0] 'x'", "past the end"], "an input whose offset + size runs past the region")
    expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, in_shm={"x": ("cin", 2 ** 63 - 8)}),
           C.INVALID_ARGUMENT, ["inputs[0] 'x'", "past the end"], "an input offset near 2^63 (no wrap)")
    expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, outs=[("q", "cout", 16 * MIB - 512, 1024)]),
           C.INVALID_ARGUMENT, ["outputs[0] 'q'", "past the end"], "an output whose offset + size runs past the region")
    expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, outs=[("q", "cout", 0, 100)]),
           C.INVALID_ARGUMENT, ["outputs[0] 'q'", "shared_memory_byte_size"], "an output region smaller than the output")
    expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, in_shm={"x": ("nope", 0)}),
           C.NOT_FOUND, ["inputs[0] 'x'", "nope"], "an input naming no registered region")

    # registration errors, each naming its field
    expect(lambda: register(cin), C.ALREADY_EXISTS, ["name", "cin"], "register a name twice")
    if K == "Cuda":
        expect(lambda: register(cin, name="c2", handle=cin.handle[:63]), C.INVALID_ARGUMENT, ["raw_handle", "63"],
               "register a 63-byte handle")
        expect(lambda: register(cin, name="c2", device=99), C.INVALID_ARGUMENT, ["device_id", "99"],
               "register on a GPU moed does not run on")
        expect(lambda: register(cin, name="c2", size=0), C.INVALID_ARGUMENT, ["byte_size"], "register 0 bytes")
        expect(lambda: register(cin, name="c2", size=64 * MIB), C.INVALID_ARGUMENT, ["byte_size", "past the end"],
               "register more bytes than the allocation has")
        report("c2" not in status(), "no failed registration is listed")
        # the same buffer under a second name, smaller: a region of its own
        register(cin, name="c2", size=MIB)
        report(status("c2") == {"c2": (0, MIB)}, "a second region on the same buffer (1 MiB)")
        expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, in_shm={"x": ("c2", MIB - 64)}),
               C.INVALID_ARGUMENT, ["past the end", "c2"], "its own byte_size bounds it")
        unregister("c2")

    # REST: register, status, unregister through /v2/cudasharedmemory
    if K == "Cuda":
        def rest(method, path, body=None):
            rq = urllib.request.Request(f"http://127.0.0.1:{rport}{path}", method=method,
                                        data=None if body is None else json.dumps(body).encode())
            try:
                with urllib.request.urlopen(rq, timeout=60) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
        s, t = rest("POST", "/v2/cudasharedmemory/region/r1/register",
                    {"raw_handle": {"b64": base64.b64encode(cout.handle).decode()}, "device_id": 0, "byte_size": 4096})
        report(s == 200, f"REST register ({s} {t})")
        s, t = rest("GET", "/v2/cudasharedmemory/region/r1/status")
        try:
            lst = json.loads(t)
            ok = s == 200 and [(e["name"], int(e["device_id"]), int(e["byte_size"])) for e in lst] == [("r1", 0, 4096)]
        except Exception:
            ok = False
        report(ok, f"REST status ({s} {t})")
        # a name not taken: the name is checked before the handle (the statuses' order, docs/server.md)
        s, t = rest("POST", "/v2/cudasharedmemory/region/r9/register",
                    {"raw_handle": {"b64": base64.b64encode(cout.handle[:60]).decode()}, "device_id": 0, "byte_size": 64})
        report(s == 400 and "raw_handle" in t, f"REST register a 60-byte handle: 400 naming raw_handle ({s} {t})")
        s, t = rest("POST", "/v2/cudasharedmemory/region/r1/unregister", {})
        report(s == 200 and "r1" not in status(), f"REST unregister ({s} {t})")

    # unregister one, then a request naming it; then all
    unregister("cin")
    report(set(status()) == {"cout"}, "unregister one region")
    expect(lambda: infer("quant.per_token", [x], {"out_dtype": "int8"}, in_shm={"x": ("cin", 0)}),
           C.NOT_FOUND, ["cin"], "a request naming the unregistered region")
    unregister()
    report(status() == {}, "unregister every region")
    if K == "Cuda":  # last: a handle that opens nothing (after it, the server must still serve)
        expect(lambda: register(cin, name="junk", handle=bytes(range(64))), C.INVALID_ARGUMENT, ["raw_handle"],
               "register a handle that opens nothing")
        register(cin)
        cin.write(0, x.arr.tobytes())
        ref = infer("quant.per_token", [x], {"out_dtype": "int8"})
        got = infer("quant.per_token", [x], {"out_dtype": "int8"}, in_shm={"x": ("cin", 0)})
        report([g[3] for g in got] == [r[3] for r in ref], "registering again after all that: served bit-identically")
        unregister()
    ref = infer("mix_bf16", mix, {})
    report(len(ref) == 1 and len(ref[0][3]) == 17 * 1024 * 2, "the server still serves")
    try:
        os.kill(moed_pid, 0)
        alive = True
    except OSError:
        alive = False
    report(alive, "moed is still running")
except (grpc.RpcError, SystemExit, Exception) as e:  # reported, the regions still freed
    report(False, f"stopped early: {type(e).__name__}: {getattr(e, 'details', lambda: e)()}")
finally:
    cin.close()
    cout.close()
print(f"{npass} passed, {bad} failed")
sys.exit(1 if bad or npass == 0 else 0)
PY
if ! kill -0 "$pid" 2>/dev/null; then echo "FAIL moed exited"; rc=1; fi
grep -E '"level":"(error|fatal)"|ERROR|AddressSanitizer' "$log/moed-cudashm.log" | head -5 || true
echo "== rc=$rc"
exit $rc
