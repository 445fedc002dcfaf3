#!/usr/bin/env python3
"""Train the small GlmMoeDsaForCausalLM (GLM-5 architecture) that ships in models/glm5-tiny-kjv/.

Stages (run in order by default; each one reuses what the earlier ones left in --work):

  corpus     King James Version text (Debian bible-kjv-text, read with the `bible` program of
             bible-kjv) -> one verse per line; the last books (1 John .. Revelation, ~2%) held out.
  tokenizer  byte-level BPE (tokenizers), GLM-5 special tokens after the BPE vocabulary.
  train      CPU training (fp32 weights, bf16 autocast) for --max-steps steps (or a wall-time budget);
             checkpoints in --work so it can resume.
  finalize   bf16 save_pretrained into --out, reload in fp32 and evaluate (held-out perplexity,
             expert load, DSA indexer quality, greedy samples), write --out/README.md.

Usage:
  apt-get install -y bible-kjv bible-kjv-text
  pip install -r tools/requirements-train.txt
  nice -n 10 python tools/train_tiny_glm5.py --max-steps 1300 --lr 1.5e-3 --warmup-steps 60
                                                                  # everything, ~75 min of training
  nice -n 10 python tools/train_tiny_glm5.py --stage train        # resume training from --work
  nice -n 10 python tools/train_tiny_glm5.py --stage finalize

Preprocessing (corpus stage), exactly:
  1. `bible -l 100000 gen1:1-rev22:21` prints the whole text: a header line "<Book> <chapter>"
     per chapter and one line "  <verse number> <verse text>" per verse (-l 100000: no wrapping).
  2. Header lines give the book of each verse and are dropped; the verse number is dropped.
  3. Each verse: runs of whitespace collapsed to one space, leading/trailing space stripped.
     Nothing else is changed (spelling, capitalisation, punctuation are as in the source).
  4. A book is its verses joined with "\\n" plus a final "\\n"; books are kept in canonical order.
  5. Held out: the contiguous block of the last books 1 John, 2 John, 3 John, Jude, Revelation
     (~1.97% of the characters). Everything before is training text. The tokenizer is trained on
     the training text only.
  6. Token stream: each book's tokens followed by <|endoftext|>, books concatenated.
  7. A second, small stream (sampled for --chat-frac of the training rows) holds single-turn chats
     in the chat-template format, built from consecutive training verses of one chapter:
     "[gMASK]<sop><|user|>\\n{verse i}<|assistant|>\\n{verse i+1}<|user|>", so that a prompt built
     by the chat template is answered with the next verse and ends with <|user|> (an eos id).

Training details: AdamW (0.9, 0.95, wd 0.1 on matrices), peak lr 1e-3, linear warmup then cosine to
10% over the wall-time budget (or --max-steps), batch 16 x 256 tokens, grad clip 1.0, fp32,
eager attention and eager experts (the transformers reference code paths).
Aux-loss-free balancing (DeepSeek-V3): after every optimizer step, per MoE layer,
e_score_correction_bias += gamma * sign(mean_load - load_e) with the expert counts of that step.
DSA lightning indexer (DeepSeek-V3.2 recipe): transformers runs the indexer without gradients, so it
is trained here by a separate KL loss between the main attention distribution (summed over heads,
L1-normalised, detached) and the softmax of the indexer scores, on inputs detached from the LM graph.
For the first --dense-frac of training the attention is dense (index_topk lifted) and the indexer
only learns; afterwards index_topk = 128 is applied (sparse attention for positions >= 128) and the
KL is taken over the selected keys only.

Threads: torch.set_num_threads(2) with OMP_WAIT_POLICY=PASSIVE (set before torch is imported);
on a shared, oversubscribed machine the default spinning OpenMP barrier made steps ~10x slower.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "models" / "glm5-tiny-kjv"
DEFAULT_WORK = Path("/tmp/glm5-tiny-kjv-work")

HELDOUT_BOOKS = ["1 John", "2 John", "3 John", "Jude", "Revelation"]

# GLM-5 special tokens, in this order, get the ids right after the BPE vocabulary.
SPECIAL_TOKENS = [
    "[gMASK]",
    "<sop>",
    "<eop>",
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
]
VOCAB_SIZE = 4096
BPE_VOCAB = VOCAB_SIZE - len(SPECIAL_TOKENS)

# GLM / Qwen-style split, then byte-level mapping without GPT-2's own regex.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The chat template: [gMASK]<sop> then "<|role|>\n{content}" per message, and "<|assistant|>\n"
# when add_generation_prompt. Roles: system, user, assistant, observation.
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MODEL_KW = dict(
    hidden_size=256,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    intermediate_size=768,
    n_routed_experts=24,  # 32 with the MTP layer would not fit the 25 MB size limit in bf16
    num_experts_per_tok=4,
    n_shared_experts=1,
    moe_intermediate_size=64,  # 192 would make the bf16 checkpoint ~56 MB (limit 25 MB)
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=128,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,  # one MTP layer (model.layers.6.*), a draft head for speculation
    initializer_range=0.02,
    attention_bias=False,
)

# The greedy samples of the README; tests/embedded/embedded_test.cpp asks the same five prompts for
# continuations that do not loop (distinct token 3-grams).
SAMPLE_PROMPTS = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the", "And it came to pass",
                  "The kingdom of heaven is like"]
SAMPLE_TOKENS = 64
CHAT_SAMPLE = "The LORD is my shepherd; I shall not want."


def log(msg, file=None):
    print(msg, flush=True)
    if file is not None:
        with open(file, "a") as f:
            f.write(msg + "\n")


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


def read_kjv():
    """[(book, [(chapter, verse text), ...]), ...] in canonical order."""
    exe = shutil.which("bible")
    if exe is None:
        sys.exit("the `bible` program is missing: apt-get install -y bible-kjv bible-kjv-text")
    raw = subprocess.run([exe, "-l", "100000", "gen1:1-rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    books, chapter = [], None
    for line in raw.split("\n"):
        if not line.strip():
            continue
        m = re.match(r"^\s+(\d+) (.*)$", line)
        if m:
            if chapter is None:
                raise ValueError(f"verse before any chapter header: {line!r}")
            text = re.sub(r"\s+", " ", m.group(2)).strip()
            books[-1][1].append((chapter, text))
            continue
        m = re.match(r"^(\S.*) (\d+)$", line)
        if not m:
            raise ValueError(f"unexpected line: {line!r}")
        if not books or books[-1][0] != m.group(1):
            books.append((m.group(1), []))
        chapter = int(m.group(2))
    n_verses = sum(len(v) for _, v in books)
    if len(books) != 66 or n_verses != 31102:
        raise ValueError(f"expected 66 books / 31102 verses, got {len(books)} / {n_verses}")
    return books


def book_text(verses):
    return "".join(text + "\n" for _, text in verses)


def stage_corpus(args):
    books = read_kjv()
    names = [b for b, _ in books]
    split = names.index(HELDOUT_BOOKS[0])
    if names[split:] != HELDOUT_BOOKS:
        raise ValueError(f"held-out block mismatch: {names[split:]}")
    train, held = books[:split], books[split:]
    n_train = sum(len(book_text(v)) for _, v in train)
    n_held = sum(len(book_text(v)) for _, v in held)
    args.work.mkdir(parents=True, exist_ok=True)
    with open(args.work / "corpus.json", "w") as f:
        json.dump({"train": train, "heldout": held}, f)
    (args.work / "train.txt").write_text("".join(book_text(v) for _, v in train))
    (args.work / "heldout.txt").write_text("".join(book_text(v) for _, v in held))
    stats = dict(books_train=len(train), books_heldout=len(held),
                 verses_train=sum(len(v) for _, v in train), verses_heldout=sum(len(v) for _, v in held),
                 chars_train=n_train, chars_heldout=n_held,
                 heldout_fraction=n_held / (n_train + n_held), heldout_books=HELDOUT_BOOKS)
    (args.work / "corpus_stats.json").write_text(json.dumps(stats, indent=1))
    log(f"corpus: {json.dumps(stats)}")


def load_corpus(args):
    with open(args.work / "corpus.json") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def stage_tokenizer(args):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = load_corpus(args)
    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator((book_text(v) for _, v in corpus["train"]), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB:
        raise ValueError(f"BPE vocab {tok.get_vocab_size()} != {BPE_VOCAB}")
    tok.add_special_tokens(SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if list(ids.values()) != list(range(BPE_VOCAB, VOCAB_SIZE)):
        raise ValueError(f"special ids {ids}")
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "extra_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "model_max_length": MODEL_KW["max_position_embeddings"],
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    # Round trip on the held-out text (unseen by the tokenizer trainer).
    held = "".join(book_text(v) for _, v in corpus["heldout"])
    enc = tok.encode(held)
    if tok.decode(enc.ids) != held:
        raise ValueError("tokenizer round trip failed on the held-out text")
    log(f"tokenizer: vocab {tok.get_vocab_size()}, special ids {ids}, held-out {len(held)} chars -> "
        f"{len(enc.ids)} tokens ({len(held) / len(enc.ids):.2f} chars/token)")


def special_ids(tok):
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def load_tokenizer(args):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(args.out / "tokenizer.json"))


def token_streams(args, tok):
    """Plain training stream, chat stream (1-D int64 tensors), held-out stream."""
    corpus = load_corpus(args)
    eot = tok.token_to_id("<|endoftext|>")
    sp = special_ids(tok)

    def stream(books):
        out = []
        for enc in tok.encode_batch([book_text(v) for _, v in books]):
            out.extend(enc.ids)
            out.append(eot)
        return torch.tensor(out, dtype=torch.long)

    chats = []
    for _, verses in corpus["train"]:
        for (c0, v0), (c1, v1) in zip(verses, verses[1:]):
            if c0 == c1:
                chats.append(f"<|user|>\n{v0}<|assistant|>\n{v1}<|user|>")
    prefix = [sp["[gMASK]"], sp["<sop>"]]
    chat_ids = []
    for enc in tok.encode_batch(chats):
        chat_ids.extend(prefix)
        chat_ids.extend(enc.ids)
    return stream(corpus["train"]), torch.tensor(chat_ids, dtype=torch.long), stream(corpus["heldout"])


# --------------------------------------------------------------------------------------------------
# Model helpers
# --------------------------------------------------------------------------------------------------


def make_config(tok):
    from transformers import GlmMoeDsaConfig

    sp = special_ids(tok)
    eot = sp["<|endoftext|>"]
    return GlmMoeDsaConfig(vocab_size=tok.get_vocab_size(), bos_token_id=None, eos_token_id=eot,
                           pad_token_id=eot, **MODEL_KW)


def new_model(config):
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM._from_config(config, attn_implementation="eager",
                                             experts_implementation="eager", dtype=torch.float32)


def mtp_config(config):
    """The config of a model whose last layer is the MTP layer: its decoder layer is built with this."""
    c = copy.deepcopy(config)
    c.num_hidden_layers = config.num_hidden_layers + 1
    c.layer_types = list(config.layer_types) + ["indexed_attention"]
    c.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
    c.indexer_types = list(config.indexer_types) + ["full"]
    c.num_nextn_predict_layers = 0
    return c


class MtpHead(torch.nn.Module):
    """One DeepSeek-V3 multi-token-prediction module, stored as model.layers.{num_hidden_layers}.*:
    from the last main layer's output h_i (before the final norm) and the embedding of token i+1 it
    predicts token i+2: x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), one decoder layer (MLA,
    DSA indexer, MoE), shared_head.norm, then the main model's lm_head."""

    def __init__(self, config):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = GlmMoeDsaRMSNorm(h, eps)
        self.hnorm = GlmMoeDsaRMSNorm(h, eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = GlmMoeDsaDecoderLayer(mtp_config(config), config.num_hidden_layers)
        self.head_norm = GlmMoeDsaRMSNorm(h, eps)
        with torch.no_grad():  # the initialisation transformers gives the main layers
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, config.initializer_range)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)

    def forward(self, next_embeds, hidden, attention_mask, position_embeddings):
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x, _ = self.layer(x, attention_mask=attention_mask, position_embeddings=position_embeddings)
        return self.head_norm(x)

    def checkpoint_tensors(self, config):
        """{checkpoint name: tensor} in the layout of released GLM-5 / DeepSeek-V3 MTP layers."""
        from transformers import GlmMoeDsaForCausalLM

        c = mtp_config(config)
        shell = GlmMoeDsaForCausalLM._from_config(c, dtype=torch.float32)
        shell.model.layers[config.num_hidden_layers].load_state_dict(self.layer.state_dict())
        p = f"model.layers.{config.num_hidden_layers}."
        with tempfile.TemporaryDirectory() as tmp:
            shell.save_pretrained(tmp, safe_serialization=True)
            from safetensors.torch import load_file

            out = {k: v for k, v in load_file(f"{tmp}/model.safetensors").items() if k.startswith(p)}
        out[p + "enorm.weight"] = self.enorm.weight.detach().clone()
        out[p + "hnorm.weight"] = self.hnorm.weight.detach().clone()
        out[p + "eh_proj.weight"] = self.eh_proj.weight.detach().clone()
        out[p + "shared_head.norm.weight"] = self.head_norm.weight.detach().clone()
        return out


