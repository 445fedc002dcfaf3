#!/usr/bin/env python3
"""Writes tests/data/embedded/: transformers goldens for the embedded model models/glm5-tiny-kjv/.

  heldout.txt        whole verses from the start of 1 John (held-out block), about 6 KB, prepared
                     exactly as tools/train_tiny_glm5.py prepares its corpus
  windows.json       3 windows of the held-out token stream (48, 40 and 32 tokens; one crosses a
                     book boundary with <|endoftext|>), each the first candidate from a fixed start
                     with a top1-top2 logit gap >= 1e-2 and a router k-th/(k+1)-th gap >= 5e-5;
                     the ids, margins and the file of their logits
  logits_<i>.npy     float32 [T, vocab]: transformers' logits of window i, every position
  score.json         ids of heldout.txt (add_special_tokens=False), their teacher-forced mean NLL
                     and perplexity (one causal sequence) and the DSA tie count
  chat.json          3 conversations, the text the model's chat template renders and the ids of
                     AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

Golden model: GlmMoeDsaForCausalLM from the bf16 checkpoint loaded with dtype float32,
attn_implementation="eager", experts_implementation="eager", one thread. The windows stay within
index_topk (128) tokens, where every visible key is selected, so DSA tie-breaking cannot matter.
The score sequence is longer than index_topk: where the 128-th and 129-th index scores tie, which
key torch.topk keeps is unspecified. score.json therefore also holds the perplexity with ties
broken towards the lower position (colibri-node's rule) and the number of rows with such a tie.

Deterministic: the KJV text (Debian bible-kjv), the committed model files and one torch thread;
rerunning writes the same bytes on the same machine.

Usage: python tools/make_embedded_goldens.py [--out tests/data/embedded] [--model models/glm5-tiny-kjv]
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_glm5 as kjv  # noqa: E402  (corpus preparation and indexer helpers)

REPO = Path(__file__).resolve().parent.parent
HELDOUT_MAX_BYTES = 6144
# Windows: (book, chapter, verse, tokens taken before that verse's first token, length, what is
# moved when a candidate is rejected: "verse" (the next verse start) or "back" (one token earlier)).
WINDOWS = [
    ("1 John", 3, 1, 0, 48, "verse"),        # middle of 1 John
    ("Jude", 1, 1, 20, 40, "back"),          # end of 3 John, <|endoftext|>, start of Jude
    ("Revelation", 21, 1, 0, 32, "verse"),   # late in the stream
]
# A candidate window is taken only with margins that a correct fp32 implementation cannot cross:
# top1-top2 logit gap 1e-2 (ten times the 1e-3 logit tolerance, so argmax equality is a fair check)
# and k-th vs (k+1)-th biased router score 5e-5 (far above the ~1e-7 fp32 rounding of a sigmoid
# score, so that every token routes to the same experts; 2e-4 as for the random parity fixtures is
# rarely met by this trained router over 200 routed rows).
MIN_LOGIT_GAP = 1e-2
MIN_ROUTER_GAP = 5e-5
MAX_CANDIDATES = 60
CHATS = [
    {"name": "user_only",
     "messages": [{"role": "user", "content": "The LORD is my shepherd; I shall not want."}]},
    {"name": "system_and_user",
     "messages": [{"role": "system", "content": "Continue the verse in the words of the King James Version."},
                  {"role": "user", "content": "In the beginning was the Word, and the Word was with God,"}]},
    {"name": "multi_turn",
     "messages": [{"role": "system", "content": "Answer with one verse.\nKeep the old spelling."},
                  {"role": "user", "content": "Blessed are the poor in spirit:"},
                  {"role": "assistant", "content": "for theirs is the kingdom of heaven."},
                  {"role": "user", "content": "And what of them that mourn?  (Matthew 5:4 — “comfort”)"}]},
]


def heldout_books():
    """The held-out books as train_tiny_glm5.py's corpus stage splits them: [(book, [(chapter, text)])]."""
    books = kjv.read_kjv()
    names = [b for b, _ in books]
    split = names.index(kjv.HELDOUT_BOOKS[0])
    if names[split:] != kjv.HELDOUT_BOOKS:
        raise ValueError(f"held-out block mismatch: {names[split:]}")
    return books[split:]


def heldout_sample(books):
    """Whole verses from the start of the held-out block, as long as the text stays within the limit."""
    text = ""
    for _, verses in books:
        for _, verse in verses:
            line = verse + "\n"
            if len((text + line).encode()) > HELDOUT_MAX_BYTES:
                return text
            text += line
    return text


