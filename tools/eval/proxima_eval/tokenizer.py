"""Tokenizers rebuilt from the vocabulary stored in a GGUF file.

Two kinds, by tokenizer.ggml.model:

- "gpt2": byte-level BPE from the file's vocabulary and merges, with the HuggingFace `tokenizers`
  library doing the work. Pre-tokenization follows tokenizer.ggml.pre: "smollm" splits every
  digit on its own before the GPT-2 byte-level regex (as SmolLM2's tokenizer.json does); other
  values get the plain GPT-2 regex, which is what most Llama-architecture BPE files use.
- "llama": SentencePiece BPE (Llama 1/2, Mistral, TinyLlama, ...). Spaces become "▁" (U+2581)
  and one "▁" goes in front of the text (tokenizer.ggml.add_space_prefix, default true); the
  text starts as one symbol per character, and the adjacent pair whose concatenation is a piece
  with the highest score (tokenizer.ggml.scores) is merged, leftmost first among equal scores,
  until no pair is a piece. A symbol left that is not a piece becomes its UTF-8 bytes as
  "<0xXX>" byte pieces (byte fallback), or the unknown piece when the file has none. This is
  SentencePiece's own BPE encoding, and tests/test_tokenizer.py checks it id for id against the
  `sentencepiece` package.

In both, control pieces (token type 3, e.g. "<s>", "<|im_start|>") written in the text are
recognised as themselves; SentencePiece files also match user-defined pieces (type 4) whole, and
a "▁" prefix follows each such piece as at the start of the text.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


class GGUFTokenizer:
    """The tokenizer a GGUF file declares; ValueError for kinds that are not supported."""

    def __init__(self, model):
        kind = model.tokenizer_model
        if kind == "gpt2":
            self._impl = _ByteLevelBPE(model)
        elif kind == "llama":
            self._impl = SentencePieceBPE(
                model.tokens, model.token_scores, model.token_types,
                add_space_prefix=getattr(model, "add_space_prefix", True),
                unk_id=getattr(model, "unk_token_id", None))
        else:
            raise ValueError(f"tokenizer model {kind!r} is not supported "
                             "(gpt2 byte-level BPE, llama SentencePiece BPE)")
        self.bos_id = model.config.bos_token_id
        self.eos_id = model.config.eos_token_id
        self.add_bos = model.config.add_bos

    def encode(self, text: str, add_bos: bool | None = None) -> List[int]:
        ids = self._impl.encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: List[int]) -> str:
        return self._impl.decode(list(ids))


class _ByteLevelBPE:
    def __init__(self, model):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        vocab = {tok: i for i, tok in enumerate(model.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in model.merges]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        steps = []
        if model.tokenizer_pre in ("smollm",):
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tk.decoder = decoders.ByteLevel()
        special = [t for t, ty in zip(model.tokens, model.token_types) if ty == _CONTROL]
        if special:
            tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
        self._tk = tk

    def encode(self, text: str) -> List[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: List[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=False)


class SentencePieceBPE:
    """SentencePiece BPE encoding from pieces, scores and token types (see the module doc)."""

    def __init__(self, pieces: Sequence[str], scores: Sequence[float], types: Sequence[int],
                 add_space_prefix: bool = True, unk_id: Optional[int] = None):
        if len(scores) != len(pieces) or len(types) != len(pieces):
            raise ValueError(f"SentencePiece vocabulary: {len(pieces)} pieces but {len(scores)} "
                             f"scores and {len(types)} token types (expected one of each per piece)")
        self._pieces = list(pieces)
        self._add_space_prefix = add_space_prefix
        # Pieces that merges may produce: normal ones. Control and user-defined pieces are
        # matched whole in the text before merging (as llama.cpp does); byte, unknown and unused
        # pieces never result from merging characters.
        self._mergeable: Dict[str, tuple] = {}
        self._bytes: Dict[int, int] = {}
        self._control: List[tuple] = []
        for i, (p, s, t) in enumerate(zip(pieces, scores, types)):
            t = int(t)
            if t == _NORMAL:
                self._mergeable.setdefault(p, (float(s), i))
            elif t == _BYTE and len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
                self._bytes[int(p[3:5], 16)] = i
            elif t in (_CONTROL, _USER_DEFINED) and p:
                self._control.append((p, i))
            if unk_id is None and t == _UNKNOWN:
                unk_id = i
        self._unk_id = unk_id
        self._types = [int(t) for t in types]
        # Longest first, so that "<|im_start|>" is not read as a shorter control piece.
        self._control.sort(key=lambda c: -len(c[0]))

    def encode(self, text: str) -> List[int]:
        ids: List[int] = []
        after_control = True  # a space prefix goes at the start and after every control piece
        for fragment, control_id in self._split_control(text):
            if control_id is not None:
                ids.append(control_id)
                after_control = True
                continue
            if self._add_space_prefix and after_control:
                fragment = " " + fragment
            ids.extend(self._encode_fragment(fragment.replace(" ", _SPACE)))
            after_control = False
        return ids

    def decode(self, ids: List[int]) -> str:
        out = bytearray()
        for i in ids:
            if not 0 <= i < len(self._pieces):
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self._pieces) - 1})")
            piece = self._pieces[i]
            if self._types[i] == _BYTE:
                out.append(int(piece[3:5], 16))
            else:
                out.extend(piece.replace(_SPACE, " ").encode("utf-8"))
        text = out.decode("utf-8", errors="replace")
        if self._add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def _split_control(self, text: str):
        """(fragment, None) for plain text and ("", id) for each control piece, in order."""
        if not self._control:
            yield text, None
            return
        start = pos = 0
        while pos < len(text):
            for piece, i in self._control:
                if text.startswith(piece, pos):
                    if pos > start:
                        yield text[start:pos], None
                    yield "", i
                    pos += len(piece)
                    start = pos
                    break
            else:
                pos += 1
        if start < len(text):
            yield text[start:], None

    def _encode_fragment(self, text: str) -> List[int]:
        if not text:
            return []
        # Symbols as a doubly linked list over the characters; `text_of[i]` is symbol i's text,
        # "" once it has been merged into its left neighbour.
        n = len(text)
        text_of = list(text)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list = []

        def push(left: int) -> None:
            right = nxt[left]
            if right == -1:
                return
            merged = text_of[left] + text_of[right]
            found = self._mergeable.get(merged)
            if found is not None:
                # heapq is a min-heap: highest score first, then the leftmost pair.
                heapq.heappush(heap, (-found[0], left, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left]
            # Stale when either side changed since the pair was pushed.
            if right == -1 or text_of[left] + text_of[right] != merged or not text_of[left]:
                continue
            text_of[left] = merged
            text_of[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prev[nxt[right]] = left
            if prev[left] != -1:
                push(prev[left])
            push(left)

        ids: List[int] = []
        i = 0
        while i != -1:
            symbol = text_of[i]
            found = self._mergeable.get(symbol)
            if found is not None:
                ids.append(found[1])
            else:
                for b in symbol.encode("utf-8"):
                    byte_id = self._bytes.get(b)
                    if byte_id is not None:
                        ids.append(byte_id)
                    elif self._unk_id is not None:
                        ids.append(self._unk_id)
                    else:
                        raise ValueError(f"text {symbol!r} has no piece, no byte piece for 0x{b:02X} "
                                         "and the vocabulary has no unknown piece")
            i = nxt[i]
        return ids
