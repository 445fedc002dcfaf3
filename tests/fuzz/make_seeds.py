#!/usr/bin/env python3
"""Writes the seed corpora under tests/fuzz/corpus/<target>/ from the repository's test data.

Run from anywhere: python3 tests/fuzz/make_seeds.py. Deterministic; standard library only.
Existing regression inputs (corpus/<target>/regress-*) are left alone.
"""
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"


def write(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


def safetensors(header, data=b""):
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    write("safetensors_header", "empty", safetensors({}))
    write("safetensors_header", "metadata_only", safetensors({"__metadata__": {"format": "pt"}}))
    tensors = {
        "__metadata__": {"format": "pt"},
        "a.f32": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b.bf16": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
        "c.fp8": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [32, 36]},
        "d.scalar": {"dtype": "F32", "shape": [], "data_offsets": [36, 40]},
        "e.empty": {"dtype": "I64", "shape": [0, 7], "data_offsets": [40, 40]},
        "f.u8": {"dtype": "U8", "shape": [3], "data_offsets": [40, 43]},
    }
    write("safetensors_header", "mixed", safetensors(tensors, bytes(range(43))))
    # The first tensors of a real shard, offsets rebased onto a small data section.
    path = ROOT / "tests/data/parity/glm52/model/model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    small, offset = {"__metadata__": header.get("__metadata__", {})}, 0
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        if size > 256:
            continue
        small[name] = dict(entry, data_offsets=[offset, offset + size])
        offset += size
        if len(small) > 6:
            break
    write("safetensors_header", "glm52_small", safetensors(small, bytes(offset)))


def config_seeds():
    for name in ["dsv3", "glm5", "glm52", "kimi"]:
        text = (ROOT / f"tests/data/parity/{name}/model/config.json").read_text()
        write("config_json", name, text)
        write("generation_config_json", name,
              (ROOT / f"tests/data/parity/{name}/model/generation_config.json").read_text())
    kjv = json.loads((ROOT / "models/glm5-tiny-kjv/config.json").read_text())
    write("config_json", "glm5_tiny_kjv", json.dumps(kjv, indent=1))
    write("generation_config_json", "glm5_tiny_kjv",
          (ROOT / "models/glm5-tiny-kjv/generation_config.json").read_text())
    # Branches the committed configs do not take: v4 rope_scaling (yarn), fp8 quantization,
    # the layer-kind fields spelled the other ways.
    dsv3 = json.loads((ROOT / "tests/data/parity/dsv3/model/config.json").read_text())
    dsv3.pop("rope_parameters", None)
    dsv3["rope_theta"] = 10000
    dsv3["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    dsv3["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "weight_block_size": [128, 128]}
    write("config_json", "dsv3_yarn_fp8", json.dumps(dsv3, indent=1))
    glm = dict(kjv)
    glm.pop("mlp_layer_types", None)
    glm.pop("indexer_types", None)
    glm["index_topk_pattern"] = "F" * glm["num_hidden_layers"]
    glm["first_k_dense_replace"] = 1
    write("config_json", "glm5_pattern", json.dumps(glm, indent=1))
    glm.pop("index_topk_pattern")
    glm["index_topk_freq"] = 2
    glm["index_skip_topk_offset"] = 1
    write("config_json", "glm5_freq", json.dumps(glm, indent=1))
    write("generation_config_json", "sampling",
          json.dumps({"eos_token_id": [1, 2], "bos_token_id": 0, "do_sample": True,
                      "temperature": 0.7, "top_p": 0.9}))