def heldout_stream(books, tok):
    """Token ids of the held-out stream (each book's tokens, then <|endoftext|>) and the stream offset
    of every verse's first token: {(book, chapter, verse number): offset}."""
    eot = tok.token_to_id("<|endoftext|>")
    ids, offsets = [], {}
    for book, verses in books:
        text, starts, number, chapter = "", [], 0, None
        for c, verse in verses:
            number = number + 1 if c == chapter else 1
            chapter = c
            starts.append(((book, c, number), len(text.encode())))
            text += verse + "\n"
        if not text.isascii():
            raise ValueError(f"{book}: non-ASCII text; token offsets are characters, not bytes")
        enc = tok.encode(text, add_special_tokens=False)
        token_starts = [o for o, _ in enc.offsets]
        for key, at in starts:
            first = next(i for i, s in enumerate(token_starts) if s >= at)
            offsets[key] = len(ids) + first
        ids.extend(enc.ids)
        ids.append(eot)
    return ids, offsets


def load_model(model_dir):
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    model.eval()
    return model


class RouterMargins:
    """Smallest gap between the k-th and (k+1)-th biased router score over every MoE layer and token."""

    def __init__(self, model):
        self.min_gap = math.inf
        self.handles = [g.register_forward_hook(self._hook) for _, g in kjv.moe_gates(model)]

    def _hook(self, gate, inputs, output):
        scores = output[0].float().sigmoid() + gate.e_score_correction_bias
        top = scores.topk(gate.top_k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, -2] - top[:, -1]).min()))

    def remove(self):
        for h in self.handles:
            h.remove()


class IndexerTies:
    """Per DSA layer: rows whose index_topk-th and next visible index scores are exactly equal."""

    def __init__(self, model):
        self.rows = self.tie_rows = 0
        self.handles = [layer.self_attn.register_forward_hook(self._hook, with_kwargs=True)
                        for layer in model.model.layers if layer.self_attn.indexer is not None]

    def _hook(self, attn, args, kwargs, output):
        topk = attn.indexer.index_topk
        hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        scores = kjv.indexer_scores(attn, hs, kwargs["position_embeddings"])
        scores = scores.masked_fill(~kjv.allowed_keys(kwargs["attention_mask"]), float("-inf"))
        if scores.shape[-1] <= topk:
            return
        rows = scores[:, topk:]  # queries that see more than topk keys
        top = rows.topk(topk + 1, dim=-1).values
        self.rows += top.shape[0] * top.shape[1]
        self.tie_rows += int((top[..., -2] == top[..., -1]).sum())

    def remove(self):
        for h in self.handles:
            h.remove()


class LowestPositionTies:
    """While active, the DSA indexer's top-k keeps the lower position among equal index scores
    (colibri-node's rule): torch.Tensor.topk is replaced during each indexer forward only, whose
    one topk call is the selection."""

    def __init__(self, model):
        self.original = torch.Tensor.topk
        self.handles = []
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                self.handles.append(layer.self_attn.indexer.register_forward_pre_hook(self._enter))
                self.handles.append(layer.self_attn.indexer.register_forward_hook(self._leave))

    def _enter(self, module, args):
        original = self.original

        def stable_topk(t, k, dim=-1, largest=True, sorted=True):
            if not largest or dim not in (-1, t.dim() - 1):
                return original(t, k, dim=dim, largest=largest, sorted=sorted)
            values, indices = torch.sort(t, dim=-1, descending=True, stable=True)
            return torch.return_types.topk((values[..., :k], indices[..., :k]))

        torch.Tensor.topk = stable_topk

    def _leave(self, module, args, output):
        torch.Tensor.topk = self.original

    def remove(self):
        torch.Tensor.topk = self.original
        for h in self.handles:
            h.remove()


@torch.no_grad()
def forward_logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def top_gap(logits):
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def mean_nll(logits, ids):
    return float(F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]), reduction="mean"))


