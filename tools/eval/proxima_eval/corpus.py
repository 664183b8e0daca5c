"""Evaluation text.

Prose: the licence texts in /usr/share/common-licenses/, shipped by Debian's `base-files`
package (Priority: required, so present on every Debian machine; nothing to install). They are
long, real English prose. Their own terms allow verbatim copying and distribution; we do not copy
them into the repository, only read them at run time.

Generated: the model's own greedy continuations of a few varied prompts (computed at run time,
deterministic).
"""

from __future__ import annotations

import os
from typing import Dict, List

LICENSE_DIR = "/usr/share/common-licenses"
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


def windows(tokens: List[int], length: int, max_windows: int) -> List[List[int]]:
    """Non-overlapping windows of `length` tokens from the start of `tokens`."""
    return [tokens[i:i + length] for i in range(0, len(tokens) - length + 1, length)][:max_windows]
