#!/usr/bin/env python3
"""Renders chat templates as transformers' `apply_chat_template` does, as the reference for Tandem's renderer
(engine/tests/llamacpp_templates.rs): Jinja2's sandbox with trim_blocks and lstrip_blocks, loop controls, the
`{% generation %}` tag (which only marks the assistant's text), `tojson` as Python's json.dumps, `raise_exception`
and `strftime_now`. transformers itself is not needed, only Jinja2 (scripts/e2e/requirements.txt).

Reads a JSON list of cases on stdin, each {"template", "bos_token", "eos_token", "messages", "tools",
"add_generation_prompt", "arguments"}, and writes a JSON list of results, each {"text": ...} or {"error": ...}. Where
the sandbox refuses a template that changes a list in place (`ns.ids.append(x)`, Kimi K2's), the error comes with
"in_place": the text Jinja2's sandbox that allows it renders (llama.cpp's renderer renders such templates too).
"""

import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment


class Generation(Extension):
    """transformers' AssistantTracker without the tracking: `{% generation %}...{% endgeneration %}` renders its
    body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def environment(kind=ImmutableSandboxedEnvironment):
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(env, case):
    try:
        template = env.from_string(case["template"])
        kwargs = dict(case.get("arguments") or {})
        text = template.render(
            messages=case["messages"],
            tools=case.get("tools") or None,
            add_generation_prompt=case["add_generation_prompt"],
            bos_token=case["bos_token"],
            eos_token=case["eos_token"],
            **kwargs,
        )
        return {"text": text}
    except Exception as e:  # the reference's refusal, compared with Tandem's
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    env, in_place = environment(), environment(SandboxedEnvironment)
    out = []
    for case in json.load(sys.stdin):
        result = render(env, case)
        if result.get("error", "").startswith("SecurityError") and "of 'list' object is unsafe" in result["error"]:
            result["in_place"] = render(in_place, case).get("text")
        out.append(result)
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
