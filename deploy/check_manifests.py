"""What kubernetes-validate cannot know: the rendered manifests agree with moed.

  python deploy/check_manifests.py RENDERED_DIR          (deploy/check.sh runs it)
  python deploy/check_manifests.py --env RENDERED.yaml    print the moed container's env as NAME=VALUE lines

RENDERED_DIR holds one `kubectl kustomize` output per overlay (OVERLAY.yaml).
Every fact checked against moed is read from its sources, not restated:
the health service names (server/handlers.c), the environment variables
(server/config.c), the metric names (server/http.c). Also checked: the
Dockerfiles (deploy/docker/) use the shared recipe and the image contract.
Exits 1 naming every failure."""
import os
import re
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
errors = []


def fail(where, msg):
    errors.append(f"{where}: {msg}")


def src(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


# ---- facts from moed's sources ----------------------------------------------------------

handlers = src("server/handlers.c")
m = re.search(r"static int health_status\(.*?\n}\n", handlers, re.S)
assert m, "server/handlers.c: health_status() not found"
health_fn = m.group(0)
# "" (or no service) is SERVING while the process answers: liveness
LIVE_OK = "if (!service || !*service) return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING" in health_fn
# the names that follow the ready flag: readiness
READY_NAMES = set(re.findall(r'strcmp\(service, "([^"]+)"\) == 0', health_fn))
if not LIVE_OK:
    fail("server/handlers.c", 'health service "" is no longer the unconditional liveness answer')
if "moed" not in READY_NAMES:
    fail("server/handlers.c", f'health service "moed" is not a readiness name (found {sorted(READY_NAMES)})')

config_c = src("server/config.c")
ENV_NAMES = set(re.findall(r'\{"(MOED_[A-Z_]+)", OPT_', config_c))
DEFAULT_PORTS = {"grpc": 8001, "http": 8002}
assert re.search(r"\.grpc_port = 8001", config_c) and re.search(r"\.http_port = 8002", config_c)

http_c = src("server/http.c")
METRICS = set(re.findall(r"\b(moed_[a-z_]+)\b", http_c))

# ---- the rendered overlays ---------------------------------------------------------------


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def moed_container(pod_spec):
    for c in pod_spec.get("containers", []):
        if c["name"] == "moed":
            return c
    return None


def env_of(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def check_workload(where, w, overlay):
    spec = w["spec"]
    pod = spec["template"]["spec"]
    c = moed_container(pod)
    if not c:
        return fail(where, "no container named moed")
    env = env_of(c)
    for name in env:
        if name.startswith("MOED_") and name not in ENV_NAMES:
            fail(where, f"env {name}: moed reads no such variable (server/config.c env_map)")
    if env.get("MOED_MODEL_REPOSITORY") != "/models":
        fail(where, "MOED_MODEL_REPOSITORY must be /models (the volume)")
    # image and pull policy: a locally built image must be usable
    image = c.get("image", "")
    if image.endswith(":latest") or ":" not in image:
        fail(where, f"image {image!r}: give a tag other than latest (IfNotPresent then uses a loaded image)")
    if c.get("imagePullPolicy") != "IfNotPresent":
        fail(where, "imagePullPolicy must be IfNotPresent")
    # ports
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if ports.get("grpc") != DEFAULT_PORTS["grpc"] or ports.get("http-metrics") != DEFAULT_PORTS["http"]:
        fail(where, f"ports {ports}: want grpc 8001 and http-metrics 8002")
    # probes: native gRPC, the service names moed answers
    want = {"startupProbe": "", "livenessProbe": "", "readinessProbe": "moed"}
    for probe, service in want.items():
        p = c.get(probe)
        g = (p or {}).get("grpc")
        if not g:
            fail(where, f"{probe}: not a native gRPC probe")
            continue
        if g.get("port") != 8001:
            fail(where, f"{probe}: port {g.get('port')}, want 8001")
        if g.get("service", "") != service:
            fail(where, f"{probe}: service {g.get('service')!r}, want {service!r}")
        if service and service not in READY_NAMES:
            fail(where, f"{probe}: {service!r} is not a readiness name of server/handlers.c")
    sp = c.get("startupProbe", {})
    if sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) < 300:
        fail(where, "startupProbe: covers less than 5 minutes of weight loading")
    # drain: grace > preStop + drain timeout + 5 s (the exit watchdog fires 4 s past the
    # timeout: docs/server.md "Drain")
    pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command", [])
    pre_s = int(pre[1]) if len(pre) == 2 and pre[0] == "sleep" else None
    if pre_s is None:
        fail(where, "preStop: want exec [sleep, N]")
        pre_s = 0
    drain = int(env.get("MOED_DRAIN_TIMEOUT", "30"))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace <= pre_s + drain + 5:
        fail(where, f"terminationGracePeriodSeconds {grace} <= preStop {pre_s} + drain {drain} + 5")
    # security
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    if not psc.get("runAsNonRoot") or not isinstance(psc.get("runAsUser"), int) or psc["runAsUser"] == 0:
        fail(where, "pod securityContext: want runAsNonRoot and a numeric non-root runAsUser")
    if not csc.get("readOnlyRootFilesystem") or csc.get("allowPrivilegeEscalation") is not False \
            or csc.get("capabilities", {}).get("drop") != ["ALL"]:
        fail(where, "container securityContext: want readOnlyRootFilesystem, no privilege escalation, drop ALL")
    # volumes: /models writable (uploads), /tmp writable (read-only root)
    mounts = {v["mountPath"]: v for v in c.get("volumeMounts", [])}
    for path in ("/models", "/tmp"):
        if path not in mounts:
            fail(where, f"{path}: not mounted")
        elif mounts[path].get("readOnly"):
            fail(where, f"{path}: mounted read-only (uploads and the read-only root need it writable)")
    # resources, GPUs by backend
    res = c.get("resources", {})
    if not res.get("requests") or not res.get("limits"):
        fail(where, "resources: want requests and limits")
    backend = "nvidia" if "nvidia" in image else "amd" if "amd" in image else "cpu"
    gpu_key = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}.get(backend)
    limits = res.get("limits", {})
    if gpu_key:
        if str(limits.get(gpu_key)) != "1":
            fail(where, f"{backend} image without {gpu_key}: 1 in limits")
        if env.get("MOED_DEVICE") != "gpu":
            fail(where, "GPU pod: want MOED_DEVICE=gpu (fail at start without a GPU)")
    else:
        if any(k.endswith("/gpu") for k in limits):
            fail(where, "CPU image with a GPU resource")
        if env.get("MOED_DEVICE") != "cpu":
            fail(where, "CPU pod: want MOED_DEVICE=cpu")
    return pod["containers"]


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def check_overlay(path):
    overlay = os.path.basename(path)[:-5]
    docs = load(path)
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
        if d["kind"] != "Namespace" and d["metadata"].get("namespace") != "moed":
            fail(overlay, f"{d['kind']}/{d['metadata']['name']}: not in namespace moed "
                          "(an overlay's components need the overlay's own `namespace:`)")
    workloads = kinds.get("Deployment", []) + kinds.get("StatefulSet", [])
    if len(workloads) != 1:
        return fail(overlay, f"want one moed workload, found {len(workloads)}")
    w = workloads[0]
    where = f"{overlay}: {w['kind']}/{w['metadata']['name']}"
    check_workload(where, w, overlay)
    pod_labels = w["spec"]["template"]["metadata"]["labels"]
    svcs = [s for s in kinds.get("Service", []) if selects(s["spec"].get("selector"), pod_labels)]
    headless = [s for s in svcs if s["spec"].get("clusterIP") == "None"]
    if not headless:
        fail(overlay, "no headless Service over the pods (client-side gRPC balancing, shard names)")
    if w["kind"] == "Deployment" and not [s for s in svcs if s["spec"].get("clusterIP") != "None"]:
        fail(overlay, "no ClusterIP Service over the pods")
    if w["kind"] == "StatefulSet" and w["spec"].get("serviceName") not in [s["metadata"]["name"] for s in headless]:
        fail(overlay, "StatefulSet serviceName is not its headless Service")
    pdbs = [p for p in kinds.get("PodDisruptionBudget", [])
            if selects(p["spec"]["selector"].get("matchLabels"), pod_labels)]
    if not pdbs:
        fail(overlay, "no PodDisruptionBudget over the pods")
    nps = [n for n in kinds.get("NetworkPolicy", [])
           if selects(n["spec"]["podSelector"].get("matchLabels"), pod_labels)]
    if not nps:
        fail(overlay, "no NetworkPolicy over the pods")
    for n in nps:
        for rule in n["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if set(peer) != {"namespaceSelector"}:
                    fail(overlay, f"NetworkPolicy {n['metadata']['name']}: a peer other than a namespace: {peer}")
    for hpa in kinds.get("HorizontalPodAutoscaler", []):
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) != (w["kind"], w["metadata"]["name"]):
            fail(overlay, f"HPA targets {ref['kind']}/{ref['name']}")
        if "replicas" in w["spec"]:
            fail(overlay, "HPA and a fixed spec.replicas: re-applying resets the HPA's count")
        for mt in hpa["spec"]["metrics"]:
            name = mt.get("pods", {}).get("metric", {}).get("name", "")
            base = re.sub(r"_mean$", "", name)
            if base not in METRICS:
                fail(overlay, f"HPA metric {name}: moed exports no {base} (server/http.c)")
            if name not in adapter_metrics:
                fail(overlay, f"HPA metric {name}: no rule in components/monitoring/prometheus-adapter-values.yaml")
    ports = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    for pm in kinds.get("PodMonitor", []):
        if not selects(pm["spec"]["selector"].get("matchLabels"), pod_labels):
            fail(overlay, "PodMonitor does not select the pods")
        for ep in pm["spec"]["podMetricsEndpoints"]:
            if ep.get("port") not in ports or ep.get("path") != "/metrics":
                fail(overlay, f"PodMonitor endpoint {ep}: want a container port name and /metrics")
    return w


