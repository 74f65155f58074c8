"""Checks the manifests rendered from every ci/ values file against the binaries and against
each other: every flag the chart passes exists in `--help` (minus the named allow-list of flags
that distributed execution, issue #5, will add); container, probe, Service, ServiceMonitor and
scrape-annotation ports agree; the router's --worker list names the leaders the workloads create;
a replica has max(tp, ep) ranks; every container has resources, probes and a locked-down
securityContext; the grace period outlasts the drain.

usage: chart_binaries_test.py MOBIUS_WORKER MOBIUS_ROUTER"""
import re
import subprocess
import sys

import chart

# Flags of distributed execution that the chart renders for replicas of more than one rank but
# that mobius-worker does not have yet (issue #5). This list must only shrink: a flag that
# appears in --help fails this test until it is removed from here.
NOT_YET_IMPLEMENTED = set()


def help_flags(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    flags = set(re.findall(r"^\s+--(\w+) \(", out.stdout + out.stderr, re.M))
    assert flags, f"no flags found in {binary} --help"
    return flags


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def port_of(container, name_or_number):
    for p in container.get("ports", []):
        if name_or_number in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def check_values(values, known, failures):
    docs = chart.render(values)
    tag = values.rsplit("/", 1)[-1]
    c = lambda cond, msg: chart.check(cond, f"{tag}: {msg}", failures)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    scalers = {s["spec"]["scaleTargetRef"]["name"]: s for s in
               by_kind.get("ScaledObject", []) + by_kind.get("HorizontalPodAutoscaler", [])}
    templates = list(chart.pod_templates(docs))
    c(templates, "no pod templates rendered")
    worker_ports, worker_pods, router_workers = set(), set(), []

    for workload, role, tmpl in templates:
        where = f"{workload['kind']}/{workload['metadata']['name']}({role})"
        spec, labels = tmpl["spec"], tmpl["metadata"].get("labels", {})
        if workload["kind"] != "LeaderWorkerSet":
            c(labels_match(workload["spec"]["selector"]["matchLabels"], labels),
              f"{where}: selector does not match the pod labels")
        c(spec.get("securityContext", {}).get("runAsNonRoot") is True, f"{where}: runAsNonRoot")
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for ctr in spec.get("initContainers", []) + spec["containers"]:
            cw = f"{where}/{ctr['name']}"
            sc = ctr.get("securityContext", {})
            c(sc.get("readOnlyRootFilesystem") is True, f"{cw}: readOnlyRootFilesystem")
            c(sc.get("allowPrivilegeEscalation") is False, f"{cw}: allowPrivilegeEscalation")
            c("ALL" in sc.get("capabilities", {}).get("drop", []), f"{cw}: capabilities drop ALL")
            res = ctr.get("resources", {})
            c(res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"),
              f"{cw}: cpu and memory requests")
            for m in ctr.get("volumeMounts", []):
                c(m["name"] in volumes, f"{cw}: mount of undefined volume {m['name']}")
        for ctr in spec["containers"]:
            cw = f"{where}/{ctr['name']}"
            binary = chart.binary_name(ctr)
            c(binary in known, f"{cw}: runs {binary!r}, not a Mobius binary")
            if binary not in known:
                continue
            flags = chart.flag_args(ctr)
            for name in flags:
                allowed = binary == "mobius-worker" and name in NOT_YET_IMPLEMENTED
                c(name in known[binary] or allowed, f"{cw}: --{name} is not a flag of {binary}")
            c(ctr.get("resources", {}).get("limits", {}).get("memory"), f"{cw}: memory limit")
            for probe in ("readinessProbe", "livenessProbe"):
                c(probe in ctr, f"{cw}: no {probe}")
            grpc_flag = "port" if binary == "mobius-worker" else "grpc_port"
            grpc_port = int(flags[grpc_flag][0])
            c(port_of(ctr, "grpc") == grpc_port, f"{cw}: container port grpc != --{grpc_flag}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = ctr.get(probe)
                if p:
                    port = (p.get("grpc") or p.get("tcpSocket") or {}).get("port")
                    c(port == grpc_port, f"{cw}: {probe} port {port} != gRPC port {grpc_port}")
            c("grpc" in ctr["readinessProbe"], f"{cw}: readiness is not a grpc.health.v1 probe")
            metrics_port = (int(flags["metrics_port"][0]) if binary == "mobius-worker"
                            else int(flags["http_port"][0]))
            c(port_of(ctr, "metrics" if binary == "mobius-worker" else "http") == metrics_port,
              f"{cw}: metrics container port != flag")
            ann = tmpl["metadata"].get("annotations", {})
            if "prometheus.io/port" in ann:
                c(int(ann["prometheus.io/port"]) == metrics_port, f"{cw}: scrape annotation port")
            drain = int(flags["drain_timeout_s"][0])
            sleep = int(ctr["lifecycle"]["preStop"]["exec"]["command"][-1])
            c(spec["terminationGracePeriodSeconds"] > drain + sleep,
              f"{cw}: terminationGracePeriodSeconds <= drain + preStop")
            mounts = [m["mountPath"] for m in ctr.get("volumeMounts", [])]
            for f in ("config", "model", "tokenizer"):
                for path in flags.get(f, []):
                    c(any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts),
                      f"{cw}: --{f}={path} is on no mounted volume")
            if binary == "mobius-worker":
                worker_ports.add(grpc_port)
                if flags.get("device", ["cpu"])[0].startswith("cuda"):
                    c(any("gpu" in k for k in ctr["resources"].get("limits", {})), f"{cw}: no GPU limit")
                distributed = int(flags.get("world_size", ["1"])[0]) > 1
                tp, ep = (int(flags.get(k, ["1"])[0]) for k in ("tp", "ep"))
                if workload["kind"] == "LeaderWorkerSet":
                    lws = workload["metadata"]["name"]
                    ranks = workload["spec"]["leaderWorkerTemplate"]["size"]
                    groups = workload["spec"].get("replicas") or scalers[lws]["spec"].get(
                        "maxReplicaCount", scalers[lws]["spec"].get("maxReplicas"))
                    c(flags["leader"][0].startswith("$(LWS_LEADER_ADDRESS):"), f"{cw}: --leader")
                    worker_pods |= {f"{lws}-{g}.{lws}" for g in range(groups)}
                else:
                    sts = workload["metadata"]["name"]
                    ranks = workload["spec"].get("replicas")
                    svc = workload["spec"]["serviceName"]
                    c(services.get(svc, {}).get("spec", {}).get("clusterIP") == "None",
                      f"{cw}: serviceName {svc} is not a headless Service of the chart")
                    if distributed:
                        c(flags["leader"][0] == f"{sts}-0.{svc}.serving.svc.cluster.local:{grpc_port}",
                          f"{cw}: --leader is not rank 0 of its StatefulSet")
                        worker_pods.add(f"{sts}-0.{svc}")
                    else:
                        n = ranks if ranks is not None else scalers[sts]["spec"].get(
                            "maxReplicaCount", scalers[sts]["spec"].get("maxReplicas"))
                        worker_pods |= {f"{sts}-{i}.{svc}" for i in range(n)}
                if distributed:
                    world = max(tp, ep)
                    c(int(flags["world_size"][0]) == world, f"{cw}: --world-size != max(tp, ep)")
                    c(ranks == world, f"{cw}: {ranks} ranks per replica, max(tp, ep) = {world}")
                    c(flags["rank"] == ["$(MOBIUS_RANK)"] and any(
                        e["name"] == "MOBIUS_RANK" and "fieldRef" in e.get("valueFrom", {})
                        for e in ctr.get("env", [])), f"{cw}: --rank is not the pod's index")
                else:
                    c(workload["kind"] == "StatefulSet", f"{cw}: one-rank replicas are a StatefulSet")
            else:
                router_workers += flags["worker"]

    # The router's --worker list: exactly the leaders the workloads create, on the worker port.
    listed = set()
    for address in router_workers:
        m = re.fullmatch(r"([a-z0-9-]+\.[a-z0-9-]+)\.serving\.svc\.cluster\.local:(\d+)", address)
        if c(m, f"router --worker {address} is not a pod DNS name in the release namespace"):
            listed.add(m.group(1))
            c(int(m.group(2)) in worker_ports, f"router --worker {address}: not the worker port")
    c(listed == worker_pods, f"router --worker list {sorted(listed)} != leaders {sorted(worker_pods)}")

    # Services: selectors select pods, target ports exist there and agree with the Service ports.
    for name, svc in services.items():
        selected = [t for _, _, t in templates
                    if labels_match(svc["spec"]["selector"], t["metadata"].get("labels", {}))]
        c(selected, f"Service {name} selects no pod")
        for p in svc["spec"]["ports"]:
            for t in selected:
                numbers = {port_of(ctr, p["targetPort"]) for ctr in t["spec"]["containers"]} - {None}
                c(numbers == {p["port"]}, f"Service {name} port {p['name']}: {p['port']} vs {numbers}")
    for sm in by_kind.get("ServiceMonitor", []):
        matching = [s for s in services.values()
                    if labels_match(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        c(matching, f"ServiceMonitor {sm['metadata']['name']} selects no Service")
        for e in sm["spec"]["endpoints"]:
            for s in matching:
                c(e["port"] in {p["name"] for p in s["spec"]["ports"]},
                  f"ServiceMonitor {sm['metadata']['name']}: no port {e['port']} in {s['metadata']['name']}")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        c(any(labels_match(pdb["spec"]["selector"]["matchLabels"], t["metadata"].get("labels", {}))
              for _, _, t in templates), f"PodDisruptionBudget {pdb['metadata']['name']} selects no pod")
    return docs


chart.need_tools()
failures = []
known = {"mobius-worker": help_flags(sys.argv[1]), "mobius-router": help_flags(sys.argv[2])}
for name in sorted(NOT_YET_IMPLEMENTED & known["mobius-worker"]):
    failures.append(f"--{name} exists now: remove it from NOT_YET_IMPLEMENTED (issue #5)")
for values in chart.CI_VALUES:
    docs = check_values(values, known, failures)
    if values.endswith("cpu-values.yaml"):
        # The one-rank values run against today's binaries with no allow-list at all.
        for _, _, t in chart.pod_templates(docs):
            for ctr in t["spec"]["containers"]:
                used = NOT_YET_IMPLEMENTED & set(chart.flag_args(ctr))
                chart.check(not used, f"cpu-values: renders {used}", failures)
    print(f"checked {values}")
chart.finish(failures, "chart against binaries")
