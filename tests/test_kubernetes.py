"""examples/kubernetes: every manifest parses, every p2pw command line parses with p2pw's own parser,
and names, ports and paths agree across the files."""
from __future__ import annotations

import os
import posixpath
import re

import pytest

yaml = pytest.importorskip("yaml")

from p2pweights.cli import parser  # noqa: E402
from p2pweights.ops import parse_http_addr  # noqa: E402

from conftest import ROOT  # noqa: E402

DIR = os.path.join(ROOT, "examples", "kubernetes")


def docs() -> list[dict]:
    out = []
    for name in sorted(os.listdir(DIR)):
        if name.endswith((".yaml", ".yml")):
            with open(os.path.join(DIR, name)) as f:
                out += [d for d in yaml.safe_load_all(f) if d is not None]
    return out


def by_kind(kind: str) -> list[dict]:
    return [d for d in docs() if d["kind"] == kind]


def one(kind: str, name: str) -> dict:
    found = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def p2pw_args(container: dict):
    """The parsed p2pw command line of a container (None if it does not run p2pw)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if not argv or argv[0] != "p2pw":
        return None
    return parser(argv[1:]).parse_args(argv[1:])  # as p2pw's main builds it: that command's subparser only


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def port_number(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number)


def host_path_of(workload: dict, container: dict, path: str) -> str:
    """The node's path behind ``path`` inside ``container`` (through a hostPath volume)."""
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for m in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        mount = m["mountPath"].rstrip("/")
        if path == mount or path.startswith(mount + "/"):
            vol = volumes[m["name"]]
            assert "hostPath" in vol, f"{path} is not on a hostPath volume"
            return posixpath.join(vol["hostPath"]["path"], posixpath.relpath(path, mount))
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def test_every_manifest_parses_and_is_a_known_kind():
    kinds = sorted(d["kind"] for d in docs())
    assert kinds == ["ConfigMap", "DaemonSet", "DaemonSet", "DaemonSet", "Deployment", "Deployment", "Deployment",
                     "Job", "PersistentVolumeClaim", "PodDisruptionBudget", "Secret", "Service", "Service", "Service",
                     "StatefulSet"]
    for d in docs():
        assert d["apiVersion"] and d["metadata"]["name"]


def test_every_p2pw_command_line_parses_with_p2pws_own_parser():
    seen = []
    for w in [*by_kind("StatefulSet"), *by_kind("DaemonSet"), *by_kind("Deployment"), *by_kind("Job")]:
        for c in containers(w):
            args = p2pw_args(c)
            if args is not None:
                seen.append(args.command)
                if getattr(args, "http", None):
                    parse_http_addr(args.http)
    assert sorted(seen) == ["agent", "get", "get", "join", "manifest", "seed", "tracker"]


def test_seeder_is_one_replica_behind_a_headless_service_and_joiners_find_it():
    sts, svc = one("StatefulSet", "p2pw-seeder"), one("Service", "p2pw-seeder")
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    seeder = pod_spec(sts)["containers"][0]
    seed = p2pw_args(seeder)
    tracker_port = {p["name"]: p for p in svc["spec"]["ports"]}["tracker"]
    assert port_number(seeder, tracker_port["targetPort"]) == seed.port == tracker_port["port"]
    probe_port = {p["name"]: p for p in svc["spec"]["ports"]}["probe"]  # joiners time their uplinks on it
    assert port_number(seeder, probe_port["targetPort"]) == seed.probe_port == probe_port["port"]
    # the seeder's checkpoint is on its models volume
    mounts = {m["name"]: m["mountPath"] for m in seeder["volumeMounts"]}
    assert seed.path.startswith(mounts["models"] + "/")
    assert "models" in [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]
    # the DaemonSet joins the seeder pod's stable name on the tracker port
    join = p2pw_args(pod_spec(one("DaemonSet", "p2pw-prewarm"))["containers"][0])
    assert join.parent == f"{sts['metadata']['name']}-0.{svc['metadata']['name']}:{seed.port}"