with open(os.path.join(ROOT, "deploy/k8s/components/monitoring/prometheus-adapter-values.yaml")) as f:
    adapter = yaml.safe_load(f)
adapter_metrics = set()
for rule in adapter["rules"]["custom"]:
    adapter_metrics.add(rule["name"]["as"])
    for series in re.findall(r"\b(moed_[a-z_]+)\b", rule["seriesQuery"] + rule["metricsQuery"]):
        if series not in METRICS and re.sub(r"_(sum|count|bucket)$", "", series) not in METRICS:
            fail("prometheus-adapter-values.yaml", f"{series}: moed exports no such series")


def check_dockerfiles():
    ddir = os.path.join(ROOT, "deploy/docker")
    want = {"cpu.Dockerfile": "cpu", "nvidia.Dockerfile": "cuda", "amd.Dockerfile": "hip"}
    found = sorted(f for f in os.listdir(ddir) if f.endswith("Dockerfile"))
    if found != sorted(want):
        fail("deploy/docker", f"Dockerfiles {found}, want {sorted(want)}")
    for name, backend in want.items():
        where = f"deploy/docker/{name}"
        text = open(os.path.join(ddir, name)).read()
        if len(re.findall(r"^FROM ", text, re.M)) < 2:
            fail(where, "not multi-stage")
        if f"deploy/build.sh {backend} " not in text:
            fail(where, f"does not run deploy/build.sh {backend}")
        users = re.findall(r"^USER (\S+)", text, re.M)
        if not users or not re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]):
            fail(where, "the last USER must be numeric and not root")
        if not re.search(r"^EXPOSE 8000 8001 8002$", text, re.M):
            fail(where, "want EXPOSE 8000 8001 8002")
        if not re.search(r"^HEALTHCHECK ", text, re.M):
            fail(where, "no HEALTHCHECK")
        if '"/models"' not in text or "MOED_MODEL_REPOSITORY=/models" not in text:
            fail(where, "the model repository must be the /models volume")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--env":
        w = [d for d in load(sys.argv[2]) if d["kind"] in ("Deployment", "StatefulSet")][0]
        for k, v in env_of(moed_container(w["spec"]["template"]["spec"])).items():
            print(f"{k}={v}")
        return 0
    rendered = sys.argv[1]
    files = sorted(f for f in os.listdir(rendered) if f.endswith(".yaml"))
    if not files:
        fail(rendered, "no rendered overlays")
    for f in files:
        check_overlay(os.path.join(rendered, f))
    check_dockerfiles()
    for e in errors:
        print("FAIL", e)
    print(f"check_manifests: {len(files)} overlays, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