def cut_tokenizer(tok, keep_merges):
    """The byte alphabet, the first merges whose tokens are all kept, the added tokens."""
    vocab = tok["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    kept = dict(by_id[:256])
    merges = []
    for m in tok["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in kept and b in kept and a + b in vocab:
            kept[a + b] = vocab[a + b]
            merges.append(m)
            if len(merges) >= keep_merges:
                break
    out = dict(tok)
    out["model"] = dict(tok["model"], vocab=kept, merges=merges)
    return json.dumps(out, ensure_ascii=False, indent=None)


def tokenizer_seeds():
    sources = {
        "glm5_tiny_kjv": ROOT / "models/glm5-tiny-kjv/tokenizer.json",
        "deepseek_v3_style": ROOT / "tests/data/tokenizer/deepseek_v3_style.json",
        "glm5_style": ROOT / "tests/data/tokenizer/glm5_style.json",
        "nfc_digits_style": ROOT / "tests/data/tokenizer/nfc_digits_style.json",
    }
    for name, path in sources.items():
        write("tokenizer_json", name, cut_tokenizer(json.loads(path.read_text()), 24))
    corpus = (ROOT / "tests/data/tokenizer/corpus.txt").read_bytes()
    lines = corpus.splitlines(keepends=True)
    samples = {
        "kjv": b"In the beginning God created the heaven and the earth.\n",
        "special": b"<|system|>You are<|user|>Hi [gMASK]<sop><think>x</think><|assistant|>",
        "whitespace": b"  a\t\tb\r\n\r\n   \n c  ",
        "digits": b"1234567 3.14159 0x1F 2,000,000",
        "unicode": "café e\u0301 中文 😀 ﬁ Ω".encode(),
        "ill_formed": b"ok \xff\xfe \xc3 \xe4\xb8 \xed\xa0\x80 \xf4\x90\x80\x80 end",
        "corpus_head": b"".join(lines[:8]),
        "corpus_mid": b"".join(lines[len(lines) // 2 : len(lines) // 2 + 4]),
    }
    for name, text in samples.items():
        write("tokenizer_encode", name, b"\x01" + text)  # first byte: parse_special
        write("tokenizer_encode", name + "_plain", b"\x00" + text)


def layout_seeds():
    for path in sorted((ROOT / "hostfiles").glob("*.layout")):
        text = path.read_bytes()
        ranks = sum(1 for line in text.decode().splitlines()
                    if line.split("#")[0].strip())
        write("layout", path.stem, bytes([ranks - 1]) + text)  # first byte: world size - 1
    write("layout", "one_rank", b"\x00" + b"0 coordinator\n")
    write("layout", "budgets", b"\x03" + b"0 coordinator - 0 - -\n1 gpu-expert 0 0 16 28.5\n"
          b"2 gpu-expert 1 1 0.5 -\n3 cpu-expert - 1 100 -  # comment\n")
    write("layout", "hosts", b"\x03" + b"0 coordinator - - - - node-a\n1 cpu-expert - 0 32 - node-a\n"
          b"2 cpu-expert - - - - -\n3 gpu-expert 0 0 16 28 node-b\n")


def npy(shape, values, descr="<f4", fortran="False", version=1):
    dims = "".join(f"{d}, " for d in shape)
    if len(shape) > 1:
        dims = dims[:-2]
    header = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': ({dims}), }}"
    prefix = 10 if version == 1 else 12
    header += " " * ((64 - (prefix + len(header) + 1) % 64) % 64) + "\n"
    magic = b"\x93NUMPY" + bytes([version, 0])
    length = struct.pack("<H" if version == 1 else "<I", len(header))
    return magic + length + header.encode() + struct.pack(f"<{len(values)}f", *values)


def npy_seeds():
    write("npy", "matrix", npy([2, 3], [0.5 * i for i in range(6)]))
    write("npy", "vector", npy([4], [1, -1, 2, -2]))
    write("npy", "scalar", npy([], [3.0]))
    write("npy", "empty", npy([0, 5], []))
    write("npy", "three_d", npy([1, 2, 2], [1, 2, 3, 4]))
    write("npy", "version2", npy([3], [1, 2, 3], version=2))
    logits = (ROOT / "tests/data/embedded/logits_0.npy").read_bytes()
    write("npy", "logits_head", logits[:128])  # real header, truncated data: rejected


if __name__ == "__main__":
    safetensors_seeds()
    config_seeds()
    tokenizer_seeds()
    layout_seeds()
    npy_seeds()
