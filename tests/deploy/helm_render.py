#!/usr/bin/env python3
"""Offline renderer for the subset of Helm's template language that helm/proxima uses.

Why this exists: Helm itself cannot be installed from the registries this project's machines
reach (no Debian 12 package; the PyPI wrappers of Helm's Go library need a live cluster to
render). Operators install the chart with the real `helm`; the tests render it with this file
to validate the manifests and to start proximad with the rendered config. The chart is kept
inside the subset below, and anything outside it is an error here, never a silent difference.

Supported (with Helm's meaning):
  {{ .Values.a.b }}  {{ .Release.Name }}  {{ .Release.Namespace }}  {{ .Release.Service }}
  {{ .Chart.Name }}  {{ .Chart.Version }}  {{ .Chart.AppVersion }}  {{ $.Values... }}
  "string literals", integers, true/false
  pipelines: a | f b   (the piped value is the last argument)
  functions: include, toYaml, nindent, indent, quote, default, required, fail, not, eq,
             printf (%s %d only), trunc, trimSuffix, sha256sum
  {{ if X }} ... {{ else }} ... {{ end }}   {{ define "name" }} ... {{ end }}
  {{- and -}} whitespace trimming, {{/* comments */}}
Not supported (an error): range, with, variables other than $, parentheses, else if.
A path that names no value renders as an error (Helm would print "<no value>" or "");
in `if`, `default`, `not` it is simply false/absent.

Usage: helm_render.py CHART_DIR [-f VALUES.yaml ...] [--set a.b=YAML ...]
       [--name RELEASE] [--namespace NS]      prints the manifests like `helm template`
"""
import argparse
import copy
import hashlib
import os
import re
import sys

import yaml


class RenderError(Exception):
    pass


class _Fail(RenderError):
    pass


_ACTION = re.compile(r"\{\{(-?)(\s*)(.*?)(\s*)(-?)\}\}", re.S)


def _lex(text):
    """Yields ('text', s) and ('action', s) with Helm's whitespace trimming applied."""
    out = []
    pos = 0
    for m in _ACTION.finditer(text):
        left, body, right = m.group(1), m.group(3), m.group(5)
        if left and not m.group(2):
            raise RenderError("'{{-' must be followed by a space: %r" % m.group(0))
        if right and not m.group(4):
            raise RenderError("'-}}' must be preceded by a space: %r" % m.group(0))
        chunk = text[pos:m.start()]
        if left:
            chunk = chunk.rstrip(" \t\r\n")
        out.append(["text", chunk])
        out.append(["action", body.strip(), bool(right)])
        pos = m.end()
    out.append(["text", text[pos:]])
    # Apply right-trims to the following text.
    for i, tok in enumerate(out):
        if tok[0] == "action" and tok[2] and i + 1 < len(out):
            out[i + 1][1] = out[i + 1][1].lstrip(" \t\r\n")
    return [(t[0], t[1]) for t in out if not (t[0] == "action" and t[1].startswith("/*"))]


def _parse(tokens, i=0, stop=("end",)):
    """Returns (nodes, index, terminator) where terminator is 'end' or 'else'."""
    nodes = []
    while i < len(tokens):
        kind, body = tokens[i]
        i += 1
        if kind == "text":
            if body:
                nodes.append(("text", body))
            continue
        word = body.split(None, 1)[0] if body else ""
        rest = body[len(word):].strip()
        if word in ("end", "else"):
            if word == "else" and rest:
                raise RenderError("'else %s' is outside the supported subset" % rest)
            if word not in stop:
                raise RenderError("unexpected {{ %s }}" % word)
            return nodes, i, word
        if word == "if":
            then, i, term = _parse(tokens, i, ("end", "else"))
            other = []
            if term == "else":
                other, i, _ = _parse(tokens, i, ("end",))
            nodes.append(("if", rest, then, other))
        elif word == "define":
            name = _literal(rest)
            inner, i, _ = _parse(tokens, i, ("end",))
            nodes.append(("define", name, inner))
        elif word in ("range", "with", "template", "block", "break", "continue"):
            raise RenderError("{{ %s }} is outside the supported subset" % word)
        else:
            nodes.append(("expr", body))
    return nodes, i, None