def test_probes_and_metrics_ports_agree_with_http_flags():
    for w in (one("StatefulSet", "p2pw-seeder"), one("DaemonSet", "p2pw-prewarm"), one("Deployment", "p2pw-tracker"),
              one("DaemonSet", "p2pw-get"), one("DaemonSet", "p2pw-agent")):
        c = pod_spec(w)["containers"][0]
        args = p2pw_args(c)
        _, http_port = parse_http_addr(args.http)
        assert port_number(c, c["readinessProbe"]["httpGet"]["port"]) == http_port
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert port_number(c, c["livenessProbe"]["httpGet"]["port"]) == http_port
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/port"] == str(http_port) and ann["prometheus.io/path"] == "/metrics"


def test_prewarm_runs_on_gpu_nodes_stays_and_writes_to_the_host():
    ds = one("DaemonSet", "p2pw-prewarm")
    c = pod_spec(ds)["containers"][0]
    join = p2pw_args(c)
    assert join.stay and join.out and join.port == port_number(c, "peer")
    assert "nvidia.com/gpu.present" in pod_spec(ds)["nodeSelector"]
    host_path_of(ds, c, join.out)  # on a hostPath volume


def test_vllm_waits_for_its_nodes_copy_and_serves_the_same_files():
    ds, dep = one("DaemonSet", "p2pw-prewarm"), one("Deployment", "vllm-llama")
    local = one("Service", "p2pw-prewarm")
    p2pw = pod_spec(ds)["containers"][0]
    join = p2pw_args(p2pw)
    # the node-local Service reaches this node's pre-warm pod on its /readyz port
    assert local["spec"]["internalTrafficPolicy"] == "Local"
    assert local["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    svc_port = local["spec"]["ports"][0]
    assert port_number(p2pw, svc_port["targetPort"]) == parse_http_addr(join.http)[1]
    init = pod_spec(dep)["initContainers"][0]
    script = " ".join(init["command"])
    url = re.search(r"http://([\w.-]+):(\d+)(/[\w/]*)", script)
    assert url and url.group(1) == local["metadata"]["name"] and int(url.group(2)) == svc_port["port"]
    assert url.group(3) == "/readyz"
    # vLLM loads from the host directory the pre-warm pod writes, on the same GPU nodes
    vllm = pod_spec(dep)["containers"][0]
    model = vllm["args"][vllm["args"].index("--model") + 1]
    assert host_path_of(dep, vllm, model) == host_path_of(ds, p2pw, join.out)
    assert all(m.get("readOnly") for m in vllm["volumeMounts"])
    assert pod_spec(dep)["nodeSelector"] == pod_spec(ds)["nodeSelector"]


def test_the_fleet_key_secret_is_mounted_where_key_points():
    secret = one("Secret", "p2pw-fleet-key")
    assert set(secret["stringData"]) == {"fleet.key", "fleet.key_secret"}
    images = set()
    for w in (one("StatefulSet", "p2pw-seeder"), one("DaemonSet", "p2pw-prewarm"), one("Deployment", "p2pw-tracker"),
              one("DaemonSet", "p2pw-get"), one("DaemonSet", "p2pw-agent")):
        c = pod_spec(w)["containers"][0]
        images.add(c["image"])
        vols = {v["name"]: v for v in pod_spec(w)["volumes"]}
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == p2pw_args(c).key)
        assert vols[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert len(images) == 1  # one p2pw image (examples/kubernetes/Dockerfile)
    with open(os.path.join(DIR, "Dockerfile")) as f:
        assert "p2pw" in f.read()


def test_the_tracker_runs_alone_behind_a_service_and_every_node_gets_from_it():
    dep, svc = one("Deployment", "p2pw-tracker"), one("Service", "p2pw-tracker")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    c = pod_spec(dep)["containers"][0]
    tracker = p2pw_args(c)
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert port_number(c, ports["tracker"]["targetPort"]) == tracker.port == ports["tracker"]["port"]
    assert port_number(c, ports["probe"]["targetPort"]) == tracker.probe_port == ports["probe"]["port"]
    where = f"{svc['metadata']['name']}:{tracker.port}"
    publish = p2pw_args(pod_spec(one("Job", "p2pw-publish-llama-3-8b"))["containers"][0])
    ds = one("DaemonSet", "p2pw-get")
    get = p2pw_args(pod_spec(ds)["containers"][0])
    assert publish.tracker == get.tracker == where  # the manifest is published where every node asks
    assert publish.path == get.url and get.url.startswith("s3://")
    assert get.stay and get.key == tracker.key == publish.key
    assert "nvidia.com/gpu.present" in pod_spec(ds)["nodeSelector"]
    host_path_of(ds, pod_spec(ds)["containers"][0], get.out)  # on a hostPath volume


def test_the_tracker_has_a_disruption_budget_and_a_state_volume():
    dep, pdb = one("Deployment", "p2pw-tracker"), one("PodDisruptionBudget", "p2pw-tracker")
    assert pdb["spec"]["minAvailable"] == dep["spec"]["replicas"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    c = pod_spec(dep)["containers"][0]
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    state = next(m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/p2pw")
    claim = volumes[state["name"]]["persistentVolumeClaim"]["claimName"]
    assert one("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    state_dir = getattr(p2pw_args(c), "state_dir", None)
    assert state_dir in (None, "/var/lib/p2pw")  # where p2pw tracker --state-dir keeps what it must


def test_the_init_container_waits_for_an_agent_that_restarts():
    get = p2pw_args(pod_spec(one("Deployment", "vllm-llama-agent"))["initContainers"][0])
    assert get.connect_timeout >= 300 and get.give_up_after >= get.connect_timeout


def test_the_agent_runs_on_gpu_nodes_with_the_prewarm_list_and_its_cache_on_the_host():
    ds, cm, tracker = one("DaemonSet", "p2pw-agent"), one("ConfigMap", "p2pw-prewarm-list"), one("Service", "p2pw-tracker")
    c = pod_spec(ds)["containers"][0]
    agent = p2pw_args(c)
    assert agent.command == "agent" and agent.tracker == f"{tracker['metadata']['name']}:7420"
    assert "nvidia.com/gpu.present" in pod_spec(ds)["nodeSelector"]
    host_path_of(ds, c, agent.cache)  # the node's cache outlives the pod
    # the pre-warm file is the ConfigMap's key, mounted read-only
    volumes = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    mount = next(m for m in c["volumeMounts"] if agent.prewarm.startswith(m["mountPath"].rstrip("/") + "/"))
    assert volumes[mount["name"]]["configMap"]["name"] == cm["metadata"]["name"] and mount.get("readOnly")
    lines = [x for x in cm["data"][posixpath.basename(agent.prewarm)].splitlines() if x and not x.startswith("#")]
    publish = p2pw_args(pod_spec(one("Job", "p2pw-publish-llama-3-8b"))["containers"][0])
    assert lines == [publish.path]  # the URL the Job publishes at the tracker


def test_vllm_loads_through_its_nodes_agent():
    ds, dep = one("DaemonSet", "p2pw-agent"), one("Deployment", "vllm-llama-agent")
    agent = p2pw_args(pod_spec(ds)["containers"][0])
    init = pod_spec(dep)["initContainers"][0]
    get = p2pw_args(init)
    vllm = pod_spec(dep)["containers"][0]
    env = {e["name"]: e["value"] for e in vllm["env"]}
    agent_host = posixpath.normpath(host_path_of(ds, pod_spec(ds)["containers"][0], agent.cache))
    # the init container and the loader find the same agent (its socket) on the node
    assert {posixpath.normpath(host_path_of(dep, c, p)) for c, p in ((init, get.agent), (vllm, env["P2PW_AGENT"]))} == {
        agent_host}
    assert env["P2PW_MODEL"] == get.url and get.url in open(os.path.join(DIR, "agent-daemonset.yaml")).read()
    # vLLM's --model is the folder the init container links the agent's copy into, on the same filesystem
    model = vllm["args"][vllm["args"].index("--model") + 1]
    assert vllm["args"][vllm["args"].index("--load-format") + 1] == "p2pweights"
    assert host_path_of(dep, vllm, model) == host_path_of(dep, init, get.out)
    assert host_path_of(dep, init, get.out).startswith(agent_host + "/")
    assert all(m.get("readOnly") for m in vllm["volumeMounts"])
    assert pod_spec(dep)["nodeSelector"] == pod_spec(ds)["nodeSelector"]


def test_every_manifest_validates_strictly_against_the_kubernetes_schemas():
    pytest.importorskip("kubernetes_validate")
    import subprocess
    import sys

    files = sorted(os.path.join(DIR, n) for n in os.listdir(DIR) if n.endswith((".yaml", ".yml")))
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *files], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
