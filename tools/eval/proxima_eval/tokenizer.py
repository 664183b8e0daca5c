"""Byte-level BPE tokenizer rebuilt from the vocabulary and merges stored in a GGUF file
(tokenizer.ggml.model == "gpt2"), with the HuggingFace `tokenizers` library doing the work.

Pre-tokenization follows the file's tokenizer.ggml.pre: "smollm" splits every digit on its own
before the GPT-2 byte-level regex (as SmolLM2's tokenizer.json does); other values get the plain
GPT-2 regex, which is what most Llama-architecture BPE files use or close to it.
"""

from __future__ import annotations

from typing import List

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

_CONTROL = 3  # llama.cpp token type for control tokens (<|im_start|>, <|endoftext|>, ...)


class GGUFTokenizer:
    def __init__(self, model):
        if model.tokenizer_model != "gpt2":
            raise ValueError(
                f"tokenizer model {model.tokenizer_model!r} is not supported (only gpt2 BPE)")
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
            from tokenizers import AddedToken
            tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
        self._tk = tk
        self.bos_id = model.config.bos_token_id
        self.eos_id = model.config.eos_token_id
        self.add_bos = model.config.add_bos

    def encode(self, text: str, add_bos: bool | None = None) -> List[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: List[int]) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=False)