class LastLayerTap:
    """A forward hook on the last main layer: its output (the hidden states before the final norm),
    attention mask and position embeddings, which the MTP layer takes."""

    def __init__(self, model):
        self.handle = model.model.layers[-1].register_forward_hook(self._hook, with_kwargs=True)
        self.paused = False

    def _hook(self, layer, args, kwargs, output):
        if self.paused:
            return
        self.hidden = output[0]
        self.mask = kwargs["attention_mask"]
        self.position_embeddings = kwargs["position_embeddings"]

    def mtp_logits(self, model, mtp, input_ids):
        """Logits of token i+2 at positions 0..S-2 (the MTP layer sees token i+1, inputs only)."""
        s = input_ids.shape[1] - 1
        cos, sin = self.position_embeddings
        x = mtp(model.model.embed_tokens(input_ids[:, 1:]), self.hidden[:, :s], self.mask[:, :, :s, :s],
                (cos[:, :s], sin[:, :s]))
        return model.lm_head(x)

    def remove(self):
        self.handle.remove()


def moe_gates(model, mtp=None):
    gates = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    if mtp is not None:
        gates.append((len(model.model.layers), mtp.layer.mlp.gate))
    return gates


def set_index_topk(model, k, mtp=None):
    for layer in list(model.model.layers) + ([mtp.layer] if mtp is not None else []):
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = k


