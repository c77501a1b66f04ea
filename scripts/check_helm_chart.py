#!/usr/bin/env python3
"""The Helm chart, checked by helm itself: `helm lint` and `helm template` of
deploy/helm/moe-expert-service with its default values and with every values
file under deploy/helm/examples (among them a multi-NUMA, TLS-on one and a
remote expert pool), then
the rendered objects against the values that made them:
  - one coordinator Deployment (with its Service and state PVC), a worker
    Service and the `helm test` Pod;
  - one expert-server DaemonSet per expertServers.numaNodes entry, each
    Guaranteed (integer CPUs, requests = limits), with --slice i/n when
    expertServers.slice is on;
  - worker.perNode worker DaemonSets, each asking worker.gpus GPUs, listing
    the node's sockets (worker.localServers) or, for a remote pool, only the
    servers' Services, with no socket volume and no wait for local servers;
    the configured affinities on workers and servers;
  - TLS on: every container gets --tls-cert/--tls-key/--tls-ca and the
    secret's volume; off: --insecure and no TLS volume;
and that bad values fail to render with a message naming the value.
Exit 0 when all holds, 1 naming what does not, 77 (skipped) without helm or
PyYAML.   python3 scripts/check_helm_chart.py [REPO_ROOT]
"""
import copy
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:
    print("SKIPPED: PyYAML not installed (scripts/install-deps.sh installs python3-yaml)")
    sys.exit(77)

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
chart = os.path.join(root, "deploy/helm/moe-expert-service")
helm = os.environ.get("HELM") or shutil.which("helm")
if not helm:
    print("SKIPPED: helm not found (scripts/install-deps.sh runs scripts/fetch-helm.sh)")
    sys.exit(77)
problems = []


