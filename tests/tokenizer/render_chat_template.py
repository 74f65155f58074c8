#!/usr/bin/env python3
"""Renders chat conversations with a Hugging Face tokenizer_config.json's Jinja chat template, the
way transformers' apply_chat_template does (sandboxed Jinja with trim_blocks, lstrip_blocks and
loop controls; `tojson` as json.dumps with ensure_ascii=False), so that tests can compare the
C++ renderer with the template itself.

Usage: render_chat_template.py TOKENIZER_CONFIG CASES_JSON
CASES_JSON holds a list of {"messages": [...], "tools": [...] or null, "add_generation_prompt": bool,
"enable_thinking": bool (optional)}.
Prints a JSON list with, per case, {"prompt": str, "tools": [tojson(tool), ...]}.
"""
import json
import sys

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter (chat_template_utils._compile_jinja_template).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        template_text = json.load(f)["chat_template"]
    with open(sys.argv[2], encoding="utf-8") as f:
        cases = json.load(f)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    template = env.from_string(template_text)
    out = []
    for case in cases:
        tools = case.get("tools")
        extra = {"enable_thinking": case["enable_thinking"]} if "enable_thinking" in case else {}
        prompt = template.render(messages=case["messages"], tools=tools,
                                 add_generation_prompt=case["add_generation_prompt"], **extra)
        out.append({"prompt": prompt, "tools": [tojson(t) for t in (tools or [])]})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
