"""A real Prometheus scrapes a mobius-worker and a mobius-router run with exactly the arguments the
chart renders from ci/cpu-values.yaml (pod DNS names and volumes mapped onto loopback and local
directories), using the scrape configuration that the Prometheus Operator derives from the
chart's ServiceMonitors (same ports, paths, interval and target labels); after streamed and
non-streamed completions, every query of deploy/grafana/mobius-serve.json must return a finite
value through Prometheus's HTTP API. Then both binaries drain on SIGTERM and exit 0.

usage: prometheus_dashboard_test.py PROMETHEUS TOKENIZER_DIR"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import chart

NAMESPACE = "serving"
DASHBOARD = os.path.join(chart.REPO, "deploy", "grafana", "mobius-serve.json")
RATE_WINDOW = "1m"  # $__rate_interval: wide enough to hold every request of the test


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, body=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_for(what, fn, timeout):
    deadline = time.time() + timeout
    while True:
        try:
            if fn():
                return
        except OSError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def local_args(container, pod_spec, docs, work, host_paths):
    """The container's args with its volumes materialised in `work` and pod DNS names on loopback."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    mounts = {}
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "configMap" in v:
            local = os.path.join(work, container["name"], m["name"])
            os.makedirs(local, exist_ok=True)
            for key, text in configmaps[v["configMap"]["name"]]["data"].items():
                with open(os.path.join(local, key), "w") as f:
                    f.write(text)
        elif "hostPath" in v:
            local = host_paths[v["hostPath"]["path"]]
        else:
            local = tempfile.mkdtemp(dir=work)
        mounts[m["mountPath"]] = local
    args = []
    for a in container["args"]:
        name, _, value = a.partition("=")
        if name == "--host":
            value = "127.0.0.1"
        elif name == "--worker":
            value = re.sub(r"^[a-z0-9.-]+\.svc\.cluster\.local:", "127.0.0.1:", value)
        for mount, local in mounts.items():
            if value == mount or value.startswith(mount + "/"):
                value = local + value[len(mount):]
        args.append(f"{name}={value}")
    return args


