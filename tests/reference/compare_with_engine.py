"""Compares `mobius generate` with the references written by make_qwen3next_references.py.

    python3 tests/reference/compare_with_engine.py build/bin/mobius REF_DIR [REF_DIR ...]
Prints the relative logits error (max|a-b| / max|b|) and whether the 8 greedy tokens match;
exits non-zero when the error is over 1e-3 or a token differs. Needs only the standard library.
"""
import array
import json
import os
import struct
import subprocess
import sys
import tempfile


EXTRA = [a for a in sys.argv[2:] if a.startswith("--")]  # passed through to mobius generate


def read_logits(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        begin, end = header["logits"]["data_offsets"]
        f.seek(8 + n + begin)
        values = array.array("f")
        values.frombytes(f.read(end - begin))
    return values


def main(binary, dirs):
    ok = True
    for d in dirs:
        with open(os.path.join(d, "reference.json")) as f:
            ref = json.load(f)
        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "logits.safetensors")
            out = subprocess.run(
                [binary, "generate", "--model", d, "--prompt-ids",
                 ",".join(map(str, ref["prompt"])), "--max-tokens", str(len(ref["greedy"])),
                 "--dump-logits", dump] + EXTRA, check=True, capture_output=True, text=True).stdout
            logits = read_logits(dump)
        tokens = json.loads(out)["token_ids"]
        max_ref = max(abs(x) for x in ref["logits"])
        err = max(abs(a - b) for a, b in zip(logits, ref["logits"])) / max_ref
        same = tokens == ref["greedy"]
        print(f"{os.path.basename(d.rstrip('/'))}: logits rel err {err:.2e}, greedy "
              f"{'identical' if same else 'DIFFERENT: %s vs %s' % (tokens, ref['greedy'])}")
        ok = ok and err < 1e-3 and same and len(logits) == len(ref["logits"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("--")]))