def _literal(text):
    m = re.fullmatch(r'"((?:[^"\\]|\\.)*)"', text.strip())
    if not m:
        raise RenderError("expected a string literal, got %r" % text)
    return bytes(m.group(1), "utf-8").decode("unicode_escape")


_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|[^\s|()]+|\||\(|\))')


def _truthy(v):
    return v not in (None, False, 0, "") and not (isinstance(v, (list, dict)) and not v)


class _Missing:
    """A path that names no value."""

    def __init__(self, path):
        self.path = path


def _plain(v):
    return None if isinstance(v, _Missing) else v


class Renderer:
    def __init__(self, chart_dir, values, release_name, namespace):
        self.chart_dir = chart_dir
        with open(os.path.join(chart_dir, "Chart.yaml")) as f:
            chart = yaml.safe_load(f)
        self.root = {
            "Values": values,
            "Release": {"Name": release_name, "Namespace": namespace, "Service": "Helm"},
            "Chart": {"Name": chart["name"], "Version": chart["version"],
                      "AppVersion": chart.get("appVersion", "")},
        }
        self.defines = {}
        tdir = os.path.join(chart_dir, "templates")
        self.templates = {}
        for name in sorted(os.listdir(tdir)):
            with open(os.path.join(tdir, name)) as f:
                nodes, _, term = _parse(_lex(f.read()))
            if term is not None:
                raise RenderError("%s: unmatched {{ %s }}" % (name, term))
            self.templates[name] = nodes
            for n in nodes:
                if n[0] == "define":
                    self.defines[n[1]] = n[2]

    # --- expressions ---
    def _value(self, tok, dot):
        if tok.startswith('"'):
            return _literal(tok)
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        if tok in ("true", "false"):
            return tok == "true"
        if tok == "nil":
            return None
        if tok == "." or tok == "$":
            return dot if tok == "." else self.root
        if tok.startswith(".") or tok.startswith("$."):
            cur = self.root if tok.startswith("$") else dot
            for part in tok.lstrip("$").strip(".").split("."):
                if isinstance(cur, dict) and part in cur:
                    cur = cur[part]
                else:
                    return _Missing(tok)
            return cur
        raise RenderError("cannot evaluate %r" % tok)

    def _call(self, name, args, dot):
        a = args
        if name == "include":
            if len(a) != 2 or a[0] not in self.defines:
                raise RenderError("include: no template %r" % (a[0] if a else None))
            return self._render(self.defines[a[0]], _plain(a[1]))
        if name == "toYaml":
            v = _plain(a[0])
            if v is None:
                return ""
            return yaml.safe_dump(v, default_flow_style=False, sort_keys=False).rstrip("\n")
        if name in ("nindent", "indent"):
            pad = " " * a[0]
            s = "\n".join(pad + line if line else line for line in str(self._str(a[1])).split("\n"))
            return "\n" + s if name == "nindent" else s
        if name == "quote":
            return '"%s"' % str(self._str(a[0])).replace("\\", "\\\\").replace('"', '\\"')
        if name == "default":
            return a[1] if _truthy(_plain(a[1])) else a[0]
        if name == "required":
            if not _truthy(_plain(a[1])):
                raise _Fail(a[0])
            return a[1]
        if name == "fail":
            raise _Fail(a[0])
        if name == "not":
            return not _truthy(_plain(a[0]))
        if name == "eq":
            return _plain(a[0]) == _plain(a[1])
        if name == "printf":
            fmt = a[0].replace("%d", "%s")
            return fmt % tuple(self._str(x) for x in a[1:])
        if name == "sha256sum":
            return hashlib.sha256(str(self._str(a[0])).encode()).hexdigest()
        if name == "trunc":
            return str(self._str(a[1]))[: a[0]]
        if name == "trimSuffix":
            s = str(self._str(a[1]))
            return s[: -len(a[0])] if a[0] and s.endswith(a[0]) else s
        raise RenderError("function %r is outside the supported subset" % name)

    def _pipeline(self, text, dot):
        toks = _TOKEN.findall(text)
        if "(" in toks or ")" in toks:
            raise RenderError("parentheses are outside the supported subset: %r" % text)
        if any(t.startswith("$") and not (t == "$" or t.startswith("$.")) for t in toks):
            raise RenderError("variables are outside the supported subset: %r" % text)
        cmds, cur = [], []
        for t in toks:
            if t == "|":
                cmds.append(cur)
                cur = []
            else:
                cur.append(t)
        cmds.append(cur)
        piped = None
        first = True
        for cmd in cmds:
            if not cmd:
                raise RenderError("empty command in %r" % text)
            head = cmd[0]
            is_func = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head) and head not in (
                "true", "false", "nil")
            if is_func:
                args = [self._value(t, dot) for t in cmd[1:]]
                if not first:
                    args.append(piped)
                piped = self._call(head, args, dot)
            else:
                if len(cmd) != 1 or not first:
                    raise RenderError("cannot evaluate %r" % text)
                piped = self._value(head, dot)
            first = False
        return piped

    def _str(self, v):
        if isinstance(v, _Missing):
            raise RenderError("%s names no value" % v.path)
        if v is None:
            raise RenderError("a value renders as nil")
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (dict, list)):
            raise RenderError("a map or list must go through toYaml")
        return v

    # --- templates ---
    def _render(self, nodes, dot):
        out = []
        for n in nodes:
            if n[0] == "text":
                out.append(n[1])
            elif n[0] == "expr":
                out.append(str(self._str(self._pipeline(n[1], dot))))
            elif n[0] == "if":
                branch = n[2] if _truthy(_plain(self._pipeline(n[1], dot))) else n[3]
                out.append(self._render(branch, dot))
            elif n[0] == "define":
                pass
        return "".join(out)

    def render(self):
        """Returns {template name: rendered text} for every template, NOTES.txt included."""
        out = {}
        for name, nodes in self.templates.items():
            if name.startswith("_"):
                continue
            try:
                out[name] = self._render(nodes, self.root)
            except _Fail as e:
                raise _Fail("execution error at (%s): %s" % (name, e))
            except RenderError as e:
                raise RenderError("%s: %s" % (name, e))
        return out