def merge(base, over):
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = merge(out.get(k) or {}, v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run(*args):
    return subprocess.run([helm, *args], capture_output=True, text=True)


def containers(obj):
    """The pod spec and its main containers (not the init helpers)."""
    spec = obj["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec
    return pod, pod.get("containers", [])


def check(values_file):
    name = os.path.relpath(values_file, root) if values_file else "default values"
    extra = ["-f", values_file] if values_file else []
    lint = run("lint", chart, *extra)
    if lint.returncode != 0:
        problems.append(f"{name}: helm lint failed: {lint.stdout[-400:]} {lint.stderr[-400:]}")
        return
    r = run("template", "moe", chart, "-n", "moe", *extra)
    if r.returncode != 0:
        problems.append(f"{name}: helm template failed: {r.stderr[-400:]}")
        return
    objs = [o for o in yaml.safe_load_all(r.stdout) if o]
    with open(os.path.join(chart, "values.yaml")) as f:
        values = yaml.safe_load(f)
    if values_file:
        with open(values_file) as f:
            values = merge(values, yaml.safe_load(f))
    kinds = {}
    for o in objs:
        kinds.setdefault(o["kind"], []).append(o)
    def want(cond, what):
        if not cond:
            problems.append(f"{name}: {what}")
    want(len(kinds.get("Deployment", [])) == 1, f"{len(kinds.get('Deployment', []))} Deployments, want the coordinator's")
    persist = values["coordinator"]["persistence"].get("enabled", True)
    want(len(kinds.get("PersistentVolumeClaim", [])) == (1 if persist else 0),
         f"{len(kinds.get('PersistentVolumeClaim', []))} PVCs with coordinator.persistence.enabled {persist}")
    services = [o["metadata"]["name"] for o in kinds.get("Service", [])]
    want(any(s.endswith("-coordinator") for s in services) and any(s.endswith("-worker") for s in services),
         f"services {services}: want the coordinator's and the workers'")
    want(len(kinds.get("Pod", [])) == 1, "no helm test Pod")
    ds = kinds.get("DaemonSet", [])
    experts = [o for o in ds if re.search(r"-expert-numa\d+$", o["metadata"]["name"])]
    workers = [o for o in ds if re.search(r"-worker-\d+$", o["metadata"]["name"])]
    want(len(experts) + len(workers) == len(ds), f"DaemonSets {[o['metadata']['name'] for o in ds]}: unknown ones")
    nodes = values["expertServers"]["numaNodes"]
    want(len(experts) == len(nodes), f"{len(experts)} expert-server DaemonSets for {len(nodes)} numaNodes entries")
    for i, o in enumerate(experts):
        pod, cs = containers(o)
        res = cs[0].get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        want(req.get("cpu") == lim.get("cpu") and str(lim.get("cpu", "x")).isdigit() and
             req.get("memory") == lim.get("memory"),
             f"{o['metadata']['name']}: not Guaranteed with integer CPUs (requests {req}, limits {lim})")
        args = " ".join(a for c in cs for a in (c.get("args") or []) + (c.get("command") or []))
        if values["expertServers"].get("slice"):
            want(f"--slice={i}/{len(nodes)}" in args or f"--slice {i}/{len(nodes)}" in args,
                 f"{o['metadata']['name']}: no --slice {i}/{len(nodes)}")
    want(len(workers) == int(values["worker"]["perNode"]), f"{len(workers)} worker DaemonSets, perNode {values['worker']['perNode']}")
    w, es = values["worker"], values["expertServers"]
    svc_addrs = [f"-expert-numa{int(n['node'])}.moe.svc.cluster.local:{int(es['port'])}" for n in nodes]
    for o in workers:
        pod, cs = containers(o)
        gpus = str(cs[0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        want(gpus == str(w["gpus"]), f"{o['metadata']['name']}: {gpus} GPUs, want {w['gpus']}")
        servers = next((a.split("=", 1)[1].split(",") for a in cs[0].get("args") or [] if a.startswith("--servers=")), [])
        local = [a for a in servers if a.startswith("unix://")]
        inits = [c["name"] for c in pod.get("initContainers") or []]
        if w.get("localServers", True):
            want(len(local) == len(nodes), f"{o['metadata']['name']}: {len(local)} local sockets for {len(nodes)} servers")
        else:  # a remote pool: the Services only, nothing of the node's sockets
            want(not local and not inits and all(v.get("name") != "shm-sockets" for v in pod.get("volumes", [])),
                 f"{o['metadata']['name']}: localServers false but sockets {local}, init containers {inits}")
        if not w.get("localServers", True) or w.get("remoteFallback"):
            want(all(any(a.split("#")[0].endswith(sa) for a in servers) for sa in svc_addrs),
                 f"{o['metadata']['name']}: --servers {servers} lack the Services {svc_addrs}")
        if w.get("affinity"):
            want(pod.get("affinity") == w["affinity"], f"{o['metadata']['name']}: affinity not as worker.affinity")
    for o in experts:
        pod, _ = containers(o)
        if es.get("affinity"):
            want(pod.get("affinity") == es["affinity"], f"{o['metadata']['name']}: affinity not as expertServers.affinity")
    secret = values["tls"]["secretName"]
    for o in kinds.get("Deployment", []) + ds + kinds.get("Pod", []):
        pod, cs = containers(o)
        vols = [v.get("secret", {}).get("secretName") for v in pod.get("volumes", [])]
        for c in cs:
            args = " ".join((c.get("args") or []) + (c.get("command") or []))
            if values["tls"]["insecure"]:
                want("--insecure" in args and secret not in vols, f"{o['metadata']['name']}/{c['name']}: TLS off but not --insecure")
            else:
                want(all(f in args for f in ("--tls-cert", "--tls-key", "--tls-ca")) and secret in vols,
                     f"{o['metadata']['name']}/{c['name']}: TLS on but no --tls-* or no secret {secret} volume")
    print(f"{name}: lint ok, {len(objs)} objects: " + ", ".join(f"{len(v)} {k}" for k, v in sorted(kinds.items())))


for f in [None] + sorted(glob.glob(os.path.join(root, "deploy/helm/examples/*.yaml"))):
    check(f)

# Bad values fail to render, naming the value.
with tempfile.TemporaryDirectory() as tmp:
    for text, named in (("expertServers:\n  numaNodes:\n    - node: 0\n      memory: 8Gi\n", "cpus"),
                        ("expertServers:\n  numaBinding: sideways\n", "numaBinding"),
                        ("worker:\n  localServers: false\n", "expertServers.service.enabled")):
        bad = os.path.join(tmp, "bad.yaml")
        with open(bad, "w") as f:
            f.write(text)
        r = run("template", "moe", chart, "-f", bad)
        if r.returncode == 0 or named not in r.stderr:
            problems.append(f"bad values ({text.strip()!r}) rendered or did not name {named}: {r.stderr[-300:]}")
        else:
            print(f"bad values refused, naming {named}")

for p in problems:
    print("PROBLEM:", p)
sys.exit(1 if problems else 0)
