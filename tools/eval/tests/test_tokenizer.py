"""The GGUF tokenizers: SentencePiece BPE id for id against the `sentencepiece` package, byte
fallback, control pieces, and a Llama-2-style GGUF file (SentencePiece vocabulary) that loads and
runs instead of being refused."""

import os
import types

import numpy as np
import pytest

from proxima_eval import corpus
from proxima_eval.tokenizer import GGUFTokenizer, SentencePieceBPE

import tiny_gguf

SP = "\u2581"


def _vocab(pieces):
    """(pieces, scores, types) from [(piece, score, type)]."""
    return [p for p, _, _ in pieces], [s for _, s, _ in pieces], [t for _, _, t in pieces]


def test_merges_follow_scores_then_position():
    p, s, t = _vocab([("<unk>", 0, 2), ("<s>", 0, 3), (SP, -1, 1), ("a", -2, 1), ("b", -2, 1),
                      ("ab", -5, 1), ("ba", -4, 1), (SP + "a", -3, 1), ("aba", -6, 1)])
    tok = SentencePieceBPE(p, s, t)
    # "▁aba": pairs ▁a (-3), ab (-5), ba (-4): ▁a first, then b+a -> "ba"; "▁aba" is no piece.
    assert [p[i] for i in tok.encode("aba")] == [SP + "a", "ba"]
    # Without the space prefix: "ab" (-5) and "ba" (-4): ba wins, then a + ba is "aba" (-6).
    tok2 = SentencePieceBPE(p, s, t, add_space_prefix=False)
    assert [p[i] for i in tok2.encode("aba")] == ["aba"]
    # "abab": ba (-4) in the middle first, then a + ba; "bab" is no piece.
    assert [p[i] for i in tok2.encode("abab")] == ["aba", "b"]
    # Equal scores: the leftmost pair merges first.
    p3, s3, t3 = _vocab([("<unk>", 0, 2), ("a", -1, 1), ("aa", -2, 1)])
    tok3 = SentencePieceBPE(p3, s3, t3, add_space_prefix=False)
    assert [p3[i] for i in tok3.encode("aaa")] == ["aa", "a"]


def test_byte_fallback_unknown_and_control_pieces():
    pieces = [("<unk>", 0, 2), ("<s>", 0, 3), ("</s>", 0, 3), (SP, -1, 1), ("h", -2, 1),
              ("i", -2, 1), (SP + "h", -3, 1), ("hi", -4, 1)]
    pieces += [(f"<0x{b:02X}>", 0, 6) for b in range(256)]
    p, s, t = _vocab(pieces)
    tok = SentencePieceBPE(p, s, t)
    ids = tok.encode("hi é</s>hi")
    names = [p[i] for i in ids]
    # "é" is not a piece: its two UTF-8 bytes; after the control piece a new "▁" prefix.
    assert names == [SP + "h", "i", SP, "<0xC3>", "<0xA9>", "</s>", SP + "h", "i"]
    assert tok.decode(ids) == "hi é</s> hi"
    no_bytes = SentencePieceBPE(*_vocab(pieces[:8]))
    assert [p[i] for i in no_bytes.encode("é")] == [SP, "<unk>", "<unk>"]


def test_bad_vocabulary_and_ids_are_refused():
    with pytest.raises(ValueError, match="2 pieces but 1 scores"):
        SentencePieceBPE(["a", "b"], [0.0], [1, 1])
    tok = SentencePieceBPE(["<unk>", "a"], [0.0, -1.0], [2, 1])
    with pytest.raises(ValueError, match="token id 7 is outside the vocabulary"):
        tok.decode([7])


@pytest.fixture(scope="module")
def trained_sp(tmp_path_factory):
    """A SentencePiece BPE model trained here on Debian's licence texts (byte fallback, no
    normalisation: the same pieces a Llama-style tokenizer.model holds)."""
    spm = pytest.importorskip("sentencepiece", reason="scripts/eval-setup.sh installs sentencepiece")
    texts = corpus.prose_texts()
    if len(texts) < 2:
        pytest.skip("needs two licence texts in /usr/share/common-licenses")
    names = sorted(texts)
    train = tmp_path_factory.mktemp("spm") / "train.txt"
    train.write_text("\n".join(texts[n] for n in names[1:]), encoding="utf-8")
    prefix = str(train.parent / "m")
    spm.SentencePieceTrainer.train(
        input=str(train), model_prefix=prefix, vocab_size=1200, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    return sp, texts[names[0]]


def _from_sp(sp):
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]

    def kind(i):
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        if sp.is_unused(i):
            return 5
        return 1

    return pieces, scores, [kind(i) for i in range(n)]


def test_matches_sentencepiece_id_for_id(trained_sp):
    sp, held_out = trained_sp
    tok = SentencePieceBPE(*_from_sp(sp))
    samples = [held_out[i:i + 600] for i in range(0, min(len(held_out), 12000), 600)]
    samples += ["naïve café — 東京 🙂 x²", "  two  spaces, a\ttab\nand a newline ", "1234567 89"]
    for text in samples:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))


def test_llama2_style_gguf_loads_tokenizes_and_runs(trained_sp, tmp_path):
    from proxima_eval.gguf_model import GGUFModel
    from proxima_eval.llama import LlamaModel
    sp, held_out = trained_sp
    path = tmp_path / "tiny-spm.gguf"
    pieces, scores, kinds = _from_sp(sp)
    tiny_gguf.write_tiny_llama(path, pieces, scores, kinds, sp.bos_id(), sp.eos_id())
    gm = GGUFModel(str(path))
    assert gm.tokenizer_model == "llama"
    tok = GGUFTokenizer(gm)
    text = held_out[:300]
    ids = tok.encode(text)
    assert ids[0] == sp.bos_id() and ids[1:] == sp.encode(text)
    assert tok.decode(ids[1:]) == text
    logits = LlamaModel(gm, kv_dtype="fp32").forward(ids[:16])[0]
    assert logits.shape[-1] == sp.get_piece_size()
    assert np.isfinite(logits).all()


def test_unsupported_tokenizer_kind_is_named():
    fake = types.SimpleNamespace(tokenizer_model="rwkv", config=None)
    with pytest.raises(ValueError, match="'rwkv' is not supported"):
        GGUFTokenizer(fake)
