#!/usr/bin/env python3
"""Writes tests/data/serve/dsv3_chat_tokenizer.json: a byte-level tokenizer of 256 ids for the
DeepSeek-V3 parity model (tests/data/parity/dsv3, vocab_size 256), so that the server can be
tested in DeepSeek-V3's chat format. Ids 0-5 are the format's special tokens (begin and end of
sentence, User, Assistant, <think>, </think>); ids 6-255 are the bytes 0x06-0xFF, one token each,
no merges (the control bytes 0x00-0x05 have no token). The pre-tokenizer and decoder are
DeepSeek-V3's (from tests/data/tokenizer/deepseek_v3_style.json).

    python3 tools/make_dsv3_chat_tokenizer.py   (no packages needed)
"""
import json
import pathlib

root = pathlib.Path(__file__).resolve().parent.parent
style = json.loads((root / "tests/data/tokenizer/deepseek_v3_style.json").read_text())


def bytes_to_unicode():
    """GPT-2's byte-to-character map that byte-level BPE vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<think>", "</think>"]
spelled = bytes_to_unicode()
vocab = {token: i for i, token in enumerate(specials)}
for byte in range(len(specials), 256):
    vocab[spelled[byte]] = byte
tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}
                     for i, t in enumerate(specials)],
    "normalizer": None,
    "pre_tokenizer": style["pre_tokenizer"],
    "post_processor": None,
    "decoder": style["decoder"],
    "model": {"type": "BPE", "dropout": None, "unk_token": None,
              "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
              "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": []},
}
out = root / "tests/data/serve/dsv3_chat_tokenizer.json"
out.write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1) + "\n")
print(f"wrote {out} ({len(vocab)} ids)")