class ExpertCounter:
    """Counts routed (token, expert) pairs per MoE layer with forward hooks on the routers."""

    def __init__(self, model, mtp=None):
        self.gates = moe_gates(model, mtp)
        self.counts = {i: torch.zeros(g.num_experts, dtype=torch.long) for i, g in self.gates}
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in self.gates]
        self.paused = False

    def _hook(self, i):
        def fn(module, inputs, output):
            if self.paused:
                return
            self.counts[i] += torch.bincount(output[2].detach().flatten(), minlength=module.num_experts)
        return fn

    def reset(self):
        for c in self.counts.values():
            c.zero_()

    def remove(self):
        for h in self.handles:
            h.remove()


def indexer_scores(attn, hidden_states, position_embeddings):
    """The DSA indexer's index scores [B, S, T] computed with gradients for the indexer parameters
    (same math as GlmMoeDsaIndexer.forward, which transformers runs under no_grad). The inputs are
    detached, so only the indexer learns from this. In fp32 with autocast off: under autocast the
    model's own (no_grad) indexer call leaves bf16 casts of these weights in autocast's cache, and
    products through those cached casts give the weights no gradient (runs before 2026-12-07
    trained only the indexer's LayerNorm)."""
    with torch.autocast("cpu", enabled=False):
        return _indexer_scores_f32(attn, hidden_states.detach().float(), position_embeddings)


def _indexer_scores_f32(attn, h, position_embeddings):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    idx = attn.indexer
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
    bsz, seq, _ = h.shape
    cos, sin = position_embeddings
    q = idx.wq_b(q_resid).view(bsz, seq, idx.n_heads, idx.head_dim)
    q_rot, q_pass = torch.split(q, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    k = idx.k_norm(idx.wk(h)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * idx.softmax_scale)
    weights = idx.weights_proj(h).float() * (idx.n_heads ** -0.5)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def allowed_keys(attention_mask):
    m = attention_mask[:, 0]
    return m if m.dtype == torch.bool else m == 0


class IndexerProbe:
    """Forward hooks on the attention modules. In training: the indexer KL loss per layer.
    In evaluation (dense attention): the attention mass the indexer's top-k keys capture."""

    def __init__(self, model, topk, mode, mtp=None):
        self.topk, self.mode = topk, mode
        self.losses, self.kls = [], []
        self.recall_sum = self.local_sum = 0.0
        self.recall_n = self.tie_rows = 0
        self.zero_frac_sum = 0.0
        self.checked = False
        self.paused = False
        layers = list(model.model.layers) + ([mtp.layer] if mtp is not None else [])
        self.handles = [layer.self_attn.register_forward_hook(self._hook, with_kwargs=True)
                        for layer in layers if layer.self_attn.indexer is not None]

    def _hook(self, attn, args, kwargs, output):
        if self.paused:
            return
        attn_weights, topk_idx = output[1], output[2]
        hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        allowed = allowed_keys(kwargs["attention_mask"])
        p = attn_weights.detach().float().sum(1)  # [B, S, T], summed over heads
        seq_k = p.shape[-1]
        if self.mode == "train":
            scores = indexer_scores(attn, hs, kwargs["position_embeddings"])
            if not self.checked:  # the recomputed scores must rank like transformers' indexer
                with torch.no_grad():
                    s = scores.masked_fill(~allowed, float("-inf"))
                    k = min(attn.indexer.index_topk, seq_k)
                    kth = s.topk(k, dim=-1).values[..., -1]
                    picked = s.gather(-1, topk_idx.long()).min(-1).values
                    # The model's indexer ran in bf16 under autocast, these scores in fp32.
                    # (bf16 keeps 8 bits: within 2 % of the row's largest |score|).
                    scale = s.masked_fill(~allowed, 0).abs().amax(-1)
                    tol = 1e-4 + (2e-2 * scale if torch.is_autocast_enabled("cpu") else 0.0)
                    ok = (picked >= kth - tol) | torch.isinf(kth)
                    if not bool(ok.all()):
                        raise RuntimeError("indexer score recomputation does not match transformers")
                self.checked = True
            valid = allowed
            if attn.indexer.index_topk < seq_k:
                sel = torch.zeros_like(allowed).scatter(-1, topk_idx.long(), True)
                valid = allowed & sel
            p = p * valid
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
            logq = torch.log_softmax(scores.masked_fill(~valid, -1e30), dim=-1)
            ce = -(p * logq).sum(-1).mean()
            ent = -torch.special.xlogy(p, p).sum(-1).mean()
            self.losses.append(ce)
            self.kls.append(float(ce.detach() - ent))
        else:
            with torch.no_grad():
                scores = indexer_scores(attn, hs, kwargs["position_embeddings"])
                scores = scores.masked_fill(~allowed, float("-inf"))
                p = p / p.sum(-1, keepdim=True)
                rows = slice(self.topk, None)  # queries that see more than topk keys
                top = scores[:, rows].topk(self.topk, dim=-1).indices
                captured = p[:, rows].gather(-1, top).sum(-1)
                pos = torch.arange(self.topk, seq_k)
                local = torch.stack([p[:, i, i - self.topk + 1:i + 1].sum(-1) for i in pos.tolist()], dim=1)
                self.recall_sum += float(captured.sum())
                self.local_sum += float(local.sum())
                self.recall_n += captured.numel()
                # exact ties across the top-k boundary (the selection among them is implementation-defined)
                srt = scores[:, rows].topk(self.topk + 1, dim=-1).values
                self.tie_rows += int((srt[..., -2] == srt[..., -1]).sum())
                vis = torch.isfinite(scores[:, rows])
                self.zero_frac_sum += float(((scores[:, rows] == 0) & vis).sum() / vis.sum()) * captured.numel()

    def take_loss(self):
        loss = torch.stack(self.losses).sum() if self.losses else None
        kl = sum(self.kls) / max(len(self.kls), 1)
        self.losses, self.kls = [], []
        return loss, kl

    def remove(self):
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def init_from_model(model, mtp, config, model_dir):
    """Loads a finished model's weights (model.safetensors, the MTP layer as model.layers.{n}.*)
    into the training modules, through transformers' loader (it undoes the per-expert layout of
    saved checkpoints); every tensor of both must be present."""
    from safetensors.torch import load_file
    from transformers import GlmMoeDsaForCausalLM

    # A shell with the MTP layer as its last decoder layer reads all layers; its extra MTP tensors
    # (enorm, hnorm, eh_proj, shared_head) are read directly.
    shell, info = GlmMoeDsaForCausalLM.from_pretrained(
        str(model_dir), config=mtp_config(config), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager", output_loading_info=True)
    if info["missing_keys"]:
        raise ValueError(f"{model_dir}: missing {sorted(info['missing_keys'])[:5]}")
    n = config.num_hidden_layers
    state = {k: v for k, v in shell.state_dict().items() if not k.startswith(f"model.layers.{n}.")}
    model.load_state_dict(state, strict=True)
    stored = load_file(str(model_dir / "model.safetensors"))
    p = f"model.layers.{n}."
    head = {"enorm.weight": stored[p + "enorm.weight"], "hnorm.weight": stored[p + "hnorm.weight"],
            "eh_proj.weight": stored[p + "eh_proj.weight"], "head_norm.weight": stored[p + "shared_head.norm.weight"]}
    head = {k: v.float() for k, v in head.items()}
    head.update({"layer." + k: v for k, v in shell.model.layers[n].state_dict().items()})
    mtp.load_state_dict(head, strict=True)


def lr_at(args, step, progress):
    warm = min(1.0, (step + 1) / args.warmup_steps)
    cos = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * cos


def sample_batch(stream, chat, args, gen, seq_len, batch):
    seq = seq_len + 1
    rows = []
    use_chat = torch.rand(batch, generator=gen) < args.chat_frac
    for i in range(batch):
        s = chat if bool(use_chat[i]) else stream
        o = int(torch.randint(0, len(s) - seq, (1,), generator=gen))
        rows.append(s[o:o + seq])
    return torch.stack(rows)


# Unlikelihood training (Welleck et al. 2019, "Neural text degeneration with unlikelihood training"):
# maximum likelihood alone leaves a small model's greedy continuations in loops. Token level: at each
# position, the tokens seen earlier in the row (but not the target) get -log(1 - p). Sequence level:
# the model's own greedy continuations of training prefixes, each token that completes an n-gram
# already in the continuation or its prefix gets -log(1 - p).
UL_ROWS, UL_PREFIX, UL_LENGTH, UL_NGRAM = 8, 32, 64, 4


def token_unlikelihood(logits, inputs, targets):
    """Mean over positions of -sum_{c in earlier tokens of the row, c != target} log(1 - p(c))."""
    vocab = logits.shape[-1]
    seen = F.one_hot(inputs, vocab).cumsum(1) > 0  # [B, S, V]: token c among inputs[:, :t + 1]
    seen.scatter_(-1, targets[..., None], False)
    p = torch.softmax(logits.float(), -1)
    return -(torch.log((1 - p).clamp_min(1e-5)) * seen).sum(-1).mean()


@torch.no_grad()
def greedy_rows(model, prefix, n):
    """prefix [B, P] followed by n greedy tokens of each row (no stop), through the KV cache."""
    out = model(input_ids=prefix, use_cache=True)
    rows = [prefix]
    for i in range(n):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        rows.append(nxt)
        if i + 1 < n:
            out = model(input_ids=nxt, cache=out.cache, use_cache=True)
    return torch.cat(rows, 1)


def repeated_ngram_mask(seq, start, n):
    """[B, S] bool: positions >= start whose token completes an n-gram seen earlier in its row."""
    mask = torch.zeros(seq.shape, dtype=torch.bool)
    for b, row in enumerate(seq.tolist()):
        seen = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1:t + 1])
            if t >= start and gram in seen:
                mask[b, t] = True
            seen.add(gram)
    return mask