def write_json(path, obj):
    """Indented JSON with every list of numbers on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    text = re.sub(r"\[\s*(-?[0-9][-+.eE0-9]*(?:,\s*-?[0-9][-+.eE0-9]*)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    path.write_text(text + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "embedded")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "glm5-tiny-kjv")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model)
    index_topk = model.config.index_topk
    versions = dict(transformers=transformers.__version__, torch=torch.__version__.split("+")[0],
                    tokenizers=tokenizers.__version__, numpy=np.__version__)
    books = heldout_books()

    # Windows of the held-out stream, each its own sequence from position 0.
    stream, offsets = heldout_stream(books, tok)
    verse_keys = list(offsets)  # in stream order
    windows = []
    for i, (book, chapter, verse, back, length, vary) in enumerate(WINDOWS):
        if length > index_topk:
            raise ValueError(f"window {i}: {length} tokens > index_topk {index_topk}")
        first = verse_keys.index((book, chapter, verse))
        for attempt in range(MAX_CANDIDATES):
            key = verse_keys[first + attempt] if vary == "verse" else verse_keys[first]
            before = back + attempt if vary == "back" else back
            start = offsets[key] - before
            ids = stream[start:start + length]
            router = RouterMargins(model)
            logits = forward_logits(model, ids)
            router.remove()
            gap = top_gap(logits)
            if gap >= MIN_LOGIT_GAP and router.min_gap >= MIN_ROUTER_GAP:
                break
        else:
            raise ValueError(f"window {i}: no candidate with the required margins in {MAX_CANDIDATES}")
        np.save(args.out / f"logits_{i}.npy", logits.numpy().astype(np.float32))
        windows.append(dict(file=f"logits_{i}.npy", start="{} {}:{}".format(*key), tokens_before_start=before,
                            stream_offset=start, candidates_rejected=attempt, ids=ids,
                            text=tok.decode(ids, skip_special_tokens=False), argmax=logits.argmax(-1).tolist(),
                            min_top1_top2_gap=gap, min_router_gap=router.min_gap, mean_nll=mean_nll(logits, ids),
                            logit_range=[float(logits.min()), float(logits.max())]))
        print(f"window {i}: {length} tokens from {windows[-1]['start']} - {before} ({attempt} rejected), "
              f"min top1-top2 gap {gap:.3g}, min router gap {router.min_gap:.3g}")
    write_json(args.out / "windows.json", dict(
        model="models/glm5-tiny-kjv", golden="transformers GlmMoeDsaForCausalLM, fp32 compute on the bf16 "
        "checkpoint, eager attention and experts, one forward per window without cache",
        index_topk=index_topk, vocab_size=model.config.vocab_size,
        min_top1_top2_gap=min(w["min_top1_top2_gap"] for w in windows),
        min_router_gap=min(w["min_router_gap"] for w in windows),
        required=dict(min_top1_top2_gap=MIN_LOGIT_GAP, min_router_gap=MIN_ROUTER_GAP),
        versions=versions, windows=windows))

    # Perplexity of the held-out sample, one causal sequence.
    text = heldout_sample(books)
    (args.out / "heldout.txt").write_text(text)
    ids = hf_tok.encode(text, add_special_tokens=False)
    if ids != tok.encode(text, add_special_tokens=False).ids:
        raise ValueError("AutoTokenizer and tokenizers disagree on heldout.txt")
    if len(ids) > model.config.max_position_embeddings:
        raise ValueError(f"heldout.txt: {len(ids)} tokens > max_position_embeddings")
    ties = IndexerTies(model)
    logits = forward_logits(model, ids)
    ties.remove()
    nll = mean_nll(logits, ids)
    lowest = LowestPositionTies(model)
    nll_lowest = mean_nll(forward_logits(model, ids), ids)
    lowest.remove()
    score = dict(file="heldout.txt", bytes=len(text.encode()), tokens=len(ids), predicted_tokens=len(ids) - 1,
                 mean_nll=nll, perplexity=math.exp(nll),
                 lowest_position_ties=dict(mean_nll=nll_lowest, perplexity=math.exp(nll_lowest)),
                 dsa_rows_beyond_topk=ties.rows, dsa_tie_rows=ties.tie_rows, ids=ids,
                 how="ids = AutoTokenizer.encode(text, add_special_tokens=False); one forward without cache; "
                 "mean over positions 1..T-1 of -log softmax(logits[t-1])[ids[t]]; lowest_position_ties: the "
                 "same with equal DSA index scores selected by lower position",
                 versions=versions)
    write_json(args.out / "score.json", score)
    print(f"heldout.txt: {score['bytes']} bytes, {len(ids)} tokens, perplexity {score['perplexity']:.4f} "
          f"(lowest-position ties {score['lowest_position_ties']['perplexity']:.4f}), "
          f"DSA tie rows {ties.tie_rows} / {ties.rows}")

    # Chat template.
    chats = []
    for chat in CHATS:
        rendered = hf_tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
        encoded = hf_tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=True)
        ids = list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)
        if ids != tok.encode(rendered, add_special_tokens=False).ids:
            raise ValueError(f"chat {chat['name']}: template ids differ from encoding the rendered text")
        chats.append(dict(chat, add_generation_prompt=True, text=rendered, ids=ids))
        print(f"chat {chat['name']}: {len(ids)} ids")
    write_json(args.out / "chat.json", dict(
        how="AutoTokenizer.from_pretrained(models/glm5-tiny-kjv).apply_chat_template(messages, "
        "add_generation_prompt=True, tokenize=True); text: the same with tokenize=False",
        versions=versions, conversations=chats))

    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({total} bytes)")


if __name__ == "__main__":
    main()
