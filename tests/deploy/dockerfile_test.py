"""deploy/docker/Dockerfile: dockerfile-utils lint (npm), and what the chart relies on: the runtime
stages run as a numeric non-root user, hold the binaries at the paths the chart's containers run,
expose the chart's default ports, and copy only from stages defined earlier."""
import os
import re
import subprocess

import chart
import yaml

DOCKERFILE = os.path.join(chart.REPO, "deploy", "docker", "Dockerfile")
chart.need_tools()
failures = []
lint = subprocess.run([os.path.join(chart.TOOLS, "node", "node_modules", ".bin", "dockerfile-utils"),
                       "lint", DOCKERFILE], capture_output=True, text=True)
chart.check(lint.returncode == 0 and not lint.stdout.strip(), f"dockerfile-utils lint:\n{lint.stdout}{lint.stderr}", failures)

# Instructions with continuation lines joined, grouped by stage.
text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
stages, current = {}, None
for line in text.splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    word, _, rest = line.partition(" ")
    if word.upper() == "FROM":
        m = re.match(r"(\S+)(?: AS (\S+))?", rest, re.I)
        current = m.group(2) or f"stage{len(stages)}"
        chart.check(current not in stages, f"stage {current} defined twice", failures)
        stages[current] = []
        base = m.group(1)
        if base in stages:
            stages[current] += stages[base]
    elif current:
        stages[current].append((word.upper(), rest))
        if word.upper() == "COPY" and "--from=" in rest:
            source = re.search(r"--from=(\S+)", rest).group(1)
            chart.check(source in stages and source != current, f"{current}: COPY --from={source} is no earlier stage", failures)

values = yaml.safe_load(open(os.path.join(chart.CHART, "values.yaml")))
ports = {values["router"]["grpcPort"], values["router"]["httpPort"], values["worker"]["port"],
         values["worker"]["metricsPort"]}
docs = chart.render(next(v for v in chart.CI_VALUES if v.endswith("cpu-values.yaml")))
commands = {c["command"][0] for _, _, t in chart.pod_templates(docs) for c in t["spec"]["containers"]}
commands |= {"/bin/sleep"}  # the preStop hook; both bases have coreutils
for target in ("runtime", "runtime-cpu"):
    if not chart.check(target in stages, f"no stage {target}", failures):
        continue
    ins = stages[target]
    users = [rest for word, rest in ins if word == "USER"]
    chart.check(users and re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]),
                f"{target}: last USER {users[-1:]} is not a numeric non-root user (runAsNonRoot needs one)", failures)
    copied = " ".join(rest for word, rest in ins if word == "COPY")
    for cmd in commands - {"/bin/sleep"}:
        name = os.path.basename(cmd)
        chart.check(re.search(rf"/{name}\b.* {os.path.dirname(cmd)}/", copied),
                    f"{target}: {cmd} (the chart's container command) is not copied there", failures)
    exposed = {int(p) for word, rest in ins if word == "EXPOSE" for p in rest.split()}
    chart.check(exposed == ports, f"{target}: EXPOSE {sorted(exposed)} != chart ports {sorted(ports)}", failures)
chart.finish(failures, "Dockerfile")