def deep_merge(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def set_path(values, dotted, value):
    cur = values
    parts = dotted.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value


def load_values(chart_dir, files=(), sets=()):
    with open(os.path.join(chart_dir, "values.yaml")) as f:
        values = yaml.safe_load(f) or {}
    for path in files:
        with open(path) as f:
            values = deep_merge(values, yaml.safe_load(f) or {})
    for s in sets:
        key, _, raw = s.partition("=")
        set_path(values, key, yaml.safe_load(raw) if raw else "")
    return values


def template(chart_dir, values, release_name="proxima", namespace="proxima"):
    """Like `helm template`: returns (manifest documents as dicts, NOTES.txt text)."""
    rendered = Renderer(chart_dir, values, release_name, namespace).render()
    docs = []
    for name, text in rendered.items():
        if name == "NOTES.txt":
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return docs, rendered.get("NOTES.txt", "")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("chart")
    p.add_argument("-f", "--values", action="append", default=[])
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--name", default="proxima")
    p.add_argument("--namespace", default="proxima")
    p.add_argument("--notes", action="store_true", help="print NOTES.txt instead")
    a = p.parse_args()
    try:
        values = load_values(a.chart, a.values, a.set)
        rendered = Renderer(a.chart, values, a.name, a.namespace).render()
    except RenderError as e:
        print("Error: %s" % e, file=sys.stderr)
        return 1
    if a.notes:
        sys.stdout.write(rendered.get("NOTES.txt", ""))
        return 0
    for name, text in rendered.items():
        if name != "NOTES.txt" and text.strip():
            sys.stdout.write("---\n# Source: %s/templates/%s\n%s\n" % (
                os.path.basename(os.path.abspath(a.chart)), name, text.strip("\n")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
