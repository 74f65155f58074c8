// Validates rendered manifests (a JSON array on stdin) against the Kubernetes API schemas that
// npm's kubernetes-models compiles from the OpenAPI spec (types, required fields, enums, formats),
// plus the Prometheus Operator and KEDA CRD schemas. The OpenAPI schemas allow unknown fields (the
// API server drops them silently), so field names of core objects are also checked strictly
// against the models' type declarations: a misspelt field fails here instead of vanishing.
// LeaderWorkerSet has no published model: its pod templates are checked as PodTemplateSpecs.
// usage: node validate_k8s.mjs NODE_MODULES_DIR < manifests.json; prints one line per object.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const load = (p) => import(pathToFileURL(path.join(modules, p)).href);

const crds = {
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/index.js",
  "keda.sh/v1alpha1": "@kubernetes-models/keda/keda.sh/v1alpha1/index.js",
};

function modelDir(apiVersion) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  return path.join("kubernetes-models", group, version);
}

// Strict field names: the properties of the interface declared in a .d.ts, recursively.
const declCache = new Map();
function declaration(file) {
  if (declCache.has(file)) return declCache.get(file);
  const text = fs.readFileSync(file, "utf8");
  const imports = new Map();
  for (const m of text.matchAll(/import \{ (\w+) \} from "([^"]+)";/g)) {
    const target = m[2].startsWith(".")
      ? path.join(path.dirname(file), m[2].replace(/\.js$/, ".d.ts"))
      : path.join(modules, m[2].replace(/\.js$/, "") + ".d.ts");
    imports.set(m[1], target);
  }
  const start = text.search(/export interface I\w+(?: extends [\w, ]+)? \{/);
  const props = new Map();
  if (start >= 0) {
    const lines = text.slice(text.indexOf("{", start) + 1).split("\n");
    let depth = 0;
    let current = null;
    for (const line of lines) {
      if (depth === 0) {
        if (/^\}/.test(line)) break;
        const m = line.match(/^ {4}"([^"]+)"\??: (.*)$/);
        if (m) {
          current = m[1];
          props.set(current, m[2]);
        }
      } else if (current) {
        props.set(current, props.get(current) + " " + line.trim());
      }
      depth += (line.match(/\{/g) || []).length - (line.match(/\}/g) || []).length;
    }
  }
  const decl = { props, imports };
  declCache.set(file, decl);
  return decl;
}

function checkFields(value, file, where, errors) {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return;
  const { props, imports } = declaration(file);
  if (props.size === 0) return;
  for (const [key, child] of Object.entries(value)) {
    const type = props.get(key);
    if (type === undefined) {
      errors.push(`${where}.${key}: unknown field (known: ${[...props.keys()].join(", ")})`);
      continue;
    }
    const ref = type.match(/\b(I\w+)\b/);
    const target = ref && imports.get(ref[1]);
    if (!target || !fs.existsSync(target)) continue;
    if (/^Array</.test(type)) {
      (child || []).forEach((c, i) => checkFields(c, target, `${where}.${key}[${i}]`, errors));
    } else if (/^\{ \[key: string\]/.test(type)) {
      for (const [k, c] of Object.entries(child || {})) checkFields(c, target, `${where}.${key}.${k}`, errors);
    } else {
      checkFields(child, target, `${where}.${key}`, errors);
    }
  }
}

const lwsFields = {
  spec: ["replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"],
  leaderWorkerTemplate: ["leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"],
};

const docs = JSON.parse(fs.readFileSync(0, "utf8"));
let failed = 0;
for (const doc of docs) {
  const name = `${doc.kind}/${doc.metadata?.name}`;
  const errors = [];
  try {
    if (doc.apiVersion === "leaderworkerset.x-k8s.io/v1" && doc.kind === "LeaderWorkerSet") {
      const { PodTemplateSpec } = await load("kubernetes-models/v1/index.js");
      const spec = doc.spec || {};
      const t = spec.leaderWorkerTemplate || {};
      for (const k of Object.keys(spec)) if (!lwsFields.spec.includes(k)) errors.push(`spec.${k}: unknown field`);
      for (const k of Object.keys(t)) if (!lwsFields.leaderWorkerTemplate.includes(k)) errors.push(`spec.leaderWorkerTemplate.${k}: unknown field`);
      if (!Number.isInteger(t.size) || t.size < 1) errors.push("spec.leaderWorkerTemplate.size must be a positive integer");
      if (!["RecreateGroupOnPodRestart", "None"].includes(t.restartPolicy)) errors.push("spec.leaderWorkerTemplate.restartPolicy");
      if (!["LeaderCreated", "LeaderReady", undefined].includes(spec.startupPolicy)) errors.push("spec.startupPolicy");
      if (!t.workerTemplate) errors.push("spec.leaderWorkerTemplate.workerTemplate is required");
      for (const key of ["leaderTemplate", "workerTemplate"]) {
        if (!t[key]) continue;
        try { new PodTemplateSpec(t[key]).validate(); } catch (e) { errors.push(`${key}: ${e.message}`); }
        checkFields(t[key], path.join(modules, "kubernetes-models/v1/PodTemplateSpec.d.ts"),
                    `spec.leaderWorkerTemplate.${key}`, errors);
      }
    } else if (crds[doc.apiVersion]) {
      const Kind = (await load(crds[doc.apiVersion]))[doc.kind];
      if (!Kind) throw new Error(`no schema for ${doc.apiVersion} ${doc.kind}`);
      new Kind(doc).validate();
    } else {
      const dir = modelDir(doc.apiVersion);
      const Kind = (await load(path.join(dir, "index.js")))[doc.kind];
      if (!Kind) throw new Error(`no schema for ${doc.apiVersion} ${doc.kind}`);
      new Kind(doc).validate();
      checkFields(doc, path.join(modules, dir, `${doc.kind}.d.ts`), doc.kind, errors);
    }
  } catch (e) {
    errors.push(e.message);
  }
  if (errors.length) {
    failed++;
    console.log(`FAIL ${doc.apiVersion} ${name}\n  ${errors.join("\n  ")}`);
  } else {
    console.log(`ok   ${doc.apiVersion} ${name}`);
  }
}
process.exit(failed ? 1 : 0);
