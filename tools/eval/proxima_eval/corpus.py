"""Evaluation text.

Prose, two corpora (`eval --corpus`):
- `licenses` (the default): the licence texts in /usr/share/common-licenses/, shipped by Debian's
  `base-files` package (Priority: required, so present on every Debian machine; nothing to
  install). Long, real English prose, but only 21 windows of 768 tokens in all.
- `handbook`: The Debian Administrator's Handbook, the HTML of Debian's `debian-handbook` package
  (`scripts/eval-setup.sh --handbook` installs it), about 0.95 MB of English prose in 126 pages:
  hundreds of windows, for confidence intervals narrow enough to tell a 1% perplexity budget
  apart. Only its paragraphs are read (no code listings, command output or navigation).
Both are read at run time from the installed packages; nothing of them is copied into the
repository (the texts' own licences, GPL and CC-BY-SA, would allow it).

Generated: the model's own greedy continuations of a few varied prompts (computed at run time,
deterministic).
"""

from __future__ import annotations

import glob
import html.parser
import os
from typing import Dict, List

LICENSE_DIR = "/usr/share/common-licenses"
HANDBOOK_DIR = "/usr/share/doc/debian-handbook/html/en-US"
CORPORA = ("licenses", "handbook")
# Ordered by length; GPL-3 alone is ~7.8k tokens with SmolLM2's tokenizer.
PROSE_FILES = ["GPL-3", "GFDL-1.3", "MPL-2.0", "Apache-2.0"]

PROMPTS = [
    "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a "
    "bottle.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain how a refrigerator works, step by step.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome, "
    "and explain it.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat were the main causes of the French Revolution?<|im_end|>\n"
    "<|im_start|>assistant\n",
]


def prose_texts() -> Dict[str, str]:
    out = {}
    for name in PROSE_FILES:
        path = os.path.join(LICENSE_DIR, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                out[name] = f.read()
    if not out:
        raise FileNotFoundError(f"no prose files under {LICENSE_DIR} (Debian base-files)")
    return out


class _Paragraphs(html.parser.HTMLParser):
    """Collects the text of the handbook's `<div class="para">` elements, without what sits in
    `<pre>` inside them (commands, file listings)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: List[str] = []
        self._depth = 0  # open <div> elements since the paragraph's own, itself included
        self._pre = 0
        self._current: List[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "pre":
            self._pre += 1
        if tag != "div":
            return
        if self._depth:
            self._depth += 1
        elif ("class", "para") in attrs:
            self._depth = 1
            self._current = []

    def handle_endtag(self, tag):
        if tag == "pre":
            self._pre = max(0, self._pre - 1)
        if tag != "div" or not self._depth:
            return
        self._depth -= 1
        if not self._depth:
            text = " ".join("".join(self._current).split())
            if text:
                self.paragraphs.append(text)

    def handle_data(self, data):
        if self._depth and not self._pre:
            self._current.append(data)


def html_paragraphs(markup: str) -> str:
    """The paragraphs of one handbook page, one per line, whitespace collapsed."""
    p = _Paragraphs()
    p.feed(markup)
    p.close()
    return "\n".join(p.paragraphs)


def handbook_texts() -> Dict[str, str]:
    """Page name -> its paragraphs, for every page of the handbook but the table of contents."""
    paths = sorted(glob.glob(os.path.join(HANDBOOK_DIR, "*.html")))
    if not paths:
        raise FileNotFoundError(
            f"no pages under {HANDBOOK_DIR}: install Debian's debian-handbook package "
            "(scripts/eval-setup.sh --handbook)")
    out = {}
    for path in paths:
        name = os.path.basename(path)[:-len(".html")]
        if name == "index":
            continue
        with open(path, encoding="utf-8") as f:
            text = html_paragraphs(f.read())
        if text:
            out[name] = text
    return out


def texts(name: str) -> Dict[str, str]:
    if name == "licenses":
        return prose_texts()
    if name == "handbook":
        return handbook_texts()
    raise ValueError(f"unknown corpus {name!r}; expected one of {', '.join(CORPORA)}")


def windows(tokens: List[int], length: int, max_windows: int) -> List[List[int]]:
    """Non-overlapping windows of `length` tokens from the start of `tokens`."""
    return [tokens[i:i + length] for i in range(0, len(tokens) - length + 1, length)][:max_windows]
