"""helm lint --strict and helm template for every values file in the chart's ci/ folder; the
values schema and the chart's own checks refuse values that cannot work."""
import chart

chart.need_tools()
failures = []
for values in chart.CI_VALUES:
    lint = chart.helm("lint", "--strict", chart.CHART, "-f", values, check=False)
    chart.check(lint.returncode == 0, f"helm lint {values}:\n{lint.stdout}{lint.stderr}", failures)
    try:
        docs = chart.render(values)
        print(f"ok: {len(docs)} objects from {values}")
    except RuntimeError as e:
        failures.append(str(e))

# Values that must be refused, and the words the refusal must carry.
cpu = next(v for v in chart.CI_VALUES if v.endswith("cpu-values.yaml"))
refused = [
    (["worker.parallel.tp=0"], "worker.parallel.tp"),
    (["worker.device=gpu"], "worker.device"),
    (["worker.paralel.tp=2"], "paralel"),
    (["model.source=s3"], "model.source"),
    (["model.source=pvc"], "model.pvc.claimName is required"),
    (["worker.parallel.tp=2", "autoscaling.worker.enabled=true"], "LeaderWorkerSet"),
    (["metrics.serviceMonitor.interval=fast"], "interval"),
    # TP and EP share the ranks: each degree is 1 or the larger one (mobius-worker refuses others).
    (["worker.parallel.tp=2", "worker.parallel.ep=4"], "must each be 1 or the larger"),
    (["worker.parallel.ep=2", "worker.parallel.expertPlacement=load-aware"], "expertLoadFile"),
    (["worker.specTokens=-1"], "specTokens"),
    (["worker.specTokens=0", "worker.specTokenMap=/models/m/hot.json"], "specTokenMap"),
]
for sets, words in refused:
    try:
        chart.render(cpu, sets)
        failures.append(f"--set {' '.join(sets)} rendered; it should be refused")
    except RuntimeError as e:
        chart.check(words in str(e), f"--set {' '.join(sets)}: refusal without {words!r}: {e}", failures)
chart.finish(failures, "chart lint")