def scrape_config(docs, interval_s):
    """What the Prometheus Operator generates from the chart's ServiceMonitors, with pods on
    loopback: one job per ServiceMonitor endpoint, the operator's target labels."""
    services = [d for d in docs if d["kind"] == "Service"]
    pods = list(chart.pod_templates(docs))
    jobs = []
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        sel = sm["spec"]["selector"]["matchLabels"]
        for i, ep in enumerate(sm["spec"]["endpoints"]):
            targets = []
            for svc in services:
                if not all(svc["metadata"]["labels"].get(k) == v for k, v in sel.items()):
                    continue
                port = next(p for p in svc["spec"]["ports"] if p["name"] == ep["port"])
                for workload, _, t in pods:
                    if not all(t["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()):
                        continue
                    for c in t["spec"]["containers"]:
                        for cp in c.get("ports", []):
                            if port["targetPort"] in (cp.get("name"), cp["containerPort"]):
                                targets.append({"targets": [f"127.0.0.1:{cp['containerPort']}"], "labels": {
                                    "namespace": NAMESPACE, "service": svc["metadata"]["name"],
                                    "pod": f"{workload['metadata']['name']}-0", "container": c["name"],
                                    "endpoint": ep["port"], "job": svc["metadata"]["name"]}})
            assert targets, f"ServiceMonitor {sm['metadata']['name']} endpoint {ep['port']}: no target"
            jobs.append({"job_name": f"serviceMonitor/{NAMESPACE}/{sm['metadata']['name']}/{i}",
                         "scrape_interval": ep["interval"], "scrape_timeout": ep["scrapeTimeout"],
                         "metrics_path": ep["path"], "honor_labels": False,
                         "static_configs": targets})
    return {"global": {"scrape_interval": f"{interval_s}s"}, "scrape_configs": jobs}


def query(prom, expr):
    _, body = http(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    result = json.loads(body)
    assert result["status"] == "success", body
    return result["data"]["result"]


def main():
    chart.need_tools()
    prometheus_bin, tokenizer = sys.argv[1], os.path.abspath(sys.argv[2])
    worker_bin, router_bin = sys.argv[3], sys.argv[4]
    cpu_values = os.path.join(chart.CHART, "ci", "cpu-values.yaml")
    ports = {k: free_port() for k in ("worker", "metrics", "grpc", "http", "prom")}
    docs = chart.render(cpu_values, [
        f"worker.port={ports['worker']}", f"worker.metricsPort={ports['metrics']}",
        f"router.grpcPort={ports['grpc']}", f"router.httpPort={ports['http']}",
        "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.interval=1s",
        "metrics.serviceMonitor.scrapeTimeout=1s"], namespace=NAMESPACE)
    work = tempfile.mkdtemp(prefix="mobius-deploy-")
    procs = {}
    failures = []
    try:
        # Prometheus first, so that it sees the binaries from their first second.
        config = os.path.join(work, "prometheus.yml")
        with open(config, "w") as f:
            json.dump(scrape_config(docs, 1), f, indent=1)  # JSON is YAML
        check = subprocess.run(["promtool", "check", "config", config], capture_output=True, text=True)
        chart.check(check.returncode == 0, f"promtool check config: {check.stdout}{check.stderr}", failures)
        prom = f"http://127.0.0.1:{ports['prom']}"
        procs["prometheus"] = subprocess.Popen(
            [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={work}/tsdb",
             f"--web.listen-address=127.0.0.1:{ports['prom']}", "--log.level=warn"],
            stdout=open(f"{work}/prometheus.log", "w"), stderr=subprocess.STDOUT)

        host_paths = {"/opt/mobius/tokenizer-qwen3": tokenizer}
        binaries = {"mobius-worker": worker_bin, "mobius-router": router_bin}
        for workload, _, t in chart.pod_templates(docs):
            for c in t["spec"]["containers"]:
                args = local_args(c, t["spec"], docs, work, host_paths)
                print(f"{c['name']}: {chart.binary_name(c)} {' '.join(args)}")
                procs[c["name"]] = subprocess.Popen(
                    [binaries[chart.binary_name(c)], *args],
                    stdout=open(f"{work}/{c['name']}.log", "w"), stderr=subprocess.STDOUT)
        router = f"http://127.0.0.1:{ports['http']}"
        wait_for("Prometheus ready", lambda: http(f"{prom}/-/ready")[0] == 200, 30)
        wait_for("router healthy", lambda: http(f"{router}/health")[0] == 200, 30)

        model = "tiny"

        def completions(rounds):
            for i in range(rounds):
                for stream in (False, True):
                    status, body = http(f"{router}/v1/completions", {
                        "model": model, "prompt": [1, 2, 3 + i], "max_tokens": 8,
                        "stream": stream, "temperature": 0})
                    chart.check(status == 200 and ("data:" in body) == stream,
                                f"completion: {body[:200]}", failures)

        def targets_up():
            _, body = http(f"{prom}/api/v1/targets")
            active = json.loads(body)["data"]["activeTargets"]
            return len(active) == 2 and all(t["health"] == "up" for t in active)

        # As in production, every series has been scraped before the traffic the queries look
        # at: rate() cannot see the increase of a series whose first sample already counts it
        # (the router creates its per-model series at the first request).
        wait_for("both targets up", targets_up, 20)
        completions(1)
        wait_for("the router's per-model series scraped", lambda: query(
            prom, f'vllm:e2e_request_latency_seconds_count{{container="router",model_name="{model}"}}'), 20)
        completions(3)
        status, body = http(f"{router}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
            "stream": True})
        chart.check(status == 200 and "[DONE]" in body, f"chat: {body[:200]}", failures)
        # The rendered worker has the router's tokenizer (dummy weights, the tokenizer volume):
        # structured output is served, and what comes back parses as the asked form.
        status, body = http(f"{router}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "pick", "schema": {"type": "object", "properties": {
                    "ok": {"type": "boolean"}}, "required": ["ok"]}}}})
        content = json.loads(body)["choices"][0]["message"]["content"] if status == 200 else None
        try:
            parsed = json.loads(content) if content is not None else None
        except json.JSONDecodeError:
            parsed = None
        chart.check(isinstance(parsed, dict) and isinstance(parsed.get("ok"), bool),
                    f"structured output: {status} {body[:300]}", failures)

        dashboard = json.load(open(DASHBOARD))
        variables = {"namespace": NAMESPACE, "model_name": model}
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
            match, label = m.group(1), m.group(2)
            for k, v in variables.items():
                match = match.replace(f"${k}", v)
            _, body = http(f"{prom}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": match}))
            chart.check(variables[var["name"]] in json.loads(body)["data"],
                        f"variable {var['name']}: {variables[var['name']]} not in {body}", failures)
        exprs = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
        deadline = time.time() + 15
        for title, expr in exprs:
            e = expr.replace("$__rate_interval", RATE_WINDOW)
            for k, v in variables.items():
                e = e.replace(f"${k}", v)
            while True:
                result = query(prom, e)
                values = [float(r["value"][1]) for r in result]
                if any(math.isfinite(v) for v in values) or time.time() > deadline:
                    break
                time.sleep(0.5)
            ok = chart.check(any(math.isfinite(v) for v in values),
                             f"panel '{title}': no data for {e}  (result: {result})", failures)
            print(f"{'ok  ' if ok else 'FAIL'} {title}: {e} -> {values[:4]}")

        for name in ("router", "worker"):
            procs[name].send_signal(signal.SIGTERM)
            rc = procs[name].wait(timeout=40)
            chart.check(rc == 0, f"{name} exited {rc} after SIGTERM", failures)
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                p.kill() if name != "prometheus" else p.terminate()
                p.wait(timeout=20)
        if failures:
            for log in ("router", "worker", "prometheus"):
                path = f"{work}/{log}.log"
                if os.path.exists(path):
                    print(f"--- {log}.log (last lines)\n" + "".join(open(path).readlines()[-15:]))
        shutil.rmtree(work, ignore_errors=True)
    chart.finish(failures, "dashboard queries against Prometheus")


main()
