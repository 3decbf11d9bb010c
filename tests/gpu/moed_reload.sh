#!/usr/bin/env bash
# On a GPU machine: a served expert set leaves the device when it is
# unloaded. moed --device gpu serves a 384 MiB bf16 set; 50 times: load it
# (RepositoryModelLoad), serve one request through moec, unload it
# (RepositoryModelUnload). After every unload the worker's resident bytes
# (/metrics moed_device_memory_bytes{kind="resident"}) return to 0 and the
# process's device memory (nvidia-smi) to its value after the first cycle.
#   tests/gpu/moed_reload.sh BINDIR LOGDIR [CYCLES]   (BINDIR: moed, moec, moe-mkset)
set -euo pipefail
bin=$(cd "$1" && pwd); log=$2; cycles=${3:-50}
mkdir -p "$log"
work=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin/moe-mkset" --out "$work/models/big" --scheme bf16 --experts 8 --hidden 2048 --intermediate 4096 \
  --top-k 2 --seed 5 >/dev/null
"$bin/moed" --device gpu --model-repository "$work/models" --grpc-port 0 --http-port 0 --rest-port -1 \
  --port-file "$work/port" >"$log/moed-reload.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done

python3 - "$work" "$bin/moec" "$pid" "$cycles" <<'PY' | tee "$log/reload.txt"
import os, re, subprocess, sys, time, urllib.request
import grpc
import numpy as np

work, moec, pid, cycles = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gport, hport = open(f"{work}/port").read().split()[:2]
rng = np.random.default_rng(1)
np.save(f"{work}/h.npy", (rng.standard_normal((8, 2048)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
np.save(f"{work}/logits.npy", rng.standard_normal((8, 8)).astype(np.float32))
chan = grpc.insecure_channel(f"127.0.0.1:{gport}")

def repo(method, name):  # RepositoryModel{Load,Unload}Request: field 2 = model_name
    body = b"\x12" + bytes([len(name)]) + name.encode()
    chan.unary_unary(f"/inference.GRPCInferenceService/RepositoryModel{method}")(body, timeout=60)

def memory(kind):  # moed_device_memory_bytes of that kind, over the workers
    text = urllib.request.urlopen(f"http://127.0.0.1:{hport}/metrics", timeout=10).read().decode()
    vals = re.findall(r'moed_device_memory_bytes\{[^}]*kind="' + kind + r'"\} (\d+)', text)
    return sum(int(v) for v in vals)

def resident():
    return memory("resident")

def device_mib():  # this process's device memory
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(m) for p, m in (l.split(",") for l in out.splitlines() if l.strip()) if p.strip() == pid)

def wait_resident(pred, what):
    for _ in range(50):  # the workers trim within a tick (1 s) of the unload
        r = resident()
        if pred(r):
            return r
        time.sleep(0.1)
    raise SystemExit(f"FAIL {what}: resident {r}")

bad, first = 0, None
for c in range(cycles):
    if c:
        repo("Load", "big")
    os.makedirs(f"{work}/out{c}")
    for attempt in range(300):  # cycle 0: until the startup load has finished
        p = subprocess.run([moec, "-a", f"127.0.0.1:{gport}", "infer", "-m", "big", "--input",
                            f"hidden_states={work}/h.npy:BF16", "--input", f"router_logits={work}/logits.npy",
                            "--output-dir", f"{work}/out{c}"], capture_output=True, text=True)
        if p.returncode == 0 or c:
            break
        time.sleep(0.1)
    if p.returncode:
        raise SystemExit(f"FAIL cycle {c}: moec: {p.stderr.strip()}")
    served = wait_resident(lambda r: r >= 384 << 20, f"cycle {c}: set not resident while served")
    out = np.load(f"{work}/out{c}/output.npy")
    if c == 0:
        ref = out
    elif out.tobytes() != ref.tobytes():
        bad += 1
        print(f"FAIL cycle {c}: output differs from cycle 0")
    repo("Unload", "big")
    wait_resident(lambda r: r == 0, f"cycle {c}: resident after unload")
    # the set's blocks go back to the pool, then the pool gives them to the
    # device: the metric shows resident 0 before that second step is done
    for _ in range(50):
        if memory("held") == 0:
            break
        time.sleep(0.1)
    mib = device_mib()
    first = mib if first is None else first
    if abs(mib - first) > 4:
        bad += 1
        print(f"FAIL cycle {c}: process device memory {mib} MiB, {first} MiB after cycle 0 "
              f"(held {memory('held') >> 20} MiB)")
    if c in (0, 1, cycles - 1):
        print(f"cycle {c}: served with {served >> 20} MiB resident; after unload 0 resident, {mib} MiB on the device")
print(f"{cycles - bad} of {cycles} cycles passed")
sys.exit(1 if bad else 0)
PY