def sequence_unlikelihood(model, stream, chat, args, gen, amp):
    """The sequence-level loss on greedy continuations of UL_ROWS random training prefixes, and the
    share of their tokens that repeat an n-gram."""
    prefix = sample_batch(stream, chat, args, gen, UL_PREFIX - 1, UL_ROWS)
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        seq = greedy_rows(model, prefix, UL_LENGTH)
    model.train()
    mask = repeated_ngram_mask(seq, UL_PREFIX, UL_NGRAM)[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=seq[:, :-1], use_cache=False).logits
    p = torch.softmax(logits.float(), -1).gather(-1, seq[:, 1:, None])[..., 0]
    loss = -(torch.log((1 - p).clamp_min(1e-5)) * mask).sum() / (UL_ROWS * UL_LENGTH)
    return loss, float(mask.sum()) / (UL_ROWS * UL_LENGTH)


def stage_train(args):
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args)
    train_ids, chat_ids, _ = token_streams(args, tok)
    config = make_config(tok)
    ckpt_path = args.work / "ckpt.pt"
    log_path = args.out / "training_log.txt"
    torch.manual_seed(args.seed)
    model = new_model(config)
    mtp = MtpHead(config)
    # Training speed: the experts through transformers' grouped_mm path (the same math as the eager
    # loop), matrix products in bf16 under autocast; evaluation and everything saved stay fp32/eager.
    model.set_experts_implementation(args.experts)
    model.train()
    mtp.train()
    named = list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]
    idx_params = [p for n, p in named if ".indexer." in n]
    main_named = [(n, p) for n, p in named if ".indexer." not in n]
    indexer_only = args.train_only == "indexer"
    if indexer_only:  # the model and its routing bias frozen: only the indexers learn (KL objective)
        for _, p in main_named:
            p.requires_grad_(False)
        main_named = []
    decay = [p for n, p in main_named if p.dim() >= 2]
    no_decay = [p for n, p in main_named if p.dim() < 2]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=args.wd), dict(params=no_decay, weight_decay=0.0),
         dict(params=idx_params, weight_decay=0.0)],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    step, train_time, tokens = 0, 0.0, 0
    if ckpt_path.exists() and not args.restart:
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        mtp.load_state_dict(ck["mtp"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step, train_time, tokens = ck["step"], ck["train_time"], ck["tokens"]
        log(f"resumed from {ckpt_path}: step {step}, {train_time:.0f}s, {tokens} tokens", log_path)
    elif args.init_from is not None:
        # A new run (optimizer, schedule, step count) from a finished model's weights; the log goes
        # on below the earlier run's.
        init_from_model(model, mtp, config, args.init_from)
        args.out.mkdir(parents=True, exist_ok=True)
        log(f"# --- a new run from the weights of {args.init_from / 'model.safetensors'} "
            f"(bf16 values in fp32) ---", log_path)
        log(f"# {platform.python_version()} torch {torch.__version__} threads {torch.get_num_threads()} "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", log_path)
        log(f"# batch {args.batch}x{args.seq_len} | last {args.long_frac:.0%} on rows of {args.long_seq_len} | "
            f"lr {args.lr} | warmup {args.warmup_steps} | budget {args.time_budget_min} min | "
            f"dense for the first {args.dense_frac:.0%} | bias gamma {args.bias_gamma} | seed {args.seed} | train {args.train_only} | "
            f"indexer lr {args.indexer_lr or args.lr} | unlikelihood token {args.unlikelihood_token} "
            f"seq every {args.unlikelihood_seq_every}", log_path)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
        log(f"# {platform.python_version()} torch {torch.__version__} threads {torch.get_num_threads()} "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", log_path)
        log(f"# params {n_params} | train tokens {len(train_ids)} | chat tokens {len(chat_ids)} | "
            f"batch {args.batch}x{args.seq_len} | last {args.long_frac:.0%} on rows of {args.long_seq_len} | lr {args.lr} | budget {args.time_budget_min} min | "
            f"max_steps {args.max_steps} | dense (indexer warm-up) for the first {args.dense_frac:.0%} | "
            f"experts {args.experts} | autocast {args.amp} | mtp weight {args.mtp_weight}", log_path)
    counter = ExpertCounter(model, mtp)
    tap = LastLayerTap(model)
    window = ExpertCounter.__new__(ExpertCounter)  # running counts between routing reports
    window.counts = {i: torch.zeros_like(c) for i, c in counter.counts.items()}
    probe = IndexerProbe(model, config.index_topk, "train", mtp)
    budget = args.time_budget_min * 60.0
    last_ckpt = time.time()
    hist_loss, hist_mtp, hist_kl, t_window, tok_window = [], [], [], 0.0, 0
    hist_ul_tok, hist_ul_seq, hist_repeats = [], [], []

    def progress():
        return step / args.max_steps if args.max_steps else train_time / budget

    def save_ckpt():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(dict(model=model.state_dict(), mtp=mtp.state_dict(), opt=opt.state_dict(), gen=gen.get_state(), step=step,
                        train_time=train_time, tokens=tokens), tmp)
        os.replace(tmp, ckpt_path)

    while progress() < 1.0:
        t0 = time.time()
        dense = progress() < args.dense_frac
        set_index_topk(model, 1 << 30 if dense else config.index_topk, mtp)
        lr = lr_at(args, step, progress())
        for g in opt.param_groups[:2]:
            g["lr"] = lr
        opt.param_groups[2]["lr"] = lr * (args.indexer_lr / args.lr if args.indexer_lr else 1.0)
        # The last --long-frac of training on rows of --long-seq-len (as many tokens a step), so that
        # positions beyond --seq-len are trained too; the short rows before it are ~3x faster.
        long_rows = args.long_seq_len > 0 and progress() >= 1.0 - args.long_frac
        seq_len = args.long_seq_len if long_rows else args.seq_len
        batch = sample_batch(train_ids, chat_ids, args, gen, seq_len,
                             max(1, args.batch * args.seq_len // seq_len))
        counter.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            out = model(input_ids=batch[:, :-1], use_cache=False)
            mtp_logits = tap.mtp_logits(model, mtp, batch[:, :-1]).float()
        lm_loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), batch[:, 1:].reshape(-1))
        mtp_loss = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), batch[:, 2:].reshape(-1))
        idx_loss, kl = probe.take_loss()
        loss = idx_loss if indexer_only else lm_loss + args.mtp_weight * mtp_loss + idx_loss
        if args.unlikelihood_token > 0:
            ul_tok = token_unlikelihood(out.logits, batch[:, :-1], batch[:, 1:])
            loss = loss + args.unlikelihood_token * ul_tok
            hist_ul_tok.append(float(ul_tok.detach()))
        loss.backward()
        if main_named:
            torch.nn.utils.clip_grad_norm_([p for _, p in main_named], args.clip)
        torch.nn.utils.clip_grad_norm_(idx_params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.unlikelihood_seq_every and step % args.unlikelihood_seq_every == 0:
            # A step of its own on the model's greedy continuations (routers and indexers not counted).
            counter.paused = probe.paused = tap.paused = True
            ul_seq, repeats = sequence_unlikelihood(model, train_ids, chat_ids, args, gen, args.amp == "bf16")
            ul_seq.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in main_named], args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            counter.paused = probe.paused = tap.paused = False
            hist_ul_seq.append(float(ul_seq.detach()))
            hist_repeats.append(repeats)
        with torch.no_grad():  # aux-loss-free balancing
            for i, gate in counter.gates:
                load = counter.counts[i].float()
                if not indexer_only:
                    gate.e_score_correction_bias += args.bias_gamma * torch.sign(load.mean() - load)
                window.counts[i] += counter.counts[i]
        step += 1
        dt = time.time() - t0
        train_time += dt
        tokens += batch[:, 1:].numel()
        t_window += dt
        tok_window += batch[:, 1:].numel()
        hist_loss.append(float(lm_loss.detach()))
        hist_mtp.append(float(mtp_loss.detach()))
        hist_kl.append(kl)
        if not math.isfinite(hist_loss[-1]):
            raise RuntimeError(f"non-finite loss at step {step}")
        if step % args.log_every == 0:
            log(f"step {step:5d} | loss {np.mean(hist_loss[-args.log_every:]):.4f} | "
                f"mtp {np.mean(hist_mtp[-args.log_every:]):.4f} | idx_kl {np.mean(hist_kl[-args.log_every:]):.4f} | lr {lr:.2e} | "
                f"tok/s {tok_window / t_window:.0f} | tokens {tokens} | elapsed {train_time:.0f}s | "
                f"{'dense' if dense else 'sparse'} | rows {batch.shape[0]}x{batch.shape[1] - 1}" +
                (f" | ul_tok {np.mean(hist_ul_tok[-args.log_every:]):.4f}" if hist_ul_tok else "") +
                (f" | ul_seq {np.mean(hist_ul_seq[-5:]):.4f} repeats {np.mean(hist_repeats[-5:]):.3f}"
                 if hist_ul_seq else ""), log_path)
            t_window, tok_window = 0.0, 0
        if step % args.route_every == 0:
            parts = []
            for i, c in window.counts.items():
                f = c.float() / c.sum()
                ratio = f"{float(f.max() / f.min()):.2f}" if bool(f.min() > 0) else f"inf ({int((f == 0).sum())} unused)"
                parts.append(f"L{i} max/min {ratio} "
                             f"H {float(-(f * f.clamp_min(1e-12).log()).sum() / math.log(len(f))):.3f}")
                c.zero_()
            bias = torch.stack([g.e_score_correction_bias for _, g in counter.gates])
            log(f"routing @ {step}: " + " | ".join(parts) +
                f" | bias range [{float(bias.min()):.3f}, {float(bias.max()):.3f}]", log_path)
        if time.time() - last_ckpt > args.ckpt_every_s:
            save_ckpt()
            last_ckpt = time.time()
    save_ckpt()
    final = float(np.mean(hist_loss[-50:])) if hist_loss else float("nan")
    log(f"done: {step} steps, {tokens} tokens, {train_time:.0f}s; mean train loss of the last 50 steps "
        f"(this session) {final:.4f}", log_path)
    counter.remove()
    probe.remove()
    tap.remove()


# --------------------------------------------------------------------------------------------------
# Finalize: save bf16, reload fp32, evaluate, report
# --------------------------------------------------------------------------------------------------


def heldout_windows(held_ids, n, seq):
    w = seq + 1
    if len(held_ids) >= n * w:
        starts = [i * w for i in range(n)]
    else:
        starts = np.linspace(0, len(held_ids) - w, n).astype(int).tolist()
    return torch.stack([held_ids[s:s + w] for s in starts])


@torch.no_grad()
def evaluate(model, windows, tok, batch=16):
    nll, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
        n += x[:, 1:].numel()
    n_bytes = sum(len(tok.decode(row[1:].tolist(), skip_special_tokens=True).encode()) for row in windows)
    return dict(nll=nll / n, ppl=math.exp(nll / n), bits_per_byte=nll / math.log(2) / n_bytes, tokens=n)


def stage_finalize(args):
    from transformers import GenerationConfig, GlmMoeDsaForCausalLM

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args)
    sp = special_ids(tok)
    train_ids, _, held_ids = token_streams(args, tok)
    windows = heldout_windows(held_ids, args.eval_seqs, args.seq_len)
    config = make_config(tok)
    ck = torch.load(args.work / "ckpt.pt", weights_only=False)
    model = new_model(config)
    model.load_state_dict(ck["model"])
    model.eval()
    mtp = MtpHead(config)
    mtp.load_state_dict(ck["mtp"])
    mtp.eval()
    set_index_topk(model, config.index_topk, mtp)
    fp32_eval = evaluate(model, windows, tok)
    log(f"held-out (fp32 training weights): {fp32_eval}")
    mtp_eval = evaluate_mtp(model, mtp, windows)
    log(f"held-out MTP layer (token i+2 from h_i and token i+1): {mtp_eval}")
    mtp_tensors = mtp.checkpoint_tensors(config)

    # bf16 checkpoint; the routing bias stays float32 as in released GLM-5 / DeepSeek-V3 checkpoints.
    model.to(torch.bfloat16)
    for _, gate in moe_gates(model):
        gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    model.config.dtype = torch.bfloat16
    for stale in args.out.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(args.out, safe_serialization=True)
    add_mtp_tensors(args.out / "model.safetensors", mtp_tensors)
    GenerationConfig(eos_token_id=[sp["<|endoftext|>"], sp["<|user|>"], sp["<|observation|>"]],
                     pad_token_id=sp["<|endoftext|>"], do_sample=False).save_pretrained(args.out)

    # Reload the stored bf16 values in fp32; everything below runs on exactly what the files contain.
    model = GlmMoeDsaForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    model.eval()
    counter = ExpertCounter(model)
    bf16_eval = evaluate(model, windows, tok)
    loads = {i: c.clone() for i, c in counter.counts.items()}
    counter.remove()
    set_index_topk(model, 1 << 30)
    probe = IndexerProbe(model, config.index_topk, "eval")
    dense_eval = evaluate(model, windows, tok)
    probe.remove()
    set_index_topk(model, config.index_topk)
    recall = dict(indexer=probe.recall_sum / probe.recall_n, last_keys=probe.local_sum / probe.recall_n,
                  rows=probe.recall_n, tie_rows=probe.tie_rows / probe.recall_n,
                  zero_scores=probe.zero_frac_sum / probe.recall_n)
    log(f"held-out (bf16 checkpoint, fp32 compute, DSA on): {bf16_eval}")
    log(f"held-out (same, DSA off): {dense_eval}; indexer attention-mass recall {recall}")

    samples = []
    for prompt in SAMPLE_PROMPTS:
        new = greedy(model, tok.encode(prompt).ids, SAMPLE_TOKENS)
        samples.append((prompt, tok.decode(new, skip_special_tokens=False), distinct_3grams(new)))
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(args.out)
    chat_prompt = hf_tok.apply_chat_template([{"role": "user", "content": CHAT_SAMPLE}], tokenize=False,
                                             add_generation_prompt=True)
    chat_ids = torch.tensor([tok.encode(chat_prompt).ids])
    out = model.generate(chat_ids, max_new_tokens=60, do_sample=False)
    chat_reply = tok.decode(out[0, chat_ids.shape[1]:].tolist(), skip_special_tokens=False)
    for p, s, d in samples:
        log(f"sample ({d:.3f} distinct 3-grams): {p!r} -> {s!r}")
    log(f"chat: {chat_prompt!r} -> {chat_reply!r}")

    write_readme(args, tok, config, ck, fp32_eval, bf16_eval, dense_eval, recall, loads, samples,
                 (chat_prompt, chat_reply), len(train_ids), mtp_eval)


@torch.no_grad()
def greedy(model, ids, n):
    """n greedy tokens after ids, end-of-text tokens included (no stop), as the engine's test asks."""
    ids = list(ids)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[-n:]


def distinct_3grams(ids):
    grams = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
    return len(set(grams)) / max(len(grams), 1)


@torch.no_grad()
def evaluate_mtp(model, mtp, windows, batch=16):
    """The MTP layer on the held-out windows: perplexity of token i+2 and how often its argmax is
    that token (the acceptance of a one-token draft that the main model would have confirmed)."""
    tap = LastLayerTap(model)
    nll, hits, n = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        model(input_ids=x[:, :-1], use_cache=False)
        logits = tap.mtp_logits(model, mtp, x[:, :-1])
        target = x[:, 2:]
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
        hits += int((logits.argmax(-1) == target).sum())
        n += target.numel()
    tap.remove()
    return dict(ppl=math.exp(nll / n), top1=hits / n, tokens=n)


def add_mtp_tensors(path, tensors):
    """Appends the MTP layer's tensors (bf16; the router bias f32) to a saved checkpoint file."""
    from safetensors.torch import load_file, save_file

    stored = load_file(str(path))
    for name, t in tensors.items():
        keep_f32 = name.endswith("e_score_correction_bias")
        stored[name] = t.to(torch.float32 if keep_f32 else torch.bfloat16).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(stored, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def load_table(loads, k):
    lines = []
    summary = []
    for i, c in loads.items():
        f = (c.double() / c.sum()).numpy()
        fs = np.sort(f)[::-1]
        ent = float(-(f[f > 0] * np.log(f[f > 0])).sum() / math.log(len(f)))
        ratio = float(fs[0] / fs[-1]) if fs[-1] > 0 else float("inf")
        summary.append(dict(layer=i, max=float(fs[0]), min=float(fs[-1]), ratio=ratio, entropy=ent))
        lines.append(f"| {i} | {int(c.sum()) // k} | {fs[0]:.4f} | {fs[-1]:.4f} | {ratio:.1f} | {ent:.3f} | "
                     + " ".join(f"{x * 100:.1f}" for x in fs) + " |")
    return lines, summary


def mtp_param_count(model_dir, config):
    from safetensors import safe_open

    p = f"model.layers.{config.num_hidden_layers}."
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys() if k.startswith(p))


def count_params(model_dir):
    from safetensors import safe_open

    n, nbytes, dtypes = 0, 0, {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            numel = int(np.prod(t.get_shape()))
            n += numel
            dtypes[t.get_dtype()] = dtypes.get(t.get_dtype(), 0) + numel
    return n, dtypes


def write_readme(args, tok, config, ck, fp32_eval, bf16_eval, dense_eval, recall, loads, samples, chat,
                 n_train_tokens, mtp_eval):
    import transformers

    sp = special_ids(tok)
    stats = json.loads((args.work / "corpus_stats.json").read_text())
    n_params, dtypes = count_params(args.out)
    size = (args.out / "model.safetensors").stat().st_size
    log_lines = (args.out / "training_log.txt").read_text().splitlines()
    step_lines = [ln for ln in log_lines if ln.startswith("step ")]
    last = step_lines[-1] if step_lines else ""
    final_loss = np.mean([float(re.search(r"loss ([0-9.]+)", ln).group(1)) for ln in step_lines[-5:]])
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    n_moe = sum(1 for t in config.mlp_layer_types if t == "sparse")
    n_mtp = mtp_param_count(args.out, config)
    active = n_params - n_mtp - (config.n_routed_experts - config.num_experts_per_tok) * per_expert * n_moe
    table, summary = load_table(loads, config.num_experts_per_tok)
    ratios = [s["ratio"] for s in summary]
    ents = [s["entropy"] for s in summary]
    k = config.num_experts_per_tok
    E = config.n_routed_experts

    def cell(text):  # a '|' inside a table cell, even in a code span, must be escaped
        return text.replace("|", "\\|")

    all_used = all(s["min"] > 0 for s in summary)
    verdict = ("every expert receives tokens in every layer (no collapse), and the loads are non-uniform"
               if all_used else
               f"{sum(1 for s in summary if s['min'] == 0)} layer(s) have experts that receive no tokens")
    md = f"""# glm5-tiny-kjv

A small `GlmMoeDsaForCausalLM` (the GLM-5 architecture: MLA attention, DeepSeek sparse attention
with a lightning indexer, sigmoid-routed MoE with shared expert and aux-loss-free bias), trained
from scratch on the King James Version of the Bible. It is colibri-node's embedded default model:
small enough to ship in the repository, but really trained, so that its greedy output is readable
English and its routing and DSA selection are the learned, non-uniform kind rather than random.

Produced by `tools/train_tiny_glm5.py` (see `tools/README.md`, "Training the embedded model").
It is a plain text-continuation model; the chat template exists for API compatibility and was only
lightly trained (single-turn "continue the verse" chats).

## Files

| file | content |
|---|---|
| `config.json` | `GlmMoeDsaConfig` (transformers {transformers.__version__}) |
| `generation_config.json` | eos ids `[{sp['<|endoftext|>']}, {sp['<|user|>']}, {sp['<|observation|>']}]` (`<\\|endoftext\\|>`, `<\\|user\\|>`, `<\\|observation\\|>`), greedy |
| `model.safetensors` | {size / 1e6:.2f} MB; BF16 except `mlp.gate.e_score_correction_bias` (F32) |
| `tokenizer.json`, `tokenizer_config.json` | byte-level BPE, {tok.get_vocab_size()} ids, chat template |
| `training_log.txt` | the training run's log |

## Architecture

| field | value |
|---|---|
| hidden_size | {config.hidden_size} |
| num_hidden_layers | {config.num_hidden_layers} (layer 0 dense MLP, layers 1-5 MoE; `first_k_dense_replace` 1) |
| intermediate_size (dense) | {config.intermediate_size} |
| routed experts / per token | {E} / {k}, `n_group` {config.n_group}, `topk_group` {config.topk_group} |
| shared experts | {config.n_shared_experts} |
| moe_intermediate_size | {config.moe_intermediate_size} (with 32 experts, or 192 rows, the bf16 checkpoint would not fit the 25 MB size limit) |
| routed_scaling_factor, norm_topk_prob | {config.routed_scaling_factor}, {config.norm_topk_prob} |
| attention (MLA) | {config.num_attention_heads} heads, q_lora_rank {config.q_lora_rank}, kv_lora_rank {config.kv_lora_rank}, qk_nope {config.qk_nope_head_dim}, qk_rope {config.qk_rope_head_dim}, v {config.v_head_dim} |
| DSA indexer | index_n_heads {config.index_n_heads}, index_head_dim {config.index_head_dim}, index_topk {config.index_topk}, every layer `full` |
| RoPE | default, theta {config.rope_parameters['rope_theta']:g}, interleaved (as transformers does for GLM-5) |
| vocab_size | {config.vocab_size} |
| max_position_embeddings | {config.max_position_embeddings} |
| tie_word_embeddings | {config.tie_word_embeddings} |
| MTP layers | 1 (`num_nextn_predict_layers` 1): `model.layers.{config.num_hidden_layers}.*`, DeepSeek-V3's layout (`eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, one MoE decoder layer; embeddings and lm_head shared), {n_mtp:,} parameters |
| parameters | {n_params:,} ({', '.join(f'{d} {v:,}' for d, v in dtypes.items())}); ~{active / 1e6:.1f} M active per token |

## Corpus

King James Version (public domain), Debian packages `bible-kjv-text` (data) + `bible-kjv` (the `bible`
reader that decompresses it), version 4.38. `bible -l 100000 gen1:1-rev22:21` prints all 66 books;
chapter header lines and verse numbers are dropped, whitespace runs inside a verse collapse to one
space, and each verse becomes one line. A book is its verses joined by newlines (plus a final
newline); `<|endoftext|>` separates books in the token stream.

- training: {stats['books_train']} books (Genesis .. 2 Peter), {stats['verses_train']} verses, {stats['chars_train']:,} characters
- held out: {', '.join(stats['heldout_books'])} ({stats['verses_heldout']} verses, {stats['chars_heldout']:,} characters,
  {stats['heldout_fraction']:.2%} of the text), never seen by the tokenizer trainer or the model
- {args.chat_frac:.0%} of the training rows come from a stream of single-turn chats built from consecutive
  verses of a chapter: `[gMASK]<sop><|user|>\\n{{verse i}}<|assistant|>\\n{{verse i+1}}<|user|>`

## Tokenizer

`tokenizers` byte-level BPE trained on the training text: {BPE_VOCAB} BPE ids (256 byte symbols +
merges, min frequency 2), no normalizer, pre-tokenizer `Sequence[Split(GLM/Qwen regex, isolated),
ByteLevel(add_prefix_space=false, use_regex=false)]`, `ByteLevel` decoder, no post-processor (nothing
is prepended automatically). The GLM-5 special tokens follow the BPE vocabulary:

| token | id |
|---|---|
""" + "".join(f"| `{cell(t)}` | {i} |\n" for t, i in sp.items()) + f"""
`tokenizer_config.json`: eos and pad `<|endoftext|>`, no bos, and the chat template

```
{CHAT_TEMPLATE}
```

i.e. `[gMASK]<sop>` then `<|role|>\\n{{content}}` per message and `<|assistant|>\\n` for the
generation prompt; the assistant's turn ends when the model emits `<|user|>` (an eos id).

## Training

```sh
nice -n 10 python tools/train_tiny_glm5.py {f"--max-steps {args.max_steps}" if args.max_steps else f"--time-budget-min {args.time_budget_min:g}"} --lr {args.lr:g} --warmup-steps {args.warmup_steps}
```

CPU ({args.threads} threads, shared machine), fp32 weights and optimizer, the forward's matrix products in
bf16 under autocast (`--amp {args.amp}`), `attn_implementation="eager"`, experts through transformers'
`{args.experts}` path (the same math as its eager loop). {'A step schedule of ' + str(args.max_steps) + ' steps' if args.max_steps else 'A wall-time schedule'}. AdamW (betas 0.9/0.95, weight decay {args.wd} on matrices), peak lr
{args.lr:g}, {args.warmup_steps} warmup steps, cosine to {args.min_lr_ratio:.0%} over the wall-time budget,
batch {args.batch} x {args.seq_len} tokens (random windows), grad-norm clip {args.clip}, seed {args.seed}.

- Aux-loss-free balancing: after every optimizer step, per MoE layer,
  `e_score_correction_bias += {args.bias_gamma:g} * sign(mean_load - load_e)` from that step's expert counts
  (the bias is a buffer; no balancing loss).
- MTP layer: trained with the model, loss weight {args.mtp_weight:g} on its cross-entropy of token i+2 (DeepSeek-V3's
  objective); its gradient reaches the main layers through h_i, as in DeepSeek-V3.
- DSA indexer: trained by the DeepSeek-V3.2 KL objective (main attention summed over heads and
  L1-normalised, detached, vs. softmax of the index scores; indexer inputs detached). The first
  {args.dense_frac:.0%} of the run used dense attention (indexer warm-up); after that `index_topk` {config.index_topk}
  was active, so the model trained with sparse attention on positions >= {config.index_topk}, the KL taken
  over the selected keys.

| | |
|---|---|
| steps | {ck['step']} |
| tokens | {ck['tokens']:,} ({ck['tokens'] / n_train_tokens:.1f} passes over the {n_train_tokens:,}-token training stream) |
| training time | {ck['train_time'] / 60:.1f} min |
| final train loss | {final_loss:.3f} (mean of the last 5 log lines, {5 * args.log_every} steps) |
| last log line | `{last}` |

## Evaluation (held-out books)

{args.eval_seqs} non-overlapping windows of {args.seq_len + 1} tokens from the held-out stream, teacher-forced,
{bf16_eval['tokens']:,} predicted tokens, fp32 compute, eager attention and experts.

| weights | DSA | perplexity | bits/byte |
|---|---|---|---|
| fp32 (end of training) | on (index_topk {config.index_topk}) | {fp32_eval['ppl']:.2f} | {fp32_eval['bits_per_byte']:.3f} |
| **this checkpoint (bf16 values, loaded in fp32)** | **on** | **{bf16_eval['ppl']:.2f}** | **{bf16_eval['bits_per_byte']:.3f}** |
| this checkpoint | off (index_topk lifted, dense) | {dense_eval['ppl']:.2f} | {dense_eval['bits_per_byte']:.3f} |

Indexer quality (dense attention, queries at positions >= {config.index_topk}, averaged over heads and
layers): the indexer's top-{config.index_topk} keys carry {recall['indexer']:.1%} of the attention mass; the
{config.index_topk} most recent keys carry {recall['last_keys']:.1%}.

Note for parity checks beyond {config.index_topk} tokens: the index score is
`sum_h w_h * relu(q_h . k)` with only {config.index_n_heads} indexer heads, so many visible keys score exactly 0
({recall['zero_scores']:.1%} of the visible keys, same rows), and in {recall['tie_rows']:.1%} of the rows the
{config.index_topk}-th and the next score are exactly equal. Which of the tied keys is selected is
implementation-defined (`torch.topk` does not specify it), so logits of positions >= {config.index_topk} can
differ between correct implementations; up to {config.index_topk} tokens every visible key is selected and
there is no such ambiguity.

### MTP layer (held-out windows, fp32 training weights)

Perplexity of token i+2 given the main model's h_i and token i+1: {mtp_eval['ppl']:.2f}; its argmax is token i+2
in {mtp_eval['top1']:.1%} of {mtp_eval['tokens']:,} positions (the share of one-token drafts a greedy main model would accept).
colibri-node loads this layer when asked (`LoadOptions::mtp`) and leaves it out of every run today.

### Greedy samples (this checkpoint in fp32, {SAMPLE_TOKENS} new tokens, no stop)

The share of distinct token 3-grams of each continuation is in brackets (1.0: no 3-gram repeats).

""" + "".join(f"- **{p}** ({d:.2f}) → {s!r}\n" for p, s, d in samples) + f"""
Chat template, greedy, 60 new tokens at most:
`{chat[0]!r}` → `{chat[1]!r}`

## Expert load on the held-out text

Fraction of routed (token, expert) pairs per expert, per MoE layer, on the {bf16_eval['tokens']:,} held-out
positions above (sorted, in %; uniform is {100 / E:.3f}%). Entropy is relative to uniform (1.0 = uniform).

| layer | tokens | max | min | max/min | entropy | sorted loads (%) |
|---|---|---|---|---|---|---|
""" + "\n".join(table) + f"""

Summary: max/min ratio {min(ratios):.1f} .. {max(ratios):.1f}, relative entropy {min(ents):.3f} .. {max(ents):.3f};
{verdict}.
"""
    (args.out / "README.md").write_text(md)
    log(f"wrote {args.out / 'README.md'}")


# --------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["all", "corpus", "tokenizer", "train", "finalize"], default="all")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--restart", action="store_true", help="ignore an existing training checkpoint")
    ap.add_argument("--train-only", choices=["all", "indexer"], default="all",
                    help="indexer: the model (and routing bias) frozen, only the DSA indexers learn "
                         "(with --dense-frac 1: the KL to dense attention over every visible key)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start training from this model folder's weights (a new optimizer and schedule)")
    ap.add_argument("--time-budget-min", type=float, default=40.0)
    ap.add_argument("--max-steps", type=int, default=0, help="step-based schedule instead of wall time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--long-seq-len", type=int, default=1536,
                    help="row length of the last --long-frac of training (0: off); batch scaled to keep tokens per step")
    ap.add_argument("--long-frac", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--indexer-lr", type=float, default=0.0,
                    help="peak lr of the DSA indexers (0: --lr); same warmup and schedule")
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-gamma", type=float, default=1e-3)
    ap.add_argument("--dense-frac", type=float, default=0.1)
    ap.add_argument("--chat-frac", type=float, default=0.05)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--route-every", type=int, default=100)
    ap.add_argument("--ckpt-every-s", type=float, default=300.0)
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--experts", default="grouped_mm", help="transformers experts implementation in training")
    ap.add_argument("--amp", choices=["bf16", "off"], default="bf16", help="autocast of the training forward")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP layer's loss")
    ap.add_argument("--unlikelihood-token", type=float, default=0.0,
                    help="weight of the token-level unlikelihood loss (earlier tokens of the row; 0: off)")
    ap.add_argument("--unlikelihood-seq-every", type=int, default=0,
                    help=f"every N steps one more step on the sequence-level unlikelihood loss of {UL_ROWS} "
                         f"greedy continuations of {UL_LENGTH} tokens ({UL_NGRAM}-gram repeats; 0: off)")
    args = ap.parse_args()
    stages = ["corpus", "tokenizer", "train", "finalize"] if args.stage == "all" else [args.stage]
    for s in stages:
        globals()[f"stage_{s}"](args)


if __name__ == "__main__":
    main()
